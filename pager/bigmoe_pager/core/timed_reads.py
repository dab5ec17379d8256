"""The host-driven SSD tier's reads on a pool of I/O workers, each attempt given a deadline.

HostPager reads one expert at a time on the engine's thread. Through a TimedSource the
read runs on one of `io_workers` threads into a buffer of its own; an attempt not answered
within `read_timeout_s` is issued again (at most `read_retries` times) and the first
attempt to finish is copied into the record. A late attempt only ever writes its own
buffer, so it can never overwrite a record that now holds another expert. Failed reads
raise as they come: file-level retries after EIO or short reads are the store's, and
HostPager reads a record again when its checksum fails.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch
from bigmoe_pager.core.host_pager import RecordSource


class ReadTimeout(RuntimeError):
    """No attempt of a read finished in time; the message says how long and how many attempts."""


class TimedReads:
    """The process's I/O workers for host-driven SSD reads (BIGMOE_IO_WORKERS, _READ_TIMEOUT_S, _READ_RETRIES)."""

    def __init__(self, io_workers: int = 4, read_timeout_s: float = 10.0, read_retries: int = 2):
        self.read_timeout_s = read_timeout_s
        """Seconds an attempt may take before the read is issued again."""
        self.read_retries = read_retries
        """Attempts issued after the first one timed out."""
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="bigmoe-read")

    def source(self, source: RecordSource | None) -> "TimedSource | None":
        """`source` read through these workers (None stays None: a layer without an SSD tier)."""
        return None if source is None else TimedSource(self, source)

    def read(self, source: RecordSource, expert: int, dst: torch.Tensor) -> None:
        attempts = []
        for _ in range(self.read_retries + 1):
            attempts.append(self._pool.submit(_attempt, source, expert, dst.shape, dst.dtype))
            done, _ = wait(attempts, timeout=self.read_timeout_s, return_when=FIRST_COMPLETED)
            if done:
                dst.copy_(next(iter(done)).result())  # result() raises the attempt's error
                return
        raise ReadTimeout(f"no answer within {self.read_timeout_s:g} s, {len(attempts)} attempts")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TimedSource:
    """A RecordSource whose reads run on TimedReads' workers."""

    def __init__(self, reads: TimedReads, source: RecordSource):
        self.reads = reads
        self.inner = source
        """The source read (LayerSource: the store and, for codec records, the decoder)."""

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        self.reads.read(self.inner, expert, dst)


def _attempt(source: RecordSource, expert: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One read of `expert` into a buffer of its own (so a late attempt never writes the caller's record)."""
    buf = torch.zeros(shape, dtype=dtype)
    source.read_record(expert, buf)
    return buf
