"""Synthetic n-gram tables in the checkpoint's layout, for tests and the benchmark.

Row r holds a fixed pseudo-random 160-byte pattern (pattern[r % PATTERN_ROWS])
with its first 8 bytes (fewer in shorter rows) replaced by r (little-endian), so any gathered row can
be checked against `expected_rows(ids)` without keeping the table in memory.
Pattern bytes avoid FP8 E4M3 NaN codes; the id bytes may hit them.

Files are written the way a checkpoint holds the table: `<table>.shard_<i>.weight`
tensors of ceil(rows / parts) rows (the last shorter), `shards_per_file` per
file, each file starting with a decoy tensor of `decoy_bytes` so the table does
not begin at the data start, and `<table>.weight_scale` (F32, one value) in the
last file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from bigmoe_pager.ngram.spec import ITEM_BYTES

DEFAULT_TABLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
PATTERN_ROWS = 4096  # rows of distinct pseudo-random content before the pattern repeats
CHUNK_ROWS = 1 << 18  # rows generated and written per step (40 MiB of 160-byte rows)


def expected_rows(ids: np.ndarray, row_bytes: int, seed: int = 0) -> np.ndarray:
    """The content of rows `ids` (flat int64) as uint8 [n, row_bytes]."""
    rows = _pattern(row_bytes, seed)[ids % PATTERN_ROWS]
    k = min(8, row_bytes)
    rows[:, :k] = ids.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :k]
    return rows


def write_table(
    root: Path,
    *,
    rows: int,
    row_elems: int,
    parts: int,
    dtype: str = "F8_E4M3",
    shards_per_file: int = 1,
    table: str = DEFAULT_TABLE,
    decoy_bytes: int = 64,
    scale: float | None = 0.5,
    skip_shards: frozenset[int] = frozenset(),
    seed: int = 0,
) -> list[Path]:
    """Write the table under root as model-0000i.safetensors files; returns their paths in order."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    row_bytes = row_elems * ITEM_BYTES[dtype]
    shard_rows = -(-rows // parts)
    shards = [(i, i * shard_rows, max(0, min(shard_rows, rows - i * shard_rows))) for i in range(parts)]
    shards = [s for s in shards if s[2] > 0 and s[0] not in skip_shards]
    groups = [shards[i : i + shards_per_file] for i in range(0, len(shards), shards_per_file)]
    paths = []
    for k, group in enumerate(groups):
        path = root / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        last = k == len(groups) - 1
        _write_file(path, table, group, row_elems, row_bytes, dtype, decoy_bytes, scale if last else None, seed)
        paths.append(path)
    return paths


def _write_file(
    path: Path,
    table: str,
    shards: list[tuple[int, int, int]],
    row_elems: int,
    row_bytes: int,
    dtype: str,
    decoy_bytes: int,
    scale: float | None,
    seed: int,
) -> None:
    header, offset = {}, 0
    if decoy_bytes:
        header[f"{table}.decoy_{path.stem.split('-')[1]}"] = {
            "dtype": "U8",
            "shape": [decoy_bytes],
            "data_offsets": [0, decoy_bytes],
        }
        offset = decoy_bytes
    for i, _, n in shards:
        header[f"{table}.shard_{i}.weight"] = {
            "dtype": dtype,
            "shape": [n, row_elems],
            "data_offsets": [offset, offset + n * row_bytes],
        }
        offset += n * row_bytes
    if scale is not None:
        header[f"{table}.weight_scale"] = {"dtype": "F32", "shape": [], "data_offsets": [offset, offset + 4]}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header so data starts 8-byte aligned
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.write(np.random.default_rng(seed + 1).integers(0, 256, decoy_bytes, np.uint8).tobytes())
        for _, first, n in shards:
            for a in range(first, first + n, CHUNK_ROWS):
                f.write(
                    expected_rows(
                        np.arange(a, min(a + CHUNK_ROWS, first + n), dtype=np.int64), row_bytes, seed
                    ).tobytes()
                )
        if scale is not None:
            f.write(struct.pack("<f", scale))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_patterns: dict[tuple[int, int], np.ndarray] = {}


def _pattern(row_bytes: int, seed: int) -> np.ndarray:
    key = (row_bytes, seed)
    if key not in _patterns:
        p = np.random.default_rng(seed).integers(0, 256, (PATTERN_ROWS, row_bytes), np.uint8)
        p[(p & 0x7F) == 0x7F] ^= 0x01  # 0x7F / 0xFF are NaN in FP8 E4M3
        _patterns[key] = p
    return _patterns[key]
