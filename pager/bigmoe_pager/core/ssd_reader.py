"""NativeReader: the SSD mailbox's poller and I/O workers as C threads (ssd_reader.c), off the GIL.

SsdService hands it the mailbox, the RAM slot rows and the store's `record_reads()`; from then on the GPU's
requests are picked up, read, checked, copied into their slots and answered without any Python. Python keeps
the rest: it formats the first failure (the store says where the record lives), turns the counters into
ReadCounters and the stats sinks, and stops the threads at close. Where the library cannot be built (no C
compiler) or the store cannot describe its reads, `available()` says why and the service keeps its Python
threads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import native_build
from .record_reads import RecordReads

SOURCE = Path(__file__).with_name("ssd_reader.c")
COUNTERS = ("reads", "bytes", "read_ns", "retries", "errors", "hurried")
"""Per layer, the C counters in order (read_stats.ReadCounters' fields)."""
READ_ERROR, SHORT_READ, TRUNCATED, CHECKSUM, TIMEOUT, BAD_REQUEST, ODIRECT_REFUSED, NO_STAGING = range(1, 9)
"""ssd_reader.c's failure kinds (its F_* codes)."""
FAILURES = {
    READ_ERROR: "read error",
    SHORT_READ: "short read",
    TRUNCATED: "the file is shorter than the record's place in it (truncated?)",
    CHECKSUM: "checksum mismatch",
    TIMEOUT: "no answer in time",
    BAD_REQUEST: "bad request",
    ODIRECT_REFUSED: "O_DIRECT refused",
    NO_STAGING: "no memory for a staging buffer",
}
"""What each failure kind means, in words."""
FILE_FAILURES = (READ_ERROR, SHORT_READ, TRUNCATED, ODIRECT_REFUSED)
"""Kinds that happened at a file and offset."""
_START_ERRORS = {1: "bad arguments", 2: "out of memory", 3: "zlib (libz.so.1) not found for checksums", 4: "no threads"}


class NativeReaderError(RuntimeError):
    """The native reader's library could not be built or its threads started."""


@dataclass(frozen=True)
class Failure:
    """The reader's first failure, as ssd_reader.c recorded it."""

    kind: int
    layer: int
    expert: int
    slot: int
    entry: int
    seq: int
    attempts: int
    detail: int
    """errno of a read error, bytes that arrived of a short read."""
    file: int
    """Index into the plan's files (-1: none)."""
    offset: int

    def why(self, files: Sequence[object]) -> str:
        """One line: what failed and, for a read, at which file and offset."""
        what = FAILURES.get(self.kind, f"failure {self.kind}")
        if self.kind == READ_ERROR:
            what += f" ({errno.errorcode.get(self.detail, self.detail)}: {os.strerror(self.detail)})"
        elif self.kind == SHORT_READ:
            what += f" ({self.detail} bytes arrived)"
        if self.kind in FILE_FAILURES and 0 <= self.file < len(files):
            what += f" at {getattr(files[self.file], 'path', files[self.file])}@{self.offset}"
        return f"{what} (after {self.attempts} attempts)"


def library() -> ctypes.CDLL:
    """ssd_reader.c built and declared (native_build); NativeReaderError when it cannot be built."""
    try:
        lib = native_build.library(SOURCE)
    except native_build.NativeBuildError as e:
        raise NativeReaderError(f"native SSD reader: {e}") from None
    i64p = ctypes.POINTER(ctypes.c_int64)
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.reader_start.argtypes = [
        ctypes.c_void_p, i64, i64, i64, i64, i32, i32, i32,  # box, entries, posted range, timeout, retries, workers
        i64, i64p, i64p,  # files
        i64, i64p, i64p, i64p,  # layers
        i64, i64p, i64p, i64p, i64p, i64p, i64p, i64, i64p, i64,  # the plan
        ctypes.POINTER(ctypes.c_int),
    ]  # fmt: skip
    lib.reader_start.restype = ctypes.c_void_p
    lib.reader_counters.argtypes = [ctypes.c_void_p, i64p]
    lib.reader_counters.restype = None
    lib.reader_failure.argtypes = [ctypes.c_void_p, i64p]
    lib.reader_failure.restype = None
    lib.reader_stop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.reader_stop.restype = None
    return lib


def _stop(lib: ctypes.CDLL, handle: int, keep: object, last: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Stop and join the threads; `keep` (the buffers they write) is released only after this returns. last: arrays
    for the final counters and failure (close), or None (a reader dropped without close)."""
    lib.reader_stop(handle, *((a.ctypes.data for a in last) if last else (None, None)))


def _ptr(a: np.ndarray) -> ctypes._Pointer:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))


class NativeReader:
    """The C poller and workers serving one SSD mailbox; see the module doc."""

    def __init__(
        self,
        box: torch.Tensor,
        entries: int,
        posted: tuple[int, int],
        rows: Sequence[np.ndarray],
        plan: RecordReads,
        num_experts: int,
        *,
        workers: int,
        timeout_s: float,
        retries: int,
        file_retries: int,
    ):
        """box: the pinned int64 mailbox (ssd_mailbox) of `entries` entries, posted reads in [posted[0],
        posted[1]); rows: per store layer, its RAM slots as a writable uint8 array [R, row bytes]."""
        self._lib = library()
        self.plan = plan
        self._keep = (box, list(rows), plan)  # every buffer whose address the threads hold
        arrays = {
            "fds": np.asarray([f.fd for f in plan.files], dtype=np.int64),
            "sizes": np.asarray([f.size for f in plan.files], dtype=np.int64),
            "rows": np.asarray([r.ctypes.data for r in rows], dtype=np.int64),
            "slots": np.asarray([r.shape[0] for r in rows], dtype=np.int64),
            "row_bytes": np.asarray([r.strides[0] if r.shape[0] else 0 for r in rows], dtype=np.int64),
            **{
                k: np.ascontiguousarray(getattr(plan, k), dtype=np.int64)
                for k in ("key_reads", "reads", "key_pieces", "pieces", "record_bytes", "crc", "zeros")
            },
        }
        why = ctypes.c_int(0)
        a = arrays
        self._lock = threading.Lock()
        self._counters = np.zeros((len(rows), len(COUNTERS)), dtype=np.int64)
        self._failure = np.zeros(10, dtype=np.int64)
        self.layers = len(rows)
        self._handle = self._lib.reader_start(
            box.data_ptr(), entries, posted[0], posted[1], int(timeout_s * 1e9), retries, file_retries, workers,
            len(plan.files), _ptr(a["fds"]), _ptr(a["sizes"]),
            self.layers, _ptr(a["rows"]), _ptr(a["slots"]), _ptr(a["row_bytes"]),
            num_experts, _ptr(a["key_reads"]), _ptr(a["reads"]), _ptr(a["key_pieces"]), _ptr(a["pieces"]),
            _ptr(a["record_bytes"]), _ptr(a["crc"]), len(plan.zeros), _ptr(a["zeros"]), plan.staging_bytes,
            ctypes.byref(why),
        )  # fmt: skip
        if not self._handle:
            raise NativeReaderError(f"native SSD reader: could not start ({_START_ERRORS.get(why.value, why.value)})")
        # A reader dropped without close() (or alive at exit) still stops its threads before the buffers they
        # write are freed: the finalizer holds them until then.
        self._stop_handle = self._handle
        self._finalizer = weakref.finalize(self, _stop, self._lib, self._handle, self._keep)

    def counters(self) -> np.ndarray:
        """int64 [layers, len(COUNTERS)]: totals since the start (after close: the totals at close)."""
        with self._lock:
            if self._handle:
                self._lib.reader_counters(self._handle, _ptr(self._counters))
            return self._counters.copy()

    def failure(self) -> Failure | None:
        """The first failure, or None (after close: as it was at close)."""
        with self._lock:
            if self._handle:
                self._lib.reader_failure(self._handle, _ptr(self._failure))
            last = [int(v) for v in self._failure]
        return Failure(*last) if last[0] else None

    def close(self) -> None:
        """Stop and join the threads (a read in progress finishes first), keeping the last counters and failure;
        idempotent."""
        with self._lock:  # no counters() or failure() call reads the handle while it is freed
            if self._handle:
                self._handle = None
                self._finalizer.detach()
                _stop(self._lib, self._stop_handle, self._keep, (self._counters, self._failure))
