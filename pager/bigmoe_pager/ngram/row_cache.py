"""An explicit RAM tier for n-gram rows: a set-associative cache with LRU in each set.

Used above the O_DIRECT reader, where the page cache is bypassed. Every
operation is vectorized over a whole gather (numpy, no per-row Python): a row id
maps to one set of `ways` slots; a hit refreshes the slot's stamp; a miss
replaces the set's least recently used slot. Ids are hash outputs spread
uniformly over the table, so the set index is simply id mod sets.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1  # tag of a slot that holds no row


class RowCache:
    """Holds up to `capacity` rows of `row_bytes` bytes (rounded up to whole sets)."""

    def __init__(self, capacity: int, row_bytes: int, ways: int = 8):
        if capacity <= 0 or ways <= 0:
            raise ValueError(f"row cache needs a positive capacity and ways, got {capacity} rows, {ways} ways")
        self.ways = min(ways, capacity)
        self.sets = -(-capacity // self.ways)
        self.row_bytes = row_bytes
        self.tags = np.full((self.sets, self.ways), EMPTY, np.int64)
        self.stamps = np.zeros((self.sets, self.ways), np.int64)
        self.data = np.zeros((self.sets * self.ways, row_bytes), np.uint8)
        self._clock = 0

    @property
    def capacity(self) -> int:
        return self.sets * self.ways

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For distinct ids in the table (>= 0): (hit mask, slot of each hit); hits become the most recently used."""
        self._clock += 1
        s = ids % self.sets
        match = self.tags[s] == ids[:, None]
        hit = match.any(axis=1)
        way = match.argmax(axis=1)
        self.stamps[s[hit], way[hit]] = self._clock
        return hit, s[hit] * self.ways + way[hit]

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows (uint8 [n, row_bytes]) of distinct ids not in the cache, up to `ways` per set per call.

        The k-th new id of a set takes the set's k-th least recently used slot.
        """
        s = ids % self.sets
        order = np.argsort(s, kind="stable")
        s_sorted = s[order]
        rank = np.arange(s.size) - np.searchsorted(s_sorted, s_sorted, side="left")
        keep = rank < self.ways
        order, s_sorted, rank = order[keep], s_sorted[keep], rank[keep]
        way = np.argsort(self.stamps[s_sorted], axis=1, kind="stable")[np.arange(rank.size), rank]
        self.tags[s_sorted, way] = ids[order]
        self.stamps[s_sorted, way] = self._clock
        self.data[s_sorted * self.ways + way] = rows[order]
