"""Aligned O_DIRECT reads of byte ranges into caller memory.

O_DIRECT bypasses the page cache (the pager's RAM tier is the cache), but the
kernel then wants the file offset, the length and the buffer address aligned to
the device's logical block size. ALIGN (4096) covers every common block size.
A range that is aligned on all three lands straight in the caller's buffer; any
other range is read as the aligned span around it into a per-thread bounce
buffer and the wanted bytes are copied out.

Failures are one-line exceptions: `ODirectError` when the filesystem refuses
O_DIRECT (EINVAL), `ReadError` (naming file, offset, length) when a read stays
short or keeps failing with EIO after `retries` more tries.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from .read_stats import ReadCounters

ALIGN = 4096  # bytes; >= the logical block size of NVMe/SATA devices, and the page size
_RETRYABLE = (errno.EIO, errno.EINTR, errno.EAGAIN)
MAX_BACKOFF_S = 0.256  # the longest wait before a file-level retry (ssd_reader.c's MAX_BACKOFF_NS)
_bounce = threading.local()  # one bounce buffer per thread, shared by all files (a model has many shards)


class ODirectError(RuntimeError):
    """The filesystem holding a file refuses O_DIRECT; the message says where and what to do."""


class ReadError(RuntimeError):
    """A read failed for good; names file, offset and length."""

    def __init__(self, path: str | os.PathLike, offset: int, length: int, why: str):
        self.path, self.offset, self.length, self.why = str(path), offset, length, why
        super().__init__(f"read of {length} bytes at offset {offset} of {path} failed: {why}")


class SystemFileIO:
    """The system calls behind DirectFile; tests swap in fakes (named as such) to inject faults."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags)

    def preadv(self, fd: int, buf: np.ndarray, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def close(self, fd: int) -> None:
        os.close(fd)


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes whose first byte sits on an ALIGN boundary (pinned if asked)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def as_byte_array(dst: object) -> np.ndarray:
    """A writable flat uint8 numpy view of a uint8 CPU tensor, numpy array, bytearray or memoryview."""
    if isinstance(dst, torch.Tensor):
        if dst.device.type != "cpu" or dst.dtype != torch.uint8 or not dst.is_contiguous():
            raise TypeError(f"destination must be a contiguous uint8 CPU tensor, got {dst.dtype} on {dst.device}")
        return dst.view(-1).numpy()
    arr = np.frombuffer(dst, dtype=np.uint8) if not isinstance(dst, np.ndarray) else dst.reshape(-1)
    if arr.dtype != np.uint8 or not arr.flags.writeable or not arr.flags.c_contiguous:
        raise TypeError("destination must be writable contiguous uint8 memory")
    return arr


class DirectFile:
    """One file opened with O_DIRECT; `read_into` is safe to call from many threads at once."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retries: int = 2,
        io: SystemFileIO | None = None,
        counters: ReadCounters | None = None,
    ):
        self.path = str(path)
        self.retries = retries
        self.io = io or SystemFileIO()
        self.counters = counters if counters is not None else ReadCounters()
        try:
            self.fd = self.io.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise ODirectError(_refused(self.path, "open")) from None
            raise
        self.size = self.io.size(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            self.io.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, offset: int, dst: object) -> None:
        """Fill dst (its whole length) with the file's bytes from offset; raises ReadError/ODirectError."""
        out = as_byte_array(dst)
        length = out.nbytes
        if offset % ALIGN or length % ALIGN or out.ctypes.data % ALIGN:
            out[:] = self.read_view(offset, length)
            return
        self._check_range(offset, length)
        t0 = time.perf_counter_ns()
        self._read_span(offset, out, need=length, length=length, offset=offset)
        self.counters.add_read(length, time.perf_counter_ns() - t0)

    def read_view(self, offset: int, length: int) -> np.ndarray:
        """The file's bytes [offset, offset+length) as a view of this thread's bounce buffer.

        Valid until this thread's next read_view or unaligned read_into (on any file).
        """
        self._check_range(offset, length)
        start = offset - offset % ALIGN
        span = _round_up(offset + length, ALIGN) - start
        target = self._bounce_buffer(span)
        t0 = time.perf_counter_ns()
        self._read_span(start, target, need=offset + length - start, length=length, offset=offset)
        self.counters.add_read(length, time.perf_counter_ns() - t0)
        return target[offset - start : offset - start + length]

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            self.counters.add_error()
            raise ReadError(self.path, offset, length, f"the file is only {self.size} bytes (truncated?)")

    def _read_span(self, start: int, target: np.ndarray, need: int, length: int, offset: int) -> None:
        """One aligned preadv of target's size at start, retried while short (under `need` bytes: past the file's
        end O_DIRECT returns less) or failing with EIO; errors name the caller's range (offset, length)."""
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters.add_retry()
                time.sleep(_backoff_s(attempt))
            try:
                got = self.io.preadv(self.fd, target, start)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    self.counters.add_error()
                    raise ODirectError(_refused(self.path, "read")) from None
                if e.errno not in _RETRYABLE:
                    self.counters.add_error()
                    raise ReadError(self.path, offset, length, e.strerror or str(e)) from None
                why = f"{errno.errorcode.get(e.errno, e.errno)} ({e.strerror})"
                continue
            if got >= need:
                return
            why = f"short read: got {got - (offset - start)} of {length} bytes"
        self.counters.add_error()
        raise ReadError(self.path, offset, length, f"{why} after {self.retries} retries")

    @staticmethod
    def _bounce_buffer(nbytes: int) -> np.ndarray:
        buf = getattr(_bounce, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(_round_up(nbytes, ALIGN)).numpy()
            _bounce.buf = buf
        return buf[:nbytes]


def odirect_works(path: str | os.PathLike, io: SystemFileIO | None = None) -> tuple[bool, str]:
    """Whether O_DIRECT reads really work at path (a file, or a directory to probe with a temp file).

    Does a real aligned read, since some filesystems accept O_DIRECT on open and
    fail the read. Never raises: the reason says what happened.
    """
    path = Path(path)
    io = io or SystemFileIO()
    try:
        if path.is_dir():
            return _probe_dir(path, io)
        return _probe_file(path, io, expect=None)
    except OSError as e:
        return False, f"{path}: {e.strerror or e}"


def _probe_dir(directory: Path, io: SystemFileIO) -> tuple[bool, str]:
    pattern = (np.arange(2 * ALIGN, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
    fd, name = tempfile.mkstemp(prefix=".bigmoe-odirect-probe-", dir=directory)
    try:
        os.write(fd, pattern.tobytes())
        os.fsync(fd)
        os.close(fd)
        ok, why = _probe_file(Path(name), io, expect=pattern[ALIGN:])
        return ok, why.replace(name, f"{directory} (probe file)")
    finally:
        os.unlink(name)


def _probe_file(path: Path, io: SystemFileIO, expect: np.ndarray | None) -> tuple[bool, str]:
    try:
        f = DirectFile(path, retries=0, io=io)
    except ODirectError:
        return False, f"{path}: the filesystem refuses O_DIRECT on open"
    with f:
        if f.size == 0:
            return False, f"{path}: empty file, nothing to read with O_DIRECT"
        offset = ALIGN if expect is not None else 0
        length = min(ALIGN, f.size - offset)
        buf = aligned_empty(ALIGN).numpy()
        try:
            got = io.preadv(f.fd, buf, offset)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False, f"{path}: open with O_DIRECT works but an aligned read fails (EINVAL)"
            return False, f"{path}: aligned O_DIRECT read failed: {e.strerror}"
        if got < length:
            return False, f"{path}: aligned O_DIRECT read returned {got} of {length} bytes"
        if expect is not None and not np.array_equal(buf[:length], expect):
            return False, f"{path}: O_DIRECT read returned different bytes than were written"
        return True, f"{path}: aligned O_DIRECT read of {length} bytes works"


def _refused(path: str, where: str) -> str:
    return (
        f"{path}: the filesystem refuses O_DIRECT (EINVAL on {where}); put the model or paging file "
        "on a local disk filesystem (ext4, xfs, btrfs), not a network, overlay or FUSE mount"
    )


def _backoff_s(attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...): 1, 2, 4 ms ... to give a flaky device a moment, at most
    MAX_BACKOFF_S, so that a high BIGMOE_READ_RETRIES fails a dead disk in seconds, not hours."""
    return min(0.001 * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
