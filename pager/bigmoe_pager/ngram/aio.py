"""Linux native AIO (io_setup / io_submit / io_getevents) through raw system calls.

Python has no batched read: one os.preadv per 160-byte row costs microseconds
of interpreter time and the GIL each. Kernel AIO on an O_DIRECT file takes a
whole array of read requests in one call and runs them all at once on the
device, so a 32,768-row prefill is a few system calls from one thread, and the
thread waits in io_getevents with the GIL released. The request array (struct
iocb, 64 bytes each) is built with numpy, all rows at once.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

import numpy as np

from .errors import NgramReadError

# struct iocb and struct io_event from linux/aio_abi.h (little-endian 64-bit layout).
IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<u4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
IO_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
IOCB_CMD_PREAD = 0

_SYSCALLS = {  # (io_setup, io_destroy, io_getevents, io_submit)
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),
}


class AioUnavailable(NgramReadError):
    """The kernel or the container's seccomp policy refuses native AIO."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class AioContext:
    """One kernel AIO context with room for `depth` reads in flight."""

    def __init__(self, depth: int):
        arch = platform.machine()
        if arch not in _SYSCALLS or not hasattr(os, "O_DIRECT"):
            raise AioUnavailable(
                f"native AIO is not wired for {platform.system()} {arch}; "
                "use the page-cache n-gram reader (BIGMOE_NGRAM_CACHE_ROWS=0)"
            )
        self._setup, self._destroy, self._getevents, self._submit = _SYSCALLS[arch]
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = self._libc.syscall
        self._syscall.restype = ctypes.c_long
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        if self._call(self._setup, ctypes.c_long(depth), ctypes.byref(self._ctx)) < 0:
            err = ctypes.get_errno()
            raise AioUnavailable(
                f"io_setup({depth}) failed: {os.strerror(err)}; raise fs.aio-max-nr "
                "or use the page-cache n-gram reader (BIGMOE_NGRAM_CACHE_ROWS=0)"
            )
        self.events = np.zeros(depth, IO_EVENT)

    def submit(self, pointers: np.ndarray) -> int:
        """Queue the iocbs whose addresses are in `pointers` (uint64); returns how many the kernel took."""
        while True:
            n = self._call(self._submit, self._ctx, ctypes.c_long(pointers.size), ctypes.c_void_p(pointers.ctypes.data))
            if n >= 0:
                return n
            err = ctypes.get_errno()
            if err not in (errno.EINTR, errno.EAGAIN):
                raise NgramReadError(f"io_submit of {pointers.size} reads failed: {os.strerror(err)}")
            if err == errno.EAGAIN:
                return 0

    def wait(self, min_events: int, timeout_s: float) -> np.ndarray:
        """Completed events (a view of self.events), at least `min_events` unless `timeout_s` passes first."""
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        while True:
            n = self._call(
                self._getevents,
                self._ctx,
                ctypes.c_long(min_events),
                ctypes.c_long(self.depth),
                ctypes.c_void_p(self.events.ctypes.data),
                ctypes.byref(ts),
            )
            if n >= 0:
                return self.events[:n]
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise NgramReadError(f"io_getevents failed: {os.strerror(err)}")

    def close(self) -> None:
        """Destroy the context; the kernel first waits for reads still in flight."""
        if self._ctx.value:
            self._call(self._destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def _call(self, number: int, *args: object) -> int:
        ctypes.set_errno(0)
        return self._syscall(ctypes.c_long(number), *args)
