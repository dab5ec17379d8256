"""Rows read straight from the SSD: O_DIRECT, many at once through kernel AIO.

Each row (160 bytes for Qwen3.8-Flash-Next) is read as the aligned span around
it (one 4 KiB block, two when the row straddles a block boundary) into a
page-aligned scratch area, up to `depth` reads in flight; then all rows are cut
out of the scratch with one vectorized numpy gather. The page cache is never
touched, so the RAM tier is whatever row cache sits above this reader.

A read that fails (EIO) or comes back short is issued again up to `retries`
times; when no read completes within `timeout_s` the reader gives up with
NgramReadError and stays unusable (the kernel may still write into its
scratch), so a stalled device fails the step instead of hanging it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from .aio import IOCB, IOCB_CMD_PREAD, AioContext
from .byte_gather import cut_rows
from .errors import NgramFileError, NgramReadError
from .stats import ReadTotals

ALIGN = 4096  # bytes; O_DIRECT offset/length/buffer alignment that every common block device accepts


class DirectReader:
    """Gathers rows at given (file, byte offset) pairs with O_DIRECT + AIO; thread-safe (one gather at a time)."""

    def __init__(self, files: list[Path], row_bytes: int, *, depth: int = 256, timeout_s: float = 10.0,
                 retries: int = 2, totals: ReadTotals | None = None):
        self.files = [Path(f) for f in files]
        self.row_bytes = row_bytes
        self.timeout_s = timeout_s
        self.retries = retries
        self.totals = totals if totals is not None else ReadTotals()
        self._fds = np.array([_open_direct(f) for f in self.files], np.uint32)
        self._aio = AioContext(depth)
        self._lock = threading.Lock()
        self._scratch: mmap.mmap | None = None
        self._iocbs = np.zeros(0, IOCB)
        self._broken = ""

    def read(self, file_ids: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
        """Fill out[i] (uint8 [n, row_bytes], C-contiguous) with the row at offsets[i] of files[file_ids[i]]."""
        n = offsets.size
        if n == 0:
            return
        with self._lock:
            if self._broken:
                raise NgramReadError(f"n-gram direct reader is unusable after an earlier failure: {self._broken}")
            start = offsets & ~np.int64(ALIGN - 1)
            span = ((offsets + self.row_bytes + ALIGN - 1) & ~np.int64(ALIGN - 1)) - start
            slot = np.cumsum(span) - span
            scratch = self._scratch_of(int(slot[-1] + span[-1]))
            self._prepare(file_ids, start, span, slot, scratch)
            t0 = time.perf_counter_ns()
            self._run(n, need=offsets - start + self.row_bytes)
            self.totals.add(n, int(span.sum()), time.perf_counter_ns() - t0)
            cut_rows(scratch, slot + (offsets - start), self.row_bytes, out)

    def close(self) -> None:
        with self._lock:
            if not self._broken:
                self._aio.close()
            for fd in self._fds:
                os.close(int(fd))
            self._fds = np.zeros(0, np.uint32)

    # ---- steps ----------------------------------------------------------------------

    def _scratch_of(self, nbytes: int) -> np.ndarray:
        if self._scratch is None or len(self._scratch) < nbytes:
            size = max(nbytes, 2 * len(self._scratch or b""), ALIGN)
            self._scratch = mmap.mmap(-1, -(-size // ALIGN) * ALIGN)  # anonymous maps are page-aligned
        return np.frombuffer(self._scratch, np.uint8)

    def _prepare(self, file_ids: np.ndarray, start: np.ndarray, span: np.ndarray, slot: np.ndarray,
                 scratch: np.ndarray) -> None:
        n = start.size
        if self._iocbs.size < n:
            self._iocbs = np.zeros(max(n, 2 * self._iocbs.size), IOCB)
        cb = self._iocbs[:n]
        cb["data"] = np.arange(n)
        cb["opcode"] = IOCB_CMD_PREAD
        cb["fildes"] = self._fds[file_ids]
        cb["buf"] = scratch.ctypes.data + slot
        cb["nbytes"] = span
        cb["offset"] = start

    def _run(self, n: int, need: np.ndarray) -> None:
        """Submit iocbs 0..n-1 keeping up to `depth` in flight; re-issue failed ones; raise on timeout."""
        base = self._iocbs.ctypes.data
        pending = np.arange(n, dtype=np.int64)[::-1].copy()  # a stack: pop from the end, push retries
        tries = np.zeros(n, np.int32)
        top, inflight = n, 0
        try:
            while top or inflight:
                room = min(self._aio.depth - inflight, top)
                if room:
                    batch = pending[top - room:top][::-1]
                    took = self._aio.submit((base + 64 * batch).astype(np.uint64))
                    top -= took
                    inflight += took
                # All queued: one wake-up for the lot. Still queuing: refill once a quarter of the depth is back.
                want = inflight if top == 0 else min(inflight, max(1, self._aio.depth // 4))
                done = self._aio.wait(want, self.timeout_s)
                if inflight and done.size == 0:
                    self._broken = f"{inflight} reads did not finish within {self.timeout_s} s"
                    raise NgramReadError(f"n-gram rows: {self._broken} (device stalled?)")
                inflight -= done.size
                idx = done["data"].astype(np.int64)
                bad = idx[done["res"] < need[idx]]
                if bad.size:
                    self._retry_or_raise(bad, done, tries)
                    pending[top:top + bad.size] = bad
                    top += bad.size
        except NgramReadError:
            self._drain(inflight)
            raise

    def _drain(self, inflight: int) -> None:
        """Reap reads still in flight after a failure, so the next gather never sees their completions."""
        while inflight and not self._broken:
            done = self._aio.wait(inflight, self.timeout_s)
            if done.size == 0:
                self._broken = f"{inflight} reads of a failed gather did not finish within {self.timeout_s} s"
            inflight -= done.size

    def _retry_or_raise(self, bad: np.ndarray, done: np.ndarray, tries: np.ndarray) -> None:
        tries[bad] += 1
        self.totals.add_retries(bad.size)
        worst = bad[np.argmax(tries[bad])]
        if tries[worst] > self.retries:
            self.totals.add_errors(1)
            res = int(done["res"][np.flatnonzero(done["data"] == worst)[0]])
            cb = self._iocbs[worst]
            why = os.strerror(-res) if res < 0 else f"short read ({res} of {int(cb['nbytes'])} bytes; file truncated?)"
            path = self.files[int(np.flatnonzero(self._fds == cb["fildes"])[0])]
            raise NgramReadError(f"read of {int(cb['nbytes'])} bytes at offset {int(cb['offset'])} of {path} failed: {why} after {self.retries} retries")


def _open_direct(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise NgramFileError(f"{path}: the filesystem refuses O_DIRECT; use the page-cache n-gram reader (BIGMOE_NGRAM_CACHE_ROWS=0)") from None
        raise NgramFileError(f"{path}: cannot open: {e.strerror}") from None

