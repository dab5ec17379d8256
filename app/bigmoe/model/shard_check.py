"""shard_check: is a safetensors file whole by its own header? Header length, JSON, each tensor's
byte range against its dtype and shape, and the file's size against the end of the last tensor.

Reads only the header (a few KiB to MiB), so preflight can check every shard of a large model
before vLLM starts; `bigmoe verify` adds the Hub's hashes on top.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bigmoe_pager.core.safetensors_header import CheckpointError, read_header

DTYPE_BITS = {
    "F64": 64,
    "F32": 32,
    "F16": 16,
    "BF16": 16,
    "I64": 64,
    "I32": 32,
    "I16": 16,
    "I8": 8,
    "U64": 64,
    "U32": 32,
    "U16": 16,
    "U8": 8,
    "BOOL": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}
"""Bits per element of each safetensors dtype (a dtype not listed is range-checked but not size-checked)."""


def shard_problem(path: Path) -> str | None:
    """Why the safetensors file at path is not whole by its header (one line naming it), or None."""
    try:
        header, base = read_header(path)
        size = path.stat().st_size
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror or e})"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            begin, stop = int(begin), int(stop)
        except (TypeError, KeyError, ValueError):
            return f"{path}: header entry for {name} lacks dtype/shape/data_offsets; not a safetensors file"
        bits = DTYPE_BITS.get(dtype)
        if begin < 0 or stop < begin or (bits is not None and stop - begin != math.ceil(math.prod(shape) * bits / 8)):
            return (
                f"{path}: tensor {name} spans bytes {begin}..{stop}, which do not hold {dtype}{shape}; "
                "the header is corrupt"
            )
        end = max(end, stop)
    if base + end > size:
        return (
            f"{path}: truncated: {size} bytes, its header needs {base + end} "
            f"(tensors end at byte {base + end}); the download or copy was cut short"
        )
    if base + end < size:
        return f"{path}: {size - base - end} bytes after the last tensor its header names; the file is damaged"
    return None


INDEX_NAME = "model.safetensors.index.json"
"""The index that maps each tensor to its shard."""


def checkpoint_problems(model_dir: Path) -> list[str]:
    """One line per *.safetensors file of model_dir that is not whole by its header, and per shard its index
    names that is missing (or one line when there is no *.safetensors file at all)."""
    model_dir = Path(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    missing = [
        f"{model_dir / name}: missing, though {INDEX_NAME} names it"
        for name in _indexed(model_dir)
        if not (model_dir / name).is_file()
    ]
    if not shards and not missing:
        return [f"{model_dir / '*.safetensors'}: none there, so it is no checkpoint directory"]
    return missing + [why for shard in shards if (why := shard_problem(shard))]


def _indexed(model_dir: Path) -> list[str]:
    """The shard file names the index maps tensors to (none when there is no readable index: the
    planner reports a damaged one)."""
    try:
        weight_map = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
