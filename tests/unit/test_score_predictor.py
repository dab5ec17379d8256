"""scripts/score_predictor.py: a trace's predictions scored per layer against the next layer's ids, beside chance;
bad traces get one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import score_predictor  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces


@pytest.mark.parametrize("recall,precision", [(0.8, 0.5), (0.6, 1.0), (1.0, 0.8)])
def test_stated_recall_and_precision_come_back(recall, precision):
    topk = traces.family_trace(traces.FAMILIES["topic-shift"], 400, 3, 64, 8, seed=2)
    predicted = traces.predictions(topk, recall, precision, 64, seed=2)
    got = score_predictor.score(topk, predicted, 64)
    assert [row["layer"] for row in got["per_layer"]] == [0, 1]  # the last layer proposes nothing
    assert got["overall"]["recall"] == pytest.approx(recall, abs=0.02)
    assert got["overall"]["precision"] == pytest.approx(precision, abs=0.03)
    proposed_per_row = got["counts"]["proposed"] / (400 * 2)
    assert got["chance"]["recall"] == pytest.approx(proposed_per_row / 64, abs=1e-4)
    assert got["chance"]["precision"] == pytest.approx(8 / 64, abs=1e-4)  # top-8 distinct ids per row


@pytest.mark.parametrize("recalls", [[0.7], [0.65, 0.5, 0.35]])
def test_each_depth_further_ahead_is_scored_against_its_own_layer(recalls):
    topk = traces.family_trace(traces.FAMILIES["standard"], 400, 5, 64, 8, seed=3)
    predicted = traces.predictions(topk, 0.8, None, 64, seed=3)
    deeper = traces.deeper_predictions(topk, recalls, None, 64, seed=3)
    got = score_predictor.score_depths(topk, predicted, deeper, 64)
    assert got["overall"]["recall"] == pytest.approx(0.8, abs=0.02)
    assert [d["ahead"] for d in got["further_ahead"]] == list(range(2, 2 + len(recalls)))
    for d, recall in zip(got["further_ahead"], recalls):
        assert [row["layer"] for row in d["per_layer"]] == list(range(5 - d["ahead"]))  # layer l proposes l + ahead
        assert d["overall"]["recall"] == pytest.approx(recall, abs=0.02)
    # scored against the next layer instead, a deeper row is near chance: the depth is what it is judged by
    shifted = score_predictor.score(topk, deeper[0], 64)
    assert shifted["overall"]["recall"] < got["further_ahead"][0]["overall"]["recall"] - 0.3


def test_the_table_has_a_block_a_depth(tmp_path: Path, capsys):
    topk = traces.named_trace("topic-shift", 60, 4, 32, 4)
    deeper = traces.deeper_predictions(topk, [0.6, 0.4], None, 32)
    traces.save_trace(tmp_path / "t.npz", topk, traces.predictions(topk, 0.8, None, 32), deeper)
    assert score_predictor.main([str(tmp_path / "t.npz"), "--experts", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    blocks = [l for l in lines if l.startswith("proposals made")]
    assert blocks == ["proposals made 2 layers ahead (P = 4)", "proposals made 3 layers ahead (P = 4)"]
    assert sum(l.startswith("overall") for l in lines) == 3 and lines[-1].startswith("chance")
    assert lines[lines.index(blocks[1]) + 2].split()[0] == "3"  # layer 0's proposals made 3 ahead are for layer 3


def test_a_perfect_and_a_useless_predictor_score_one_and_zero():
    topk = np.array([[[0, 1], [2, 3], [4, 5]], [[1, 2], [3, 0], [5, 6]]], dtype=np.int32)
    perfect = np.concatenate([topk[:, 1:], np.full((2, 1, 2), -1, np.int32)], axis=1)
    useless = np.where(perfect >= 0, 7, -1).astype(np.int32)
    assert score_predictor.score(topk, perfect, 8)["overall"] == {"recall": 1.0, "precision": 1.0}
    assert score_predictor.score(topk, useless, 8)["overall"] == {"recall": 0.0, "precision": 0.0}


@pytest.mark.parametrize("as_json", [False, True])
def test_the_command_prints_a_table_or_json(tmp_path: Path, capsys, as_json):
    topk = traces.named_trace("standard", 50, 4, 32, 4)
    traces.save_trace(tmp_path / "t.npz", topk, traces.predictions(topk, 0.8, 1.0, 32))
    assert score_predictor.main([str(tmp_path / "t.npz"), "--experts", "32", *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    if as_json:
        data = json.loads(out)
        assert data["experts"] == 32 and len(data["per_layer"]) == 3 and data["overall"]["recall"] > 0.7
    else:
        lines = out.splitlines()
        assert lines[0].endswith("32 experts") and lines[-2].startswith("overall") and lines[-1].startswith("chance")


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "does not exist"),
        ("no predictions", "carries no predicted_ids"),
        ("all -1", "proposes nothing"),
        ("rows differ", "differ in rows"),
        ("bad experts", "--experts must be a positive integer"),
        ("ids over experts", "ids must lie in [-1, 4)"),
        ("ahead rows differ", "predicted_ids_ahead (1, 19, 3, 2) and topk_ids (20, 3, 2) differ in rows"),
    ],
)
def test_a_trace_that_cannot_be_scored_gets_one_line(tmp_path: Path, capsys, case, message):
    topk = traces.named_trace("standard", 20, 3, 16, 2)
    path = tmp_path / "t.npz"
    predicted = {
        "all -1": np.full((20, 3, 2), -1, np.int32),
        "rows differ": np.zeros((19, 3, 2), np.int32),
        "ids over experts": traces.predictions(topk, 1.0, 1.0, 16),
    }.get(case)
    if case == "ahead rows differ":
        traces.save_trace(path, topk, traces.predictions(topk, 1.0, 1.0, 16), np.zeros((1, 19, 3, 2), np.int32))
    elif case != "missing":
        traces.save_trace(path, topk, predicted)
    argv = [str(path)] + {"bad experts": ["--experts", "0"], "ids over experts": ["--experts", "4"]}.get(case, [])
    assert score_predictor.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("score_predictor: ")
