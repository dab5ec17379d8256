"""Where every tensor of a safetensors checkpoint lies, read from the shard headers alone.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}}), then the data; offsets are
relative to byte 8 + N. Nothing here reads tensor data: the SSD tier reads the
byte ranges itself with O_DIRECT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .safetensors_header import MAX_HEADER_BYTES, CheckpointError, read_header  # noqa: F401  (one place)

DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a shard."""

    path: Path
    """The shard file."""
    dtype: torch.dtype
    """Element type (from the header's dtype string)."""
    shape: tuple[int, ...]
    """Shape as stored."""
    offset: int
    """Absolute byte offset of the first element in the file."""
    nbytes: int
    """Bytes of data."""


def index_files(paths: list[Path]) -> dict[str, TensorEntry]:
    """name -> TensorEntry over all shards; checks each tensor's byte range against its dtype, shape and file size."""
    index: dict[str, TensorEntry] = {}
    for path in paths:
        header, base = read_header(path)
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            entry = _entry(path, name, info, base)
            if entry.offset + entry.nbytes > size:
                raise CheckpointError(
                    f"{path}: tensor {name} ends at byte {entry.offset + entry.nbytes} "
                    f"but the file has {size} bytes (truncated download?)"
                )
            if name in index:
                raise CheckpointError(f"tensor {name} appears in both {index[name].path} and {path}")
            index[name] = entry
    return index


def shard_paths(root: str | os.PathLike) -> list[Path]:
    """The *.safetensors files of a checkpoint directory (or the one file given), sorted."""
    root = Path(root)
    if root.is_file():
        return [root]
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{root}: no *.safetensors files")
    return paths


def _entry(path: Path, name: str, info: object, base: int) -> TensorEntry:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: header entry for {name} lacks dtype/shape/data_offsets") from None
    if dtype_name not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has dtype {dtype_name}, which the pager does not read")
    dtype = DTYPES[dtype_name]
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if end - begin != nbytes or begin < 0:
        raise CheckpointError(
            f"{path}: tensor {name} spans {end - begin} bytes but {dtype_name}{list(shape)} needs {nbytes}"
        )
    return TensorEntry(path, dtype, shape, base + int(begin), nbytes)
