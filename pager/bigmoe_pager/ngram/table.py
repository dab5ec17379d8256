"""An n-gram table read in place from its checkpoint shards: the one object callers use.

`NgramTable.open(files, spec=...)` indexes and validates the shards;
`gather(ids)` returns the rows of any array of row ids as uint8
[*ids.shape, row_bytes], in one of two tiers below it:

- page cache (default): files memory-mapped, the OS page cache holds hot rows;
- direct (`direct=True`): O_DIRECT reads through kernel AIO, the page cache is
  bypassed and `cache_rows` > 0 gives an explicit LRU row cache as the RAM tier.

Duplicate ids in a gather are read once. Nothing here knows about torch or
vLLM; `dequant.py` turns the bytes into activations on the device.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from .direct_reader import MERGE_GAP, DirectReader
from .errors import NgramFileError, NgramRangeError
from .page_cache_reader import PREFILL_THREADS, PageCacheReader
from .row_cache import RowCache
from .shards import ShardMap, find_shards
from .spec import TableSpec
from .stats import ReadTotals


class NgramTable:
    """Rows of one n-gram table, gathered from SSD/page cache (and an optional row cache)."""

    def __init__(
        self, shards: ShardMap, reader: PageCacheReader | DirectReader, cache: RowCache | None, totals: ReadTotals
    ):
        self.shards = shards
        self.reader = reader
        self.cache = cache
        self.totals = totals
        self.scale = _read_scale(shards)
        """The table's FP32 dequantization scale from the checkpoint, or None if it stores none."""

    @classmethod
    def open(
        cls,
        files: list[str | os.PathLike],
        *,
        table: str | None = None,
        spec: TableSpec | None = None,
        direct: bool = False,
        cache_rows: int = 0,
        threads: int = PREFILL_THREADS,
        depth: int = 256,
        timeout_s: float = 10.0,
        retries: int = 2,
        merge_gap: int = MERGE_GAP,
        align: int | None = None,
    ) -> "NgramTable":
        """Index `table` (default: the only one) in `files`, check it against `spec`, and open the reader.

        Direct reads only: `merge_gap` bytes between two rows below which they share one read, `align` the
        O_DIRECT alignment (None: 512 B if the device accepts it, else 4 KiB).
        """
        shards = find_shards([Path(f) for f in files], table=table, spec=spec)
        totals = ReadTotals()
        if direct:
            reader = DirectReader(
                list(shards.files),
                shards.row_bytes,
                depth=depth,
                timeout_s=timeout_s,
                retries=retries,
                totals=totals,
                merge_gap=merge_gap,
                align=align,
            )
        else:
            reader = PageCacheReader(list(shards.files), shards.row_bytes, threads=threads, totals=totals)
        cache = RowCache(cache_rows, shards.row_bytes) if cache_rows else None
        return cls(shards, reader, cache, totals)

    @property
    def rows(self) -> int:
        return self.shards.rows

    @property
    def row_bytes(self) -> int:
        return self.shards.row_bytes

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of `ids` (any shape, integer) as uint8 [*ids.shape, row_bytes], written into `out` if given."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise NgramRangeError(f"n-gram row ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        rows_out = _output(out, ids.shape, self.row_bytes)
        if flat.size == 0:
            return rows_out.reshape(*ids.shape, self.row_bytes)
        distinct, inverse = np.unique(flat, return_inverse=True)
        if distinct[0] < 0 or distinct[-1] >= self.rows:
            self.shards.locate(distinct)  # raises NgramRangeError naming the first bad id
        rows = np.empty((distinct.size, self.row_bytes), np.uint8)
        hits = self._from_cache(distinct, rows)
        miss = np.flatnonzero(~hits) if hits is not None else None
        self._read(distinct if miss is None else distinct[miss], rows, miss)
        self.totals.add_lookups(flat.size, 0 if hits is None else int(hits.sum()))
        np.take(rows, inverse.reshape(-1), axis=0, out=rows_out)
        return rows_out.reshape(*ids.shape, self.row_bytes)

    def drop_page_cache(self) -> None:
        """Evict the table's files from the page cache (benchmarks); a no-op for the direct reader."""
        if isinstance(self.reader, PageCacheReader):
            self.reader.drop_cache()

    def stats(self) -> dict[str, int]:
        return self.totals.snapshot()

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "NgramTable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- steps ----------------------------------------------------------------------

    def _from_cache(self, distinct: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """Copy cached rows into `rows`; the hit mask, or None without a cache."""
        if self.cache is None:
            return None
        hit, slots = self.cache.lookup(distinct)
        rows[hit] = self.cache.data[slots]
        return hit

    def _read(self, ids: np.ndarray, rows: np.ndarray, where: np.ndarray | None) -> None:
        """Read `ids` from storage into rows (or rows[where]) and remember them in the cache."""
        if ids.size == 0:
            return
        file_ids, offsets = self.shards.locate(ids)
        target = rows if where is None else np.empty((ids.size, self.row_bytes), np.uint8)
        self.reader.read(file_ids, offsets, target)
        if where is not None:
            rows[where] = target
        if self.cache is not None:
            self.cache.insert(ids, target)


def _output(out: np.ndarray | None, shape: tuple[int, ...], row_bytes: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    if out is None:
        return np.empty((n, row_bytes), np.uint8)
    if out.dtype != np.uint8 or not out.flags.c_contiguous or out.size != n * row_bytes:
        raise ValueError(
            f"gather output must be a C-contiguous uint8 array of {n} x {row_bytes} bytes, "
            f"got {out.dtype} {list(out.shape)} (contiguous={out.flags.c_contiguous})"
        )
    return out.reshape(n, row_bytes)


def _read_scale(shards: ShardMap) -> float | None:
    entry = shards.scale
    if entry is None:
        return None
    try:
        with open(entry.path, "rb") as f:
            f.seek(entry.offset)
            raw = f.read(4)
    except OSError as e:
        raise NgramFileError(f"{entry.path}: cannot read the n-gram scale: {e.strerror}") from None
    if len(raw) != 4:
        raise NgramFileError(f"{entry.path}: n-gram scale lies past the end of the file (truncated?)")
    return struct.unpack("<f", raw)[0]
