"""Where each row of an n-gram table lies: its shards, found from safetensors headers.

The checkpoint stores a table as tensors `<table>.shard_<i>.weight`, each
[rows_i, row_elems], spread over one or more files and possibly behind other
tensors in the same file. `find_shards` indexes them from the headers alone,
checks them against each other and (when given) the model's `TableSpec`, and
returns a `ShardMap` that turns row ids into (file, byte offset) pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from bigmoe_pager.core.safetensors_index import DTYPES, CheckpointError, TensorEntry, index_files, read_header

from .errors import NgramFileError, NgramLayoutError, NgramRangeError
from .spec import ITEM_BYTES, TableSpec

SHARD_NAME = re.compile(r"^(?P<table>.+)\.shard_(?P<index>\d+)\.weight$")
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor holding a contiguous run of table rows."""

    index: int
    """The i of `<table>.shard_<i>.weight`."""
    file: int
    """Index into ShardMap.files."""
    first_row: int
    """Table row id of the shard's first row."""
    rows: int
    """Rows in the shard."""
    offset: int
    """Absolute byte offset of the shard's first row in its file."""


@dataclass(frozen=True)
class ShardMap:
    """The shards of one table in row order, and the arithmetic from row id to byte offset."""

    table: str
    """Tensor name prefix of the table, e.g. model.language_model.layers.1.ple.ple_embedding.ngram_embedding."""
    files: tuple[Path, ...]
    """Files holding at least one shard; Shard.file indexes this."""
    shards: tuple[Shard, ...]
    """Non-empty shards, ordered by first_row, covering rows 0..rows-1 without gaps."""
    rows: int
    """Rows in the table."""
    row_bytes: int
    """Bytes per row."""
    dtype: str
    """Safetensors dtype of the rows."""
    scale: TensorEntry | None = None
    """`<table>.weight_scale` if the checkpoint has one (one FP32 scale for the whole table)."""
    _starts: np.ndarray = field(init=False, repr=False, compare=False)
    _file_of: np.ndarray = field(init=False, repr=False, compare=False)
    _offset_of: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", np.array([s.first_row for s in self.shards], np.int64))
        object.__setattr__(self, "_file_of", np.array([s.file for s in self.shards], np.int32))
        object.__setattr__(self, "_offset_of", np.array([s.offset for s in self.shards], np.int64))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, absolute byte offset) of each row id in a flat int64 array; raises NgramRangeError."""
        bad = (ids < 0) | (ids >= self.rows)
        if bad.any():
            first = int(ids[np.argmax(bad)])
            raise NgramRangeError(
                f"n-gram row id {first} is outside table {self.table} of {self.rows} rows "
                f"({int(bad.sum())} of {ids.size} ids out of range)"
            )
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        return self._file_of[shard], self._offset_of[shard] + (ids - self._starts[shard]) * self.row_bytes


def find_shards(paths: list[Path], table: str | None = None, spec: TableSpec | None = None) -> ShardMap:
    """Index the shards of `table` (default: the only table in `paths`) and validate them against `spec`."""
    headers = {Path(p): _header(Path(p)) for p in paths}
    tables = _tables_by_file(headers)
    if not tables:
        raise NgramLayoutError(f"no n-gram table shards (<table>.shard_<i>.weight) in {len(paths)} checkpoint file(s)")
    if table is None:
        if len(tables) != 1:
            raise NgramLayoutError(f"checkpoint holds n-gram tables {sorted(tables)}; name one")
        table = next(iter(tables))
    if table not in tables:
        raise NgramLayoutError(f"n-gram table {table} not in the checkpoint; it holds {sorted(tables)}")
    files = sorted(tables[table])
    index = _index(files)
    entries = {int(SHARD_NAME.match(n)["index"]): e for n, e in index.items() if _table_of(n) == table}
    dtype, row_elems = _common_format(table, entries)
    if spec is not None:
        _check_spec(table, entries, dtype, row_elems, spec)
    shards = _order(table, entries, files, row_elems * ITEM_BYTES[dtype])
    rows = sum(s.rows for s in shards)
    if spec is not None and rows != spec.rows:
        raise NgramLayoutError(f"shards of {table} hold {rows} rows; the model config needs {spec.rows}")
    return ShardMap(table, tuple(files), shards, rows, row_elems * ITEM_BYTES[dtype], dtype, _scale(headers, table))


def list_tables(paths: list[Path]) -> dict[str, list[Path]]:
    """Every n-gram table in `paths` (name -> files holding its shards), from the headers alone."""
    tables = _tables_by_file({Path(p): _header(Path(p)) for p in paths})
    return {name: sorted(files) for name, files in tables.items()}


def _tables_by_file(headers: dict[Path, dict]) -> dict[str, set[Path]]:
    """table name -> files holding its shards, from the JSON headers only."""
    found: dict[str, set[Path]] = {}
    for path, header in headers.items():
        for name in header:
            t = _table_of(name)
            if t is not None:
                found.setdefault(t, set()).add(path)
    return found


def _table_of(name: str) -> str | None:
    m = SHARD_NAME.match(name)
    return m["table"] if m else None


def _header(path: Path) -> dict:
    if not path.is_file():
        raise NgramFileError(f"{path}: checkpoint file not found")
    try:
        return read_header(path)[0]
    except CheckpointError as e:
        raise NgramFileError(str(e)) from None
    except OSError as e:
        raise NgramFileError(f"{path}: cannot read: {e.strerror}") from None


def _index(files: list[Path]) -> dict[str, TensorEntry]:
    try:
        return index_files(files)
    except CheckpointError as e:
        raise NgramFileError(str(e)) from None


def _common_format(table: str, entries: dict[int, TensorEntry]) -> tuple[str, int]:
    formats = {(DTYPE_NAMES[e.dtype], e.shape[1:]) for e in entries.values() if len(e.shape) == 2}
    flat = [i for i, e in entries.items() if len(e.shape) != 2]
    if flat:
        raise NgramLayoutError(
            f"{table}.shard_{flat[0]}.weight has shape {list(entries[flat[0]].shape)}; "
            "n-gram shards are 2-D [rows, row_elems]"
        )
    if len(formats) != 1:
        raise NgramLayoutError(f"shards of {table} disagree on dtype/row size: {sorted(formats)}")
    dtype, (row_elems,) = formats.pop()
    if dtype not in ITEM_BYTES:
        raise NgramLayoutError(f"shards of {table} are {dtype}; the n-gram reader reads {sorted(ITEM_BYTES)}")
    return dtype, row_elems


def _check_spec(table: str, entries: dict[int, TensorEntry], dtype: str, row_elems: int, spec: TableSpec) -> None:
    if dtype != spec.dtype:
        raise NgramLayoutError(f"shards of {table} are {dtype} but the model config says {spec.dtype}")
    if row_elems != spec.row_elems:
        raise NgramLayoutError(
            f"shards of {table} have rows of {row_elems} elements but the model config says {spec.row_elems}"
        )
    if spec.parts is None:
        return  # the split is the checkpoint's; find_shards still checks the total
    extra = sorted(i for i in entries if i >= spec.parts)
    if extra:
        raise NgramLayoutError(f"{table}.shard_{extra[0]}.weight exceeds split_ngram_parts={spec.parts}")
    for i in range(spec.parts):
        want = spec.rows_in_shard(i)
        if i not in entries:
            if want:
                start = i * spec.shard_rows
                raise NgramLayoutError(
                    f"{table}.shard_{i}.weight is missing: rows {start}..{start + want - 1} have no data"
                )
            continue
        if entries[i].shape[0] != want:
            raise NgramLayoutError(
                f"{table}.shard_{i}.weight has {entries[i].shape[0]} rows; the model config needs {want}"
            )


def _order(table: str, entries: dict[int, TensorEntry], files: list[Path], row_bytes: int) -> tuple[Shard, ...]:
    """Shards in index order with their first rows; every shard but the last must be full."""
    indices = sorted(entries)
    if indices != list(range(len(indices))):
        gap = next(i for i, j in enumerate(indices) if i != j)
        raise NgramLayoutError(f"{table}.shard_{gap}.weight is missing: a gap in the table before shard_{indices[gap]}")
    full = entries[0].shape[0]
    shards, row = [], 0
    for i in indices:
        rows = entries[i].shape[0]
        if rows > full or (rows < full and any(entries[j].shape[0] for j in indices[i + 1 :])):
            raise NgramLayoutError(
                f"{table}.shard_{i}.weight has {rows} rows where shard_0 has {full}; "
                "only trailing shards may be shorter"
            )
        if rows:
            shards.append(Shard(i, files.index(entries[i].path), row, rows, entries[i].offset))
        row += rows
    return tuple(shards)


def _scale(headers: dict[Path, dict], table: str) -> TensorEntry | None:
    name = f"{table}.weight_scale"
    holders = [p for p, h in headers.items() if name in h]
    if not holders:
        return None
    entry = _index(holders[:1])[name]
    if entry.nbytes != 4 or DTYPE_NAMES[entry.dtype] != "F32":
        raise NgramLayoutError(
            f"{name} is {DTYPE_NAMES[entry.dtype]}{list(entry.shape)}; expected one F32 scale for the whole table"
        )
    return entry
