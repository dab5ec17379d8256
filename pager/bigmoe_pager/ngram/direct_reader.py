"""Rows read straight from the SSD: O_DIRECT, many at once through kernel AIO.

The rows are planned into aligned reads by `read_plan.plan_reads`: sorted by
(file, offset), rows in one block or within `merge_gap` bytes of each other
read once, each read as small as the device's O_DIRECT alignment allows (512 B
where the device accepts it, found by a probe read at open, else 4 KiB). Reads
land in a page-aligned scratch area, up to `depth` in flight; then all rows are
cut out of the scratch with one vectorized numpy gather. The page cache is
never touched, so the RAM tier is whatever row cache sits above this reader.

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
from .read_plan import MAX_FILE_BYTES, ReadPlan, plan_reads
from .stats import ReadTotals

ALIGN = 4096  # bytes; O_DIRECT offset/length/buffer alignment that every common block device accepts
MIN_ALIGN = 512  # bytes; the smallest logical block size of block devices
# Larger gaps cut few requests for random ids and cost bytes: 8-16 KiB measured no faster on the dev VM.
MERGE_GAP = 4 << 10  # bytes; rows this close share a read
MAX_READ = 256 << 10  # bytes; longest coalesced read (dense ids), so one failed read retries little


class DirectReader:
    """Gathers rows at given (file, byte offset) pairs with O_DIRECT + AIO; thread-safe (one gather at a time)."""

    def __init__(
        self,
        files: list[Path],
        row_bytes: int,
        *,
        depth: int = 256,
        timeout_s: float = 10.0,
        retries: int = 2,
        totals: ReadTotals | None = None,
        align: int | None = None,
        merge_gap: int = MERGE_GAP,
        max_read: int = MAX_READ,
    ):
        self.files = [Path(f) for f in files]
        self.row_bytes = row_bytes
        self.merge_gap = merge_gap
        self.max_read = max_read
        self.timeout_s = timeout_s
        self.retries = retries
        self.totals = totals if totals is not None else ReadTotals()
        self._fds = np.array([_open_direct(f) for f in self.files], np.uint32)
        self.align = (
            align if align is not None else max(_direct_align(int(fd), f) for fd, f in zip(self._fds, self.files))
        )
        """O_DIRECT offset/length alignment in bytes: 512 where every file's device accepts it, else 4096."""
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
            plan = plan_reads(
                file_ids, offsets, self.row_bytes, align=self.align, merge_gap=self.merge_gap, max_read=self.max_read
            )
            scratch = self._scratch_of(plan.scratch_bytes)
            self._prepare(plan, scratch)
            t0 = time.perf_counter_ns()
            self._run(plan.reads, need=plan.need)
            self.totals.add(n, int(plan.length.sum()), time.perf_counter_ns() - t0, reads=plan.reads)
            cut_rows(scratch, plan.row_at, self.row_bytes, out)

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

    def _prepare(self, plan: ReadPlan, scratch: np.ndarray) -> None:
        n = plan.reads
        if self._iocbs.size < n:
            self._iocbs = np.zeros(max(n, 2 * self._iocbs.size), IOCB)
        cb = self._iocbs[:n]
        cb["data"] = np.arange(n)
        cb["opcode"] = IOCB_CMD_PREAD
        cb["fildes"] = self._fds[plan.file]
        cb["buf"] = scratch.ctypes.data + plan.slot
        cb["nbytes"] = plan.length
        cb["offset"] = plan.start

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
                    batch = pending[top - room : top][::-1]
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
                    pending[top : top + bad.size] = bad
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
            raise NgramReadError(
                f"read of {int(cb['nbytes'])} bytes at offset {int(cb['offset'])} of {path} "
                f"failed: {why} after {self.retries} retries"
            )


def _open_direct(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise NgramFileError(
                f"{path}: the filesystem refuses O_DIRECT; use the page-cache n-gram reader (BIGMOE_NGRAM_CACHE_ROWS=0)"
            ) from None
        raise NgramFileError(f"{path}: cannot open: {e.strerror}") from None
    if os.fstat(fd).st_size >= MAX_FILE_BYTES:
        os.close(fd)
        raise NgramFileError(f"{path}: files of 1 TiB or more are not supported by the direct n-gram reader")
    return fd


def _direct_align(fd: int, path: Path) -> int:
    """512 if an O_DIRECT read of 512 bytes at offset 512 is accepted (the device's logical block size), else 4096."""
    probe = mmap.mmap(-1, ALIGN)  # page-aligned, so only the length and offset are being tested
    try:
        os.preadv(fd, [memoryview(probe)[:MIN_ALIGN]], MIN_ALIGN)
        return MIN_ALIGN
    except OSError as e:
        if e.errno == errno.EINVAL:
            return ALIGN
        raise NgramFileError(f"{path}: O_DIRECT probe read failed: {e.strerror}") from None
    finally:
        probe.close()
