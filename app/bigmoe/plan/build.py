"""build: the one way from what the person stated to a Plan, for `bigmoe run` and `bigmoe plan` alike.

stated() makes the command-line values plain (paths expanded, `--compress auto` left to the plan, a given
checkpoint directory served as it is); probe_for() probes the machine with the disks that will hold the
model and the paging file; build() finds the checkpoint whose numbers the plan reads and runs the estimator.
"""

from __future__ import annotations

from pathlib import Path

from bigmoe.machine.hardware import Hardware
from bigmoe.model import presets
from bigmoe.model.checkpoint_arch import facts_for, find_checkpoint, preset_for
from bigmoe.plan.inputs import Overrides, PlanError, default_dirs
from bigmoe.plan.planner import Plan, plan


def load(model: str, model_dir: str | None) -> tuple[presets.Preset, str | None]:
    """The preset MODEL names and the checkpoint directory to serve: --model-dir, else MODEL itself when it is
    a checkpoint directory, else None (made or fetched later)."""
    if presets.is_checkpoint_dir(model):
        model_dir = model_dir or model
        return preset_for(Path(model).expanduser()), _expanded(model_dir)
    return presets.load(model), _expanded(model_dir)


def stated(**options) -> Overrides:
    """Overrides from command-line values (the names of Overrides' fields; None = not stated)."""
    model_dir = _expanded(options.pop("model_dir", None))
    compress = options.pop("compress", None)
    return Overrides(
        model_dir=model_dir,
        model_path=model_dir,  # a given directory is served as it is
        model_on_disk=model_dir is not None,
        paging_dir=_expanded(options.pop("paging_dir", None)),
        compress=None if compress == "auto" else compress,
        **options,
    )


def probe_for(preset: presets.Preset, ov: Overrides, root: Path = Path("/")) -> Hardware:
    """The machine under `root`, with the disks of the model and paging directories judged (none when the
    person stated the disk) and link speeds measured or read from their cache."""
    from bigmoe.machine.probe import probe

    if ov.disk is not None or ov.disk_gib is not None:
        return probe(root, [], measure=True)
    model_dir, paging_dir = default_dirs(preset)
    return probe(root, [Path(ov.model_dir or model_dir), Path(ov.paging_dir or paging_dir)], measure=True)


def build(hw: Hardware, preset: presets.Preset, ov: Overrides) -> Plan:
    """The plan for `preset` on `hw` as stated, with the architecture numbers of the checkpoint on disk (the
    given directory, the synthetic model already made, or a finished download), the preset's otherwise.
    PlanError when a given directory holds no checkpoint, or an override makes no sense."""
    checkpoint, why_not = find_checkpoint(preset, ov.model_path, dtypes_for(hw, ov, preset))
    if ov.model_path and checkpoint is None:
        raise PlanError(f"--model-dir {ov.model_path}: {why_not}")
    return plan(hw, preset, ov, facts_for(preset, str(checkpoint) if checkpoint else None, why_not))


def dtypes_for(hw: Hardware, ov: Overrides, preset: presets.Preset) -> tuple[str, ...]:
    """Expert dtypes in the order the plan will prefer them on this machine (a stated GPU counts)."""
    gpu = hw.gpu() is not None or ov.vram_gib is not None or ov.gpu is not None
    first, second = (preset.dtype_gpu, preset.dtype_cpu) if gpu else (preset.dtype_cpu, preset.dtype_gpu)
    return (first, second) if first != second else (first,)


def _expanded(path: str | None) -> str | None:
    return str(Path(path).expanduser()) if path else None
