"""Counters of the n-gram pager: rows asked for, rows served from RAM, rows read from storage.

Plain integers behind a lock (core.read_stats.LockedCounters: the gather runs on a
worker thread while the exporter reads); `snapshot()` gives them as a dict of numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigmoe_pager.core.read_stats import LockedCounters


@dataclass
class ReadTotals(LockedCounters):
    """What one table's gathers did."""

    lookups: int = 0
    """Row ids asked for (duplicates included)."""
    cache_hits: int = 0
    """Distinct rows served from the row cache (0 without one)."""
    rows_read: int = 0
    """Distinct rows read from storage (page cache or device)."""
    bytes_read: int = 0
    """Bytes those reads moved (aligned spans for O_DIRECT, row bytes for the page-cache reader)."""
    reads: int = 0
    """Read requests sent to the device (O_DIRECT: after merging rows that share or neighbour a block)."""
    read_ns: int = 0
    """Wall time spent reading, in nanoseconds."""
    retries: int = 0
    """Reads issued again after a failure or a short read."""
    errors: int = 0
    """Reads that failed for good."""

    def add(self, rows: int, nbytes: int, ns: int, reads: int | None = None) -> None:
        """Count `rows` read in `reads` requests (one per row unless given) moving `nbytes` in `ns`."""
        with self._lock:
            self.rows_read += rows
            self.reads += rows if reads is None else reads
            self.bytes_read += nbytes
            self.read_ns += ns

    def add_lookups(self, ids: int, hits: int) -> None:
        with self._lock:
            self.lookups += ids
            self.cache_hits += hits

    def add_retries(self, n: int) -> None:
        with self._lock:
            self.retries += n

    def add_errors(self, n: int) -> None:
        with self._lock:
            self.errors += n
