"""Rows read through the OS page cache: every file memory-mapped, gathered with numpy.

The page cache is the RAM tier: rows read once stay in RAM until the kernel
needs the memory. Each map is advised MADV_RANDOM so a miss reads one page, not
a 128 KiB read-ahead window. A small gather (a decode step: 16 rows) first asks
the kernel to start reading every missing page at once (POSIX_FADV_WILLNEED
returns without waiting), so the misses overlap on the device instead of
faulting one after another; a large gather (prefill) is split over worker
threads whose numpy gathers fault in parallel with the GIL released.

The files must not shrink while mapped (a read past the end of a mapping is
SIGBUS): the reader checks every tensor against its file size at open, and the
checkpoint is read-only while the server runs.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .byte_gather import cut_rows
from .errors import NgramFileError
from .stats import ReadTotals

WILLNEED_ROWS = 1024  # rows; up to this many, prefetch hints beat thread fan-out (a decode step is 16)
PREFILL_THREADS = 32  # threads whose page faults overlap on a cold prefill: the device queue depth it sees
ROW_LOOP_ROWS = 256  # rows; up to this many, copying row by row beats grouping rows by file (~20 us a group)


class PageCacheReader:
    """Gathers rows at given (file, byte offset) pairs from memory-mapped files; thread-safe."""

    def __init__(
        self, files: list[Path], row_bytes: int, *, threads: int = PREFILL_THREADS, totals: ReadTotals | None = None
    ):
        self.files = [Path(f) for f in files]
        self.row_bytes = row_bytes
        self.totals = totals if totals is not None else ReadTotals()
        self._fds = [_open(f) for f in self.files]
        self._maps = [_map(fd, f) for fd, f in zip(self._fds, self.files)]
        self._bytes = [np.frombuffer(m, np.uint8) for m in self._maps]
        self._views = [memoryview(m) for m in self._maps]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bigmoe-ngram") if threads > 1 else None
        self._threads = threads

    def read(self, file_ids: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
        """Fill out[i] (uint8 [n, row_bytes], C-contiguous) with the row at offsets[i] of files[file_ids[i]]."""
        n = offsets.size
        t0 = time.perf_counter_ns()
        if n <= WILLNEED_ROWS or self._pool is None:
            if n <= WILLNEED_ROWS:
                self._advise(file_ids, offsets)
            self._gather(file_ids, offsets, out)
        else:
            bounds = np.linspace(0, n, self._threads + 1).astype(np.int64)
            parts = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            list(
                self._pool.map(
                    lambda ab: self._gather(file_ids[ab[0] : ab[1]], offsets[ab[0] : ab[1]], out[ab[0] : ab[1]]), parts
                )
            )
        self.totals.add(n, n * self.row_bytes, time.perf_counter_ns() - t0)

    def drop_cache(self) -> None:
        """Ask the kernel to evict these files from the page cache (benchmarks: measure cold reads).

        Pages still mapped are not evicted, so the maps are made anew afterwards.
        """
        self._release_maps()
        for fd in self._fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._maps = [_map(fd, f) for fd, f in zip(self._fds, self.files)]
        self._bytes = [np.frombuffer(m, np.uint8) for m in self._maps]
        self._views = [memoryview(m) for m in self._maps]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._release_maps()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # ---- steps ----------------------------------------------------------------------

    def _advise(self, file_ids: np.ndarray, offsets: np.ndarray) -> None:
        for f, off in zip(file_ids.tolist(), offsets.tolist()):
            os.posix_fadvise(self._fds[f], off, self.row_bytes, os.POSIX_FADV_WILLNEED)

    def _release_maps(self) -> None:
        for v in self._views:
            v.release()
        self._views, self._bytes = [], []
        for m in self._maps:
            m.close()
        self._maps = []

    def _gather(self, file_ids: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
        if offsets.size <= ROW_LOOP_ROWS:
            rb, dst = self.row_bytes, memoryview(out).cast("B")
            for k, (f, off) in enumerate(zip(file_ids.tolist(), offsets.tolist())):
                dst[k * rb : (k + 1) * rb] = self._views[f][off : off + rb]
            return
        if len(self._bytes) == 1:
            cut_rows(self._bytes[0], offsets, self.row_bytes, out)
            return
        order = np.argsort(file_ids, kind="stable")
        sorted_files = file_ids[order]
        cuts = np.flatnonzero(np.diff(sorted_files)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), order.size]):
            sel = order[a:b]
            part = np.empty((sel.size, self.row_bytes), np.uint8)
            cut_rows(self._bytes[int(sorted_files[a])], offsets[sel], self.row_bytes, part)
            out[sel] = part


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NgramFileError(f"{path}: cannot open: {e.strerror}") from None


def _map(fd: int, path: Path) -> mmap.mmap:
    try:
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    except (OSError, ValueError) as e:
        raise NgramFileError(f"{path}: cannot memory-map: {e}") from None
    m.madvise(mmap.MADV_RANDOM)
    return m
