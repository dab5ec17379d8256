"""The standard routing trace: seeded, k distinct per token, calibrated LRU hit rates, checked files."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from bigmoe_bench import traces


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


@pytest.mark.parametrize("family", sorted(traces.FAMILIES))
def test_every_family_is_seeded_distinct_and_in_range(family):
    a = traces.named_trace(family, 300, 3, 64, 6, seed=1)
    assert np.array_equal(a, traces.named_trace(family, 300, 3, 64, 6, seed=1))
    assert a.shape == (300, 3, 6) and a.min() >= 0 and a.max() < 64
    assert all(len(set(row)) == 6 for row in a.reshape(-1, 6))


def test_families_order_by_locality():
    """LRU hit rates at 32 of 256 slots: standard > topic-shift > near-uniform (the families' point)."""
    rates = {f: traces.lru_hit_rate(traces.named_trace(f, 800, 2, 256, 8), 32) for f in traces.FAMILIES}
    assert rates["standard"] > rates["topic-shift"] + 0.02 > rates["near-uniform"] + 0.3


def test_topic_shifts_move_the_popular_experts():
    """Top-16 experts of a layer, first half vs second half: stable in the standard trace, not under shifts."""

    def overlap(trace):
        before = np.bincount(trace[:480, 0].ravel(), minlength=256)
        after = np.bincount(trace[480:, 0].ravel(), minlength=256)
        return len(set(np.argsort(-before)[:16]) & set(np.argsort(-after)[:16]))

    shifted = overlap(traces.named_trace("topic-shift", 960, 1, 256, 8, seed=2))
    stable = overlap(traces.named_trace("standard", 960, 1, 256, 8, seed=2))
    assert shifted + 4 <= stable


def _conditional_recall(trace: np.ndarray, k: int) -> tuple[float, float]:
    """(recall of layer 1's ids predicted from layer 0's by co-occurrence learned on the first half,
    recall of the most popular layer-1 experts), on the second half."""
    half = len(trace) // 2
    experts = int(trace.max()) + 1
    cooc = np.zeros((experts, experts))
    for row in trace[:half]:
        cooc[np.ix_(row[0], row[1])] += 1
    popular = set(np.argsort(-cooc.sum(axis=0))[:k])
    cond = cooc / np.maximum(cooc.sum(axis=1, keepdims=True), 1)
    hit = base = 0
    for row in trace[half:]:
        guess = set(np.argsort(-cond[row[0]].sum(axis=0))[:k])
        hit += len(guess & set(row[1]))
        base += len(popular & set(row[1]))
    n = (len(trace) - half) * k
    return hit / n, base / n


def test_cross_layer_correlation_makes_the_next_layer_predictable():
    """With corr > 0 a token's layer-l experts predict its layer-(l+1) experts beyond popularity; without, not."""
    corr = traces.family_trace(traces.Family(alpha=1.2, keep=0.3, corr=0.5), 2000, 2, 32, 4, seed=3)
    plain = traces.family_trace(traces.Family(alpha=1.2, keep=0.3), 2000, 2, 32, 4, seed=3)
    got, base = _conditional_recall(corr, 4)
    assert got > base + 0.03
    got, base = _conditional_recall(plain, 4)
    assert abs(got - base) < 0.015


def test_predictions_round_trip_in_the_trace_file(tmp_path):
    trace = traces.named_trace("standard", 50, 3, 32, 4)
    pred = traces.predictions(trace, 0.6, 0.5, 32)
    traces.save_trace(tmp_path / "p.npz", trace, pred)
    assert np.array_equal(traces.load_predictions(tmp_path / "p.npz", 32), pred)
    traces.save_trace(tmp_path / "q.npz", trace)
    assert traces.load_predictions(tmp_path / "q.npz") is None
    with pytest.raises(traces.TraceError, match="recall"):
        traces.predictions(trace, 1.5, 0.5, 32)


@pytest.mark.parametrize("recall", [0.0, 0.6, 0.8, 1.0])
def test_a_top_k_predictor_proposes_k_ids_at_precision_equal_to_recall(recall):
    """precision None: every row proposes exactly k distinct ids (whatever the recall), recall of them right."""
    trace = traces.named_trace("topic-shift", 400, 3, 32, 4)
    pred = traces.predictions(trace, recall, None, 32, seed=1)
    assert pred.shape == (400, 3, 4)
    rows = pred[:, :2].reshape(-1, 4)
    assert (rows >= 0).all() and all(len(set(r)) == 4 for r in rows.tolist())
    assert (pred[:, 2] == -1).all()  # the last layer has no next one
    right = np.mean([len(set(p) & set(t)) / 4 for p, t in zip(rows.tolist(), trace[:, 1:].reshape(-1, 4).tolist())])
    assert abs(right - recall) < 0.03


def test_unknown_family_is_one_line_and_exit_2(capsys):
    assert traces.main(["--family", "zipfy"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_the_recorded_trace_is_committed_and_well_formed():
    """docs/bench/recorded-tiny64.npz: real vLLM (CPU build) routing of the 64-expert top-8 8-layer tiny model."""
    trace = traces.named_trace("recorded", 0, 0, 0, 0)
    assert trace.shape[1:] == (8, 8) and trace.shape[0] >= 1000
    assert trace.min() >= 0 and trace.max() == 63
    assert all(len(set(row)) == 8 for row in trace.reshape(-1, 8))


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_popular_wrong_ids_are_the_layers_popular_experts_at_the_same_recall(family):
    """Both wrong-id models keep k distinct ids at the stated recall; popular ones were used by the layer in the
    tokens just before far more often than uniform ones (as a router's near misses are)."""
    trace = traces.named_trace(family, 600, 3, 64, 8, seed=4)
    window = traces.POPULAR_WINDOW

    def recent_uses(t: int, expert: int) -> int:
        return int((trace[max(0, t - window) : t, 2] == expert).sum())

    mean_use = {}
    for wrong in ("uniform", "popular"):
        pred = traces.predictions(trace, 0.5, None, 64, seed=4, wrong=wrong)
        rows, truth = pred[:, 1].tolist(), trace[:, 2].tolist()  # layer 1 proposes layer 2
        assert all(len(set(r)) == 8 for r in rows)
        right = np.mean([len(set(r) & set(t)) / 8 for r, t in zip(rows, truth)])
        assert abs(right - 0.5) < 0.03
        mean_use[wrong] = np.mean(
            [recent_uses(t, e) for t, (r, m) in enumerate(zip(rows, truth)) for e in set(r) - set(m)]
        )
    assert mean_use["popular"] > 1.5 * mean_use["uniform"]


def test_an_unknown_wrong_id_model_is_refused():
    trace = traces.named_trace("standard", 20, 2, 32, 4)
    with pytest.raises(traces.TraceError, match="one of uniform, popular, none"):
        traces.predictions(trace, 0.5, None, 32, wrong="nearby")


@pytest.mark.parametrize("recall", [0.0, 0.6])
def test_proposals_without_wrong_ids_hold_only_right_ones(recall):
    """wrong="none": a row proposes only its right ids, so at recall 0 nothing at all (-1 padded to k)."""
    trace = traces.named_trace("standard", 300, 3, 32, 4, seed=2)
    pred = traces.predictions(trace, recall, None, 32, seed=2, wrong="none")
    assert pred.shape == (300, 3, 4)
    rows, truth = pred[:, 1].tolist(), trace[:, 2].tolist()
    assert all({e for e in r if e >= 0} <= set(t) for r, t in zip(rows, truth))  # precision 1
    right = np.mean([len({e for e in r if e >= 0}) / 4 for r in rows])
    assert abs(right - recall) < 0.04


def _recall_against(rows: np.ndarray, truth: np.ndarray) -> float:
    """Share of the true ids (truth [rows, k]) that the proposals (rows [rows, P], -1 padded) contain."""
    hit = sum(len({e for e in p if e >= 0} & set(t)) for p, t in zip(rows.tolist(), truth.tolist()))
    return hit / truth.size


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform"])
@pytest.mark.parametrize("precision", [None, 0.5], ids=["top-k", "precision-0.5"])
def test_proposals_further_ahead_are_right_about_that_layer_at_their_own_recall(family, precision):
    """Entry [d - 2, t, l] proposes layer l+d's ids at recalls[d - 2]; its last d layers have nothing to propose."""
    layers, experts, k = 5, 48, 4
    trace = traces.named_trace(family, 500, layers, experts, k, seed=2)
    recalls = [0.8, 0.5, 0.2]
    deeper = traces.deeper_predictions(trace, recalls, precision, experts, seed=3)
    assert deeper.shape[:3] == (len(recalls), 500, layers) and deeper.dtype == np.int32
    for d, recall in enumerate(recalls, start=2):
        rows = deeper[d - 2, :, : layers - d].reshape(-1, deeper.shape[3])
        truth = trace[:, d:].reshape(-1, k)
        assert _recall_against(rows, truth) == pytest.approx(recall, abs=0.03), d
        assert (deeper[d - 2, :, layers - d :] == -1).all()
        if precision is None:  # a top-k proposal: k ids, whatever the recall
            assert ((rows >= 0).sum(axis=1) == k).all()


def test_proposals_further_ahead_round_trip_and_need_the_next_layers_beside_them(tmp_path):
    trace = traces.named_trace("standard", 60, 4, 32, 4)
    pred = traces.predictions(trace, 0.9, None, 32)
    deeper = traces.deeper_predictions(trace, [0.7, 0.5], None, 32)
    traces.save_trace(tmp_path / "p.npz", trace, pred, deeper)
    assert np.array_equal(traces.load_predictions_ahead(tmp_path / "p.npz", 32), deeper)
    traces.save_trace(tmp_path / "q.npz", trace, pred)
    assert traces.load_predictions_ahead(tmp_path / "q.npz") is None
    with pytest.raises(traces.TraceError, match="need the next layer's"):
        traces.save_trace(tmp_path / "r.npz", trace, None, deeper)
    assert not (tmp_path / "r.npz").exists()
    with pytest.raises(traces.TraceError, match="at least one layer ahead"):
        traces.predictions(trace, 0.5, None, 32, ahead=0)
