"""checkpoint_arch: the architecture numbers a plan uses, each with where it came from.

When the checkpoint is on disk its config.json gives the layer, expert and size numbers
(expert bytes are computed from them and the FP8 quantization_config), and its safetensors
headers give the dense bytes; the preset's numbers stand in for anything the checkpoint does
not say, and for everything before the model is downloaded. Numbers the checkpoint gives
differently from the preset are listed, one line each, so the plan can show them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from bigmoe_pager.core.safetensors_header import CheckpointError, read_header

from bigmoe.model import presets
from bigmoe.model.presets import CONFIG_KEYS, Arch, Preset, PresetError

FROM_CONFIG = "from config.json"
FROM_HEADERS = "from the safetensors headers"
FROM_PRESET = "from preset"

FP8_SCALE_BYTES = 4
"""Bytes of one FP8 block scale (weight_scale_inv is float32 in Qwen's FP8 checkpoints)."""
BF16_BYTES = 2
PROJECTIONS = 3
"""Matrices of one routed expert: gate, up (intermediate x hidden) and down (hidden x intermediate)."""
"""Bytes; a safetensors header longer than this is taken for garbage, not read."""
ROUTED_EXPERT = re.compile(r"\.experts\.")
"""Tensor names of routed experts (shared experts are named shared_expert(s), without the dot)."""
NGRAM_SHARD = re.compile(r"\.shard_\d+\.weight$")
"""Tensor names of the n-gram table's shards."""
NOT_LOADED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")
"""Tensors vLLM does not load for a text-only run without speculative decoding (MTP, vision)."""


class CheckpointConfigError(PresetError):
    """A checkpoint's config.json or safetensors headers cannot be read; the message is one line."""


@dataclass(frozen=True)
class ArchFacts:
    """A preset's architecture numbers with the origin of each."""

    arch: Arch
    """The numbers the plan uses."""
    origins: dict[str, str]
    """Arch field -> where its value came from and how, one line starting with FROM_*."""
    mismatches: tuple[str, ...]
    """Numbers the checkpoint gives differently from the preset, one line each."""
    config_path: str | None
    """The config.json read; None when every number is the preset's."""


def preset_facts(preset: Preset, why: str) -> ArchFacts:
    """Every number from the preset, `why` saying why the checkpoint was not read."""
    origins = {name: f"{FROM_PRESET} {preset.name} ({why})" for name in Arch.__dataclass_fields__}
    return ArchFacts(preset.arch, origins, (), None)


def read_facts(preset: Preset, model_dir: Path) -> ArchFacts:
    """The numbers of the checkpoint in `model_dir` (config.json and safetensors headers), the
    preset's for what they do not say. CheckpointConfigError when a file there cannot be read."""
    path = Path(model_dir) / "config.json"
    config = _load_json(path)
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise CheckpointConfigError(f"{path}: text_config is not an object")
    found: dict[str, tuple[int, str]] = {}
    for name, keys in CONFIG_KEYS.items():
        key = next((k for k in keys if k in text), None)
        if key is not None:
            found[name] = (_int(path, key, text[key]), f"{FROM_CONFIG} ({key})")
    if "vocab_size" in text:  # max_context stays the preset's: it may cap the model's own limit on purpose
        found["vocab"] = (_int(path, "vocab_size", text["vocab_size"]), f"{FROM_CONFIG} (vocab_size)")
    found.update(_moe_layers(path, text))
    found.update(_shared_experts(path, text))
    if "hidden" in found and "moe_intermediate" in found:
        found.update(_expert_bytes(path, config, found["hidden"][0], found["moe_intermediate"][0]))
    found.update(_ngram_bytes(path, config))
    found.update(_kv_bytes(path, text))
    found.update(_mtp_layers(path, text))
    values = {
        name: found[name][0] if name in found else getattr(preset.arch, name) for name in Arch.__dataclass_fields__
    }
    headers, routed = _sums_from_headers(Path(model_dir))
    found.update(headers)
    values.update({name: v for name, (v, _) in headers.items()})
    origins = {
        name: found[name][1] if name in found else f"{FROM_PRESET} {preset.name} (config.json does not say)"
        for name in Arch.__dataclass_fields__
    }
    mismatches = [
        f"{name} is {values[name]} {FROM_HEADERS if name in headers else FROM_CONFIG}, "
        f"but preset {preset.name} says {getattr(preset.arch, name)}"
        for name in Arch.__dataclass_fields__
        if name in found and values[name] != getattr(preset.arch, name)
    ]
    if routed is not None:
        dtype = "fp8" if _is_fp8(config) else "bf16"
        per_expert = values[f"expert_bytes_{dtype}"]
        expected = values["experts"] * values["moe_layers"] * per_expert
        if routed != expected:
            mismatches.append(
                f"the safetensors hold {routed} bytes of routed experts, not {values['experts']} experts x "
                f"{values['moe_layers']} layers x {per_expert} B ({dtype}) = {expected}"
            )
    return ArchFacts(Arch(**values), origins, tuple(mismatches), str(path))


def with_facts(preset: Preset, facts: ArchFacts) -> Preset:
    """The preset with the facts' numbers in place of its own."""
    return dataclasses.replace(preset, arch=facts.arch)


def preset_for(directory: Path) -> Preset:
    """The preset of the architecture the directory's config.json names (architectures[0]), with the
    architecture numbers read from the directory (config.json and safetensors headers) in place of its own."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PresetError(f"cannot read {path}: {e}") from None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(archs, list) or not archs:
        raise PresetError(f"{path} names no architectures; bigmoe picks the preset by architectures[0]")
    known = [presets.load(name) for name in presets.names()]
    matches = sorted((p for p in known if p.architecture == archs[0]), key=lambda p: (p.synthetic, p.name))
    if not matches:
        served = ", ".join(sorted({p.architecture for p in known}))
        raise PresetError(f"{path} is a {archs[0]}; bigmoe serves {served}")
    return with_facts(matches[0], read_facts(matches[0], Path(directory)))


def fp8_expert_bytes(hidden: int, intermediate: int, block: tuple[int, int] | None) -> int:
    """Bytes of one FP8 routed expert: 1-byte weights plus one fp32 scale per (block) of each
    matrix; block None = one scale per matrix (per-tensor quantization)."""
    weights = PROJECTIONS * hidden * intermediate
    if block is None:
        return weights + PROJECTIONS * FP8_SCALE_BYTES
    rows, cols = block
    up = math.ceil(intermediate / rows) * math.ceil(hidden / cols)  # gate and up: [intermediate, hidden]
    down = math.ceil(hidden / rows) * math.ceil(intermediate / cols)  # down: [hidden, intermediate]
    return weights + (2 * up + down) * FP8_SCALE_BYTES


# ---- config.json ----------------------------------------------------------------------------


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise CheckpointConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointConfigError(f"{path} is not a JSON object")
    return data


def _int(path: Path, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointConfigError(f"{path}: {key} is {value!r}, not a non-negative integer")
    return value


def _moe_layers(path: Path, text: dict) -> dict[str, tuple[int, str]]:
    from bigmoe_pager.model_config import moe_layer_count

    if "num_hidden_layers" not in text:
        return {}
    layers = _int(path, "num_hidden_layers", text["num_hidden_layers"])
    try:
        count = moe_layer_count(text)
    except (TypeError, ValueError) as e:
        raise CheckpointConfigError(f"{path}: mlp_only_layers / decoder_sparse_step are malformed ({e})") from None
    rules = [f"num_hidden_layers {layers}"]
    if text.get("decoder_sparse_step") not in (None, 1):
        rules.append(f"decoder_sparse_step {text['decoder_sparse_step']}")
    if text.get("mlp_only_layers"):
        rules.append(f"mlp_only_layers {sorted(text['mlp_only_layers'])}")
    return {"moe_layers": (count, f"{FROM_CONFIG} ({', '.join(rules)})")}


def _shared_experts(path: Path, text: dict) -> dict[str, tuple[int, str]]:
    if "n_shared_experts" in text:
        return {
            "shared_experts": (
                _int(path, "n_shared_experts", text["n_shared_experts"]),
                f"{FROM_CONFIG} (n_shared_experts)",
            )
        }
    if "shared_expert_intermediate_size" in text:
        size = _int(path, "shared_expert_intermediate_size", text["shared_expert_intermediate_size"])
        return {"shared_experts": (1 if size else 0, f"{FROM_CONFIG} (shared_expert_intermediate_size {size})")}
    return {}


def _expert_bytes(path: Path, config: dict, hidden: int, inter: int) -> dict[str, tuple[int, str]]:
    quant = config.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise CheckpointConfigError(f"{path}: quantization_config is not an object")
    size = f"{PROJECTIONS} x {hidden} x {inter}"
    if _is_fp8(config):
        block_raw = quant.get("weight_block_size")
        if block_raw is not None and (
            not isinstance(block_raw, list)
            or len(block_raw) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_raw)
        ):
            raise CheckpointConfigError(
                f"{path}: quantization_config.weight_block_size is {block_raw!r}, not [rows, cols]"
            )
        block = tuple(block_raw) if block_raw else None
        scales = f"{block[0]}x{block[1]} block" if block else "per-tensor"
        fp8_why = f"{FROM_CONFIG} ({size} FP8 + fp32 {scales} scales, quantization_config)"
    else:
        block = (128, 128)  # the block Qwen's official FP8 checkpoints use
        fp8_why = f"{FROM_CONFIG} ({size} FP8 + fp32 128x128 block scales; the checkpoint itself is not FP8)"
    return {
        "expert_bytes_fp8": (fp8_expert_bytes(hidden, inter, block), fp8_why),
        "expert_bytes_bf16": (PROJECTIONS * hidden * inter * BF16_BYTES, f"{FROM_CONFIG} ({size} bf16)"),
    }


def _ngram_bytes(path: Path, config: dict) -> dict[str, tuple[int, str]]:
    from bigmoe_pager.ngram.errors import NgramLayoutError
    from bigmoe_pager.ngram.spec import TableSpec

    text = config.get("text_config", config)
    layer_ids = text.get("ple_layer_ids")
    if not layer_ids:
        return {"ngram_table_bytes": (0, f"{FROM_CONFIG} (no ple_layer_ids: no n-gram table)")}
    try:
        specs = [TableSpec.from_config(config, layer) for layer in sorted(set(layer_ids))]
    except (NgramLayoutError, KeyError, TypeError, ValueError) as e:
        raise CheckpointConfigError(f"{path}: the n-gram table keys are malformed ({e})") from None
    rows = sum(s.rows for s in specs)
    return {
        "ngram_table_bytes": (
            sum(s.nbytes for s in specs),
            f"{FROM_CONFIG} ({rows:,} rows x {specs[0].row_bytes} B, ple_layer_ids {sorted(set(layer_ids))})",
        )
    }


ATTENTION_LAYER_TYPES = ("full_attention", "indexed_attention", "qwen_sparse_attention")
"""layer_types entries that keep a KV cache (linear-attention layers keep a fixed-size state instead)."""


def _kv_bytes(path: Path, text: dict) -> dict[str, tuple[int, str]]:
    """bf16 K and V bytes per token over the layers that have attention (every layer without layer_types)."""
    if "num_key_value_heads" not in text or "num_hidden_layers" not in text:
        return {}
    kv_heads = _int(path, "num_key_value_heads", text["num_key_value_heads"])
    if text.get("head_dim"):
        head_dim = _int(path, "head_dim", text["head_dim"])
    elif text.get("num_attention_heads") and "hidden_size" in text:
        head_dim = _int(path, "hidden_size", text["hidden_size"]) // _int(
            path, "num_attention_heads", text["num_attention_heads"]
        )
    else:
        return {}
    kinds = text.get("layer_types")
    if isinstance(kinds, list):
        layers, which = sum(kind in ATTENTION_LAYER_TYPES for kind in kinds), "full-attention layers (layer_types)"
    else:
        layers, which = _int(path, "num_hidden_layers", text["num_hidden_layers"]), "layers"
    return {
        "kv_bytes_per_token": (
            layers * 2 * kv_heads * head_dim * BF16_BYTES,
            f"{FROM_CONFIG} ({layers} {which} x K,V x {kv_heads} heads x {head_dim} x 2 B)",
        )
    }


def _mtp_layers(path: Path, text: dict) -> dict[str, tuple[int, str]]:
    """Decoder layers of the MTP head (each has routed experts of its own), when the config names them."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if key in text:
            return {"mtp_layers": (_int(path, key, text[key]), f"{FROM_CONFIG} ({key})")}
    return {}


def _is_fp8(config: dict) -> bool:
    quant = config.get("quantization_config") or {}
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8"


# ---- safetensors headers --------------------------------------------------------------------


def _sums_from_headers(model_dir: Path) -> tuple[dict[str, tuple[int, str]], int | None]:
    """({"dense_bytes": (bytes, origin)}, routed expert bytes) summed from the headers when every
    shard is present; ({}, None) otherwise."""
    files = _shard_files(model_dir)
    if not files:
        return {}, None
    dense = routed = 0
    for file in files:
        for name, entry in _header(file).items():
            if name == "__metadata__" or NOT_LOADED.match(name):
                continue
            nbytes = _entry_bytes(file, name, entry)
            if ROUTED_EXPERT.search(name):
                routed += nbytes
            elif not NGRAM_SHARD.search(name):
                dense += nbytes
    reason = f"{FROM_HEADERS} ({len(files)} files; routed experts, n-gram table, MTP and vision tensors left out)"
    return ({"dense_bytes": (dense, reason)}, routed) if routed or dense else ({}, None)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointConfigError(f"{index} has no weight_map object")
        files = sorted({model_dir / str(name) for name in weight_map.values()})
        return files if all(f.is_file() for f in files) else []  # a partial download: not yet
    return sorted(model_dir.glob("*.safetensors"))


def _header(path: Path) -> dict:
    try:
        header, _ = read_header(path)
    except OSError as e:
        raise CheckpointConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except CheckpointError as e:
        raise CheckpointConfigError(str(e)) from None
    return header


def _entry_bytes(path: Path, name: str, entry: object) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointConfigError(f"{path}: tensor {name} has no valid data_offsets")
    return offsets[1] - offsets[0]


# ---- where the checkpoint is -----------------------------------------------------------------


def find_checkpoint(preset: Preset, given: str | None, dtypes: tuple[str, ...]) -> tuple[Path | None, str]:
    """(the checkpoint directory whose config.json the plan reads, or None; why not, when None).
    `given` is --model-dir; a synthetic model is looked for in each of `dtypes` in turn; a Hub
    model counts only once bigmoe marked its download ready (every file checked)."""
    if given:
        path = Path(given).expanduser()
        return (path, "") if (path / "config.json").is_file() else (None, "no readable config.json there")
    if preset.synthetic:
        from bigmoe.paths import cache_root

        for dtype in dtypes:
            path = cache_root() / "models" / f"{preset.name}-{dtype}"
            if (path / "config.json").is_file():
                return path, ""
        return None, "the synthetic model is not made yet"
    from huggingface_hub.constants import HF_HUB_CACHE

    from bigmoe.model.hubcache import RepoCache, read_ready, read_ref

    cache = RepoCache(Path(HF_HUB_CACHE).expanduser().resolve(), preset.hub_id)
    commit = preset.revision if re.fullmatch(r"[0-9a-f]{40}", preset.revision) else read_ref(cache, preset.revision)
    if commit and read_ready(cache, commit) is not None and (cache.snapshot(commit) / "config.json").is_file():
        return cache.snapshot(commit), ""
    return None, "the model is not downloaded yet"


def facts_for(preset: Preset, checkpoint: str | None, why_not: str = "") -> ArchFacts:
    """read_facts of `checkpoint`, or the preset's numbers when there is none (`why_not` says why)."""
    if checkpoint is None:
        return preset_facts(preset, why_not or "no checkpoint given")
    return read_facts(preset, Path(checkpoint))
