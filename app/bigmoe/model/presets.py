"""Model presets: plain data read from the TOML files shipped in `bigmoe.preset_files`."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path


class PresetError(ValueError):
    """A preset is unknown or malformed; the message is one line."""


@dataclass(frozen=True)
class Arch:
    """Architecture numbers the planner needs."""

    moe_layers: int
    """MoE layers (each with its own experts)."""
    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to per layer."""
    shared_experts: int
    """Always-on shared experts per layer (counted in dense_bytes)."""
    hidden: int
    """Model hidden size."""
    moe_intermediate: int
    """Intermediate size of one routed expert."""
    vocab: int
    """Vocabulary size."""
    expert_bytes_fp8: int
    """Bytes of one routed expert in FP8 with its block scales."""
    expert_bytes_bf16: int
    """Bytes of one routed expert in bf16."""
    dense_bytes: int
    """Bytes of every non-routed weight (embeddings, attention, shared experts, head)."""
    ngram_table_bytes: int
    """Bytes of the n-gram (PLE) table, 0 when the model has none."""
    kv_bytes_per_token: int
    """KV-cache bytes one token of context needs."""
    max_context: int
    """Longest context the model supports (tokens)."""
    mtp_layers: int = 0
    """Decoder layers of the model's MTP head (each with its own routed experts); 0 = no MTP head."""


@dataclass(frozen=True)
class Preset:
    """One model bigmoe knows how to run."""

    name: str
    """Name used on the command line."""
    hub_id: str
    """Hugging Face repository, empty for a model made locally."""
    revision: str
    """Hub revision to fetch."""
    architecture: str
    """The `architectures[0]` its config.json must name."""
    description: str
    """One line for listings."""
    synthetic: bool
    """Made locally by scripts/make_tiny_moe.py instead of downloaded."""
    dtype_cpu: str
    """Expert dtype to run with on a CPU (bf16 where the CPU has no FP8 MoE)."""
    dtype_gpu: str
    """Expert dtype to run with on a GPU."""
    arch: Arch
    """Architecture numbers."""
    vllm_args: tuple[str, ...] = ()
    """Flags `vllm serve` needs for this model."""
    vllm_env: dict[str, str] = field(default_factory=dict)
    """Environment variables vLLM needs for this model."""
    cpu_paging: tuple[int, int] | None = None
    """(device slots, RAM slots) per layer a CPU run pages with unless told otherwise, so the demo shows
    the pager and its SSD tier at work ([plan] cpu_vram_slots/cpu_ram_slots); None = every expert resident."""
    source: str = ""
    """File the preset was read from."""

    def expert_bytes(self, dtype: str) -> int:
        return self.arch.expert_bytes_fp8 if dtype == "fp8" else self.arch.expert_bytes_bf16

    def total_expert_bytes(self, dtype: str) -> int:
        return self.expert_bytes(dtype) * self.arch.experts * self.arch.moe_layers


def names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in _files() if p.name.endswith(".toml"))


def load(name_or_path: str) -> Preset:
    """A preset by name or from a TOML file path (a checkpoint directory's: checkpoint_arch.preset_for)."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") and path.exists():
        return parse(path.read_text(), str(path))
    for item in _files():
        if item.name == f"{name_or_path}.toml":
            return parse(item.read_text(), f"preset {name_or_path}")
    raise PresetError(f"unknown model {name_or_path!r}; known: {', '.join(names())}")


def is_checkpoint_dir(name_or_path: str) -> bool:
    """True when MODEL names a directory with a config.json (a checkpoint to serve) rather than a preset."""
    path = Path(name_or_path).expanduser()
    return path.is_dir() and (path / "config.json").is_file()


def parse(text: str, source: str) -> Preset:
    try:
        data = tomllib.loads(text)
        model, arch, vllm, plan = data["model"], data["arch"], data.get("vllm", {}), data.get("plan", {})
        preset = Preset(
            name=str(model["name"]),
            hub_id=str(model.get("hub_id", "")),
            revision=str(model.get("revision", "main")),
            architecture=str(model["architecture"]),
            description=str(model.get("description", "")),
            synthetic=bool(model.get("synthetic", False)),
            dtype_cpu=str(model.get("dtype_cpu", "bf16")),
            dtype_gpu=str(model.get("dtype_gpu", "fp8")),
            arch=Arch(
                **{
                    k: int(arch[k])
                    for k, f in Arch.__dataclass_fields__.items()
                    if k in arch or f.default is dataclasses.MISSING
                }
            ),
            vllm_args=tuple(str(a) for a in vllm.get("args", [])),
            vllm_env={str(k): str(v) for k, v in vllm.get("env", {}).items()},
            cpu_paging=(int(plan["cpu_vram_slots"]), int(plan["cpu_ram_slots"])) if "cpu_vram_slots" in plan else None,
            source=source,
        )
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{source} is not valid TOML: {e}") from None
    except KeyError as e:
        raise PresetError(f"{source} lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise PresetError(f"{source} has a bad value: {e}") from None
    for dtype in (preset.dtype_cpu, preset.dtype_gpu):
        if dtype not in ("fp8", "bf16"):
            raise PresetError(f"{source}: dtype {dtype!r} must be fp8 or bf16")
    return preset


SOURCE_TREE_PRESETS = Path(__file__).resolve().parents[3] / "presets"
"""The presets folder of a source checkout, for runs with PYTHONPATH=app (no install maps `bigmoe.preset_files`)."""


def _files():
    try:
        return list(resources.files("bigmoe.preset_files").iterdir())
    except ModuleNotFoundError:
        if not SOURCE_TREE_PRESETS.is_dir():
            raise
        return list(SOURCE_TREE_PRESETS.iterdir())


# Names the same number goes by in the config.json of different Qwen MoE generations.
CONFIG_KEYS = {
    "experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok", "moe_top_k"),
    "hidden": ("hidden_size",),
    "moe_intermediate": ("moe_intermediate_size",),
}


def check_config(preset: Preset, model_dir) -> None:
    """Raise PresetError (one line) when the checkpoint's config.json disagrees with the preset's architecture."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PresetError(f"cannot read {path}: {e}") from None
    text = config.get("text_config", config)
    archs = config.get("architectures") or []
    if archs and archs[0] != preset.architecture:
        raise PresetError(f"{path} is a {archs[0]}, but preset {preset.name} is for {preset.architecture}")
    for field_name, keys in CONFIG_KEYS.items():
        found = next((text[k] for k in keys if k in text), None)
        wanted = getattr(preset.arch, field_name)
        if found is not None and int(found) != wanted:
            raise PresetError(f"{path}: {keys[0]} is {found}, but preset {preset.name} says {field_name} = {wanted}")
    from bigmoe_pager.model_config import moe_layer_count

    layers = moe_layer_count(text)
    if layers is not None and layers != preset.arch.moe_layers:
        raise PresetError(
            f"{path}: the model has {layers} MoE layers, but preset {preset.name} says {preset.arch.moe_layers}"
        )
