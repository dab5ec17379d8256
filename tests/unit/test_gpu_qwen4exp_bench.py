"""scripts/gpu_qwen4exp_bench.py's configuration names: @rX replays the family trace with next-layer predictions at
recall X for the checkpoint's own experts, +ahead turns on SSD read-ahead (the GPU run itself is the lead's)."""

from __future__ import annotations

from pathlib import Path

import gpu_qwen4exp_bench as q4x  # scripts/ is on pytest's pythonpath (pyproject)
import numpy as np
import pytest
from bigmoe_bench import traces

SHAPES = {"4-layer x 512, top-10": (4, 512, 10), "3-layer x 64, top-8": (3, 64, 8)}


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def numbers(request) -> dict:
    layers, experts, top_k = SHAPES[request.param]
    return {"layers": layers, "experts": experts, "top_k": top_k, "vocab": 1000}


@pytest.fixture
def family_trace(tmp_path: Path, numbers: dict) -> Path:
    path = tmp_path / "topic-shift-trace.npz"
    ids = traces.named_trace("topic-shift", 600, numbers["layers"], numbers["experts"], numbers["top_k"], seed=0)
    traces.save_trace(path, ids)
    return path


@pytest.mark.parametrize(
    "name,recall,ahead",
    [
        ("bigmoe-4090", None, False),
        ("bigmoe-4090@r0.8", 0.8, False),
        ("bigmoe-4090@r0.8+ahead", 0.8, True),
        ("bigmoe-allram@r1", 1.0, False),
        ("bigmoe-4090-nongram@r0+ahead", 0.0, True),
    ],
)
@pytest.mark.parametrize("precision", [None, 0.5], ids=["top-k", "precision-0.5"])
def test_a_name_replays_predictions_at_its_recall_for_the_checkpoints_experts(
    name, recall, ahead, precision, numbers, family_trace
):
    named = {c.name: (c, extra) for c, extra in q4x.configs(family_trace, numbers, 35, 218, 6.4)}
    config, _ = q4x.with_suffixes(name, named, family_trace, precision, numbers["experts"])
    assert config.name == name
    assert (config.env.get("BIGMOE_SSD_READ_AHEAD") == "1") is ahead
    replay = Path(config.env["BIGMOE_ROUTE_REPLAY"])
    truth = traces.load_trace(family_trace, numbers["experts"])
    assert np.array_equal(traces.load_trace(replay, numbers["experts"]), truth)
    predicted = traces.load_predictions(replay, numbers["experts"])
    if recall is None:
        assert replay == family_trace and predicted is None
        return
    assert predicted is not None and predicted.shape[:2] == truth.shape[:2]
    hits = needed = 0
    for t in range(truth.shape[0]):
        for layer in range(truth.shape[1] - 1):
            nxt = set(truth[t, layer + 1].tolist())
            hits += len(nxt & set(predicted[t, layer].tolist()))
            needed += len(nxt)
    assert hits / needed == pytest.approx(recall, abs=0.02)
    proposed = int((predicted[:, :-1] >= 0).sum())
    wanted = recall if precision is None else precision  # top-k proposes k ids a row: precision = recall
    if proposed:
        assert hits / proposed == pytest.approx(wanted, abs=0.03)
    if precision is None:
        assert predicted.shape[2] == numbers["top_k"]


def test_a_second_checkpoint_in_the_same_workdir_gets_its_own_predictions(tmp_path: Path):
    """The predicted trace is remade from the family trace at hand, never kept from an earlier model's run."""
    path = tmp_path / "standard-trace.npz"
    for layers, experts in ((3, 64), (4, 512)):
        traces.save_trace(path, traces.named_trace("standard", 200, layers, experts, 8, seed=0))
        replay = q4x.predicted_trace(path, 0.8, 0.5, experts)
        predicted = traces.load_predictions(replay, experts)
        assert predicted.shape[1] == layers and predicted.max() < experts


@pytest.mark.parametrize("precision", ["0", "1.5", "-0.2"])
def test_a_precision_outside_its_range_is_one_clear_line(precision, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_:
        q4x.main(["--model", str(tmp_path), "--out", str(tmp_path / "o.json"), "--precision", precision])
    assert exit_.value.code == 2
    assert "--precision is the share of a proposal that is right" in capsys.readouterr().err
