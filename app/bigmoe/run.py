"""The steps of `bigmoe run`, shared by the TUI and the headless shell:
probe -> plan -> obtain the model -> prepare -> launch (-> watch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bigmoe.cli import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.model import presets
from bigmoe.serve import launch, records
from bigmoe.serve.preflight import preflight

Progress = Callable[[str, dict], None]
"""Called with (event, fields) as a step advances; the shells render it."""


@dataclass
class RunOptions:
    """What the person asked `bigmoe run` for."""

    model: str
    """Preset name (or a preset TOML path)."""
    prompt: str | None = None
    """One chat request to send once the server is ready; then stop."""
    max_tokens: int = 64
    """Tokens to generate for the prompt."""
    host: str = "127.0.0.1"
    """Address the server binds."""
    port: int = 8000
    """Port of the OpenAI-compatible API."""
    api_key: str | None = None
    """API key vLLM requires, if any; it reaches vLLM as VLLM_API_KEY in its environment, never on its command line."""
    model_dir: str | None = None
    """Checkpoint directory to serve instead of fetching or making one."""
    paging_dir: str | None = None
    """Directory of the paging file (None = bigmoe's cache)."""
    vram_slots: int | None = None
    """VRAM expert slots per layer, beating the plan."""
    ram_slots: int | None = None
    """RAM expert slots per layer, beating the plan."""
    compress: str | None = None
    """Codec on/off/auto, beating the plan."""
    context: int | None = None
    """Context length, beating the plan."""
    force: bool = False
    """Launch a plan the estimator refused."""
    cuda_graphs: bool = True
    """On CUDA: the device-driven pager with decode in CUDA graphs (False: host-driven, eager)."""
    prefill_buffer: bool | None = None
    """On CUDA, device-driven: reserve a whole-layer VRAM buffer for prefill (None = the plan decides)."""
    speculative_tokens: int = 0
    """Draft tokens per step from the model's MTP head (bigmoe run --speculative-tokens); 0 = off."""
    vram_gib: float | None = None
    """Plan for this much VRAM (GiB) instead of the probed GPU's."""
    ram_gib: float | None = None
    """Plan for this much RAM (GiB) instead of the probed amount."""
    start_timeout: float = 900.0
    """Seconds to wait for /health."""


class VllmMissing(BigmoeError):
    """vLLM is not importable in this environment."""


class PlanRefused(BigmoeError):
    """The estimator refused the plan and --force was not given."""

    exit_code = exit_codes.PLAN_REFUSED


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the API is reachable beyond this machine and needs no key; None otherwise."""
    if api_key:
        return None
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any address
    return (
        f"--host {host} serves the API beyond this machine without --api-key: anyone who can reach it can use "
        "the model; add --api-key (or set BIGMOE_API_KEY)"
    )


def load_preset(opts: RunOptions) -> presets.Preset:
    """The preset MODEL names; a checkpoint directory as MODEL is also the directory served (--model-dir)."""
    if presets.is_checkpoint_dir(opts.model) and not opts.model_dir:
        opts.model_dir = str(Path(opts.model).expanduser())
    return presets.load(opts.model)


def probe_machine(preset: presets.Preset, opts: RunOptions):
    """The machine, with the disks that will hold the model and the paging file judged."""
    from bigmoe.machine.probe import probe
    from bigmoe.plan.planner import default_dirs

    model_dir, paging_dir = default_dirs(preset)
    dirs = [
        Path(opts.model_dir).expanduser() if opts.model_dir else Path(model_dir),
        Path(opts.paging_dir).expanduser() if opts.paging_dir else Path(paging_dir),
    ]
    return probe(paths=[_nearest_existing(d) for d in dirs], measure=True)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def make_plan(hardware, preset: presets.Preset, opts: RunOptions, model_on_disk: bool = False):
    """The plan, with the architecture numbers of the checkpoint's config.json when it is on disk
    (--model-dir, the synthetic model already made, or a finished download), the preset's otherwise."""
    from bigmoe.model.checkpoint_arch import facts_for, find_checkpoint
    from bigmoe.plan.planner import Overrides, plan

    checkpoint, why_not = find_checkpoint(preset, opts.model_dir, _dtypes_for(hardware, preset))

    overrides = Overrides(
        vram_slots=opts.vram_slots,
        ram_slots=opts.ram_slots,
        compress=opts.compress,
        context=opts.context,
        force=opts.force,
        cuda_graphs=opts.cuda_graphs,
        prefill_buffer=opts.prefill_buffer,
        speculative_tokens=opts.speculative_tokens,
        host=opts.host,
        port=opts.port,
        vram_gib=opts.vram_gib,
        ram_gib=opts.ram_gib,
        model_path=_expanded(opts.model_dir),
        model_dir=_expanded(opts.model_dir),
        model_on_disk=model_on_disk or bool(opts.model_dir),
        paging_dir=str(Path(opts.paging_dir).expanduser()) if opts.paging_dir else None,
    )
    return plan(hardware, preset, overrides, facts_for(preset, str(checkpoint) if checkpoint else None, why_not))


def _expanded(path: str | None) -> str | None:
    return str(Path(path).expanduser()) if path else None


def _dtypes_for(hardware, preset: presets.Preset) -> tuple[str, ...]:
    """Expert dtypes in the order the plan will prefer them on this machine."""
    first, second = (
        (preset.dtype_gpu, preset.dtype_cpu) if hardware.gpu() is not None else (preset.dtype_cpu, preset.dtype_gpu)
    )
    return (first, second) if first != second else (first,)


def obtain_model(preset: presets.Preset, the_plan, opts: RunOptions, progress: Progress) -> Path:
    """The checkpoint directory to serve (given, made locally, or fetched), checked against the preset."""
    path = _locate_model(preset, the_plan, opts, progress)
    presets.check_config(preset, path)
    preflight(the_plan, path, opts.host, opts.port, preset.synthetic, opts.model)  # settings, shards, port, disk
    return path


def _locate_model(preset: presets.Preset, the_plan, opts: RunOptions, progress: Progress) -> Path:
    """The checkpoint directory to serve: given, made locally (synthetic presets), or fetched."""
    if opts.model_dir:
        path = Path(opts.model_dir).expanduser()
        if not (path / "config.json").is_file() or not os.access(path / "config.json", os.R_OK):
            raise BigmoeError(f"--model-dir {path}: no readable config.json there")
        return path
    if preset.synthetic:
        from bigmoe.model.synthetic import ensure_tiny_model

        progress("model", {"state": "making", "name": preset.name, "dtype": the_plan.expert_dtype})
        path = ensure_tiny_model(preset, the_plan.expert_dtype)
        progress("model", {"state": "ready", "path": str(path)})
        return path
    from bigmoe.model import fetch

    fetch_plan = fetch.dry_run(preset.hub_id, preset.revision)
    progress("fetch", {"state": "planned", "bytes": fetch_plan.bytes_to_download, "files": len(fetch_plan.files)})
    return fetch.fetch(
        fetch_plan, lambda p: progress("fetch", p.__dict__ if hasattr(p, "__dict__") else {"progress": str(p)})
    )


def require_vllm() -> None:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise VllmMissing(
            "vLLM is not installed in this Python environment; run installer/install.sh "
            "(or pip install 'bigmoe[cpu]' / 'bigmoe[cuda]')"
        )


def plan_for_checkpoint(the_plan, preset: presets.Preset, model_path: Path, opts: RunOptions):
    """The plan whose command serves `model_path`: `the_plan` when it was made for it, else the plan made
    again now that the checkpoint is on disk (a download lands where no plan could name it before)."""
    if Path(the_plan.model_path) == Path(model_path):
        return the_plan
    again = make_plan(
        the_plan.hardware, preset, dataclasses.replace(opts, model_dir=str(model_path)), model_on_disk=True
    )
    if again.refusals and not opts.force:
        raise PlanRefused(
            f"plan refused once the checkpoint was read: {again.refusal} (rerun with --force to launch anyway)"
        )
    return again


def start_server(preset: presets.Preset, the_plan, model_path: Path, opts: RunOptions) -> launch.Server:
    """Start vLLM with the plan's command exactly as `bigmoe plan` prints it; the API key goes in its environment."""
    require_vllm()
    the_plan = plan_for_checkpoint(the_plan, preset, model_path, opts)
    info = records.RunInfo(
        name=preset.name,
        pid=0,
        host=opts.host,
        port=opts.port,
        log=str(records.log_name(preset.name, opts.port, time.strftime("%Y%m%d-%H%M%S"))),
        model_path=str(model_path),
        served_name=preset.name,
        started=time.time(),
    )
    secrets = {"VLLM_API_KEY": opts.api_key} if opts.api_key else {}
    return launch.start(list(the_plan.argv), dict(the_plan.env), info, secrets)
