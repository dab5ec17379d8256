"""Counters of SSD reads: how many, how many bytes, how long, retries, errors.

Plain integers behind a lock so many I/O threads can add to one set; the pager's
stats module reads `snapshot()` (a dict of numbers) and never these objects'
internals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


class LockedCounters:
    """Integer dataclass fields behind one lock: many threads add, a reader takes `snapshot()`.

    Subclasses are dataclasses whose fields are the counters; they add under `self._lock`.
    """

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # not a field: kept out of snapshot(), repr and ==

    def snapshot(self) -> dict[str, int]:
        """The counters as plain numbers, read consistently."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ReadCounters(LockedCounters):
    """Totals of the SSD reads done for one tier (or one layer of it)."""

    reads: int = 0
    """Successful expert reads."""
    bytes: int = 0
    """Payload bytes of those reads (what the caller asked for, not the aligned spans)."""
    read_ns: int = 0
    """Wall time spent inside successful reads, summed over threads, in nanoseconds."""
    retries: int = 0
    """Reads issued again after a short read, EIO, a checksum mismatch or a late answer."""
    errors: int = 0
    """Reads that failed for good (retries exhausted or not retryable)."""
    hurried: int = 0
    """Reads ahead a step came to wait for before a worker had taken them, moved ahead of the other reads ahead."""

    def add_read(self, nbytes: int, ns: int) -> None:
        with self._lock:
            self.reads += 1
            self.bytes += nbytes
            self.read_ns += ns

    def add_many(self, reads: int, bytes: int, read_ns: int, retries: int, errors: int, hurried: int = 0) -> None:
        """Add totals counted elsewhere (the native reader's, per layer)."""
        with self._lock:
            self.reads += reads
            self.bytes += bytes
            self.read_ns += read_ns
            self.retries += retries
            self.errors += errors
            self.hurried += hurried

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def add_error(self) -> None:
        with self._lock:
            self.errors += 1

    def add_hurried(self) -> None:
        with self._lock:
            self.hurried += 1

    def read_gbps(self) -> float:
        """Bytes per second of read time, in GB/s (per thread, not aggregate)."""
        snap = self.snapshot()
        return snap["bytes"] / snap["read_ns"] if snap["read_ns"] else 0.0
