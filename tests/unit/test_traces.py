"""The standard routing trace: seeded, k distinct per token, calibrated LRU hit rates, checked files."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import traces  # noqa: E402  (scripts/ is not a package)


@pytest.fixture(scope="module")
def trace() -> np.ndarray:
    return traces.standard_trace(1200, 3, 256, 8, seed=4)


def test_seeded_and_distinct(trace):
    assert trace.dtype == np.int32 and trace.shape == (1200, 3, 8)
    again = traces.standard_trace(1200, 3, 256, 8, seed=4)
    assert np.array_equal(trace, again)
    assert not np.array_equal(trace, traces.standard_trace(1200, 3, 256, 8, seed=5))
    assert all(len(set(row)) == 8 for row in trace.reshape(-1, 8))
    assert trace.min() >= 0 and trace.max() < 256


def test_layers_have_their_own_popularity(trace):
    top = [np.bincount(trace[:, layer].ravel(), minlength=256).argmax() for layer in range(3)]
    assert len(set(top)) > 1


@pytest.mark.parametrize("slots,low,high", [(32, 0.74, 0.80), (102, 0.89, 0.94)])
def test_lru_hit_rates_are_the_calibrated_ones(trace, slots, low, high):
    assert low <= traces.lru_hit_rate(trace, slots) <= high


def test_file_round_trip_and_bad_files(tmp_path, trace):
    path = tmp_path / "t.npz"
    traces.save_trace(path, trace)
    assert np.array_equal(traces.load_trace(path, 256), trace)
    with pytest.raises(traces.TraceError, match="ids must lie"):
        traces.load_trace(path, 100)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(traces.TraceError):
        traces.load_trace(path)
    np.savez(tmp_path / "wrong.npz", topk_ids=np.zeros((4, 8), np.int32))
    with pytest.raises(traces.TraceError, match="int32"):
        traces.load_trace(tmp_path / "wrong.npz")
    with pytest.raises(traces.TraceError, match="does not exist"):
        traces.load_trace(tmp_path / "none.npz")
