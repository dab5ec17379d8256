"""RowCache: a set-associative cache with LRU in each set, vectorized over whole gathers."""

from __future__ import annotations

import numpy as np
import pytest
from bigmoe_pager.ngram.row_cache import RowCache


def rows_of(ids: np.ndarray, row_bytes: int = 8) -> np.ndarray:
    return (ids[:, None] * 7 + np.arange(row_bytes)).astype(np.uint8)


def cached(cache: RowCache, ids: list[int]) -> set[int]:
    hit, _ = cache.lookup(np.array(ids, np.int64))
    return {i for i, h in zip(ids, hit) if h}


@pytest.mark.parametrize("ways", [1, 4, 8])
def test_hits_return_the_rows_that_were_inserted(ways):
    cache = RowCache(64, 8, ways=ways)
    ids = np.arange(0, 64, dtype=np.int64) * 3 + 1
    cache.insert(ids[:20], rows_of(ids[:20]))
    hit, slots = cache.lookup(ids)
    assert hit.sum() > 0
    np.testing.assert_array_equal(cache.data[slots], rows_of(ids[hit]))


def test_one_set_behaves_as_lru():
    cache = RowCache(4, 8, ways=4)  # one set: plain LRU over 4 rows
    cache.insert(np.array([10, 11, 12, 13]), rows_of(np.array([10, 11, 12, 13])))
    assert cached(cache, [10]) == {10}  # 10 becomes the most recent; 11 is now the oldest
    cache.insert(np.array([14]), rows_of(np.array([14])))
    assert cached(cache, [10, 11, 12, 13, 14]) == {10, 12, 13, 14}


def test_a_batch_fills_up_to_ways_slots_of_one_set():
    cache = RowCache(16, 8, ways=4)  # 4 sets; ids 0, 4, 8, ... share set 0
    ids = np.array([0, 4, 8, 12, 16, 20], np.int64)
    cache.insert(ids, rows_of(ids))
    assert len(cached(cache, ids.tolist())) == 4


def test_capacity_is_whole_sets_and_must_be_positive():
    assert RowCache(10, 8, ways=4).capacity == 12
    with pytest.raises(ValueError):
        RowCache(0, 8)
