"""BIGMOE_PREDICT=router inside real vLLM (CPU build): the predictor finds every next layer's router in vLLM's
own MoERunner, serves the same greedy tokens as the unpaged model, and records its proposals as the trace's
predicted_ids (and those for layers 2 and 3 ahead as predicted_ids_ahead), which scripts/score_predictor.py scores.

vLLM's CPU build pages host-driven (device-driven paging needs CUDA), so here the proposals are computed and
recorded, not prefetched; tests/unit/test_live_predictor.py feeds them to DeviceLayerPager."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("live-predictor")]  # the two tests share one pair of runs
vllm = pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

import score_predictor  # noqa: E402  (scripts/ is on pytest's pythonpath)
from bigmoe_bench.traces import load_predictions, load_predictions_ahead, load_trace  # noqa: E402
from vllm_runs import greedy_run  # noqa: E402

PROMPTS = ["The sea is calm and the boats are", "one two three four five six seven", "A green tree stands near"]
EXPERTS, LAYERS, TOP_K = 16, 4, 4  # the tiny-moe preset's shape


def greedy(model, env: dict[str, str]):
    full = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")}
    proc = greedy_run(model, 24, PROMPTS, {**full, **env})
    tokens = [l for l in proc.stdout.splitlines() if l.startswith("TOKENS ")]
    assert proc.returncode == 0 and tokens, f"vLLM run failed:\n{proc.stderr[-3000:]}"
    return json.loads(tokens[0][7:]), proc.stderr


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """Greedy tokens unpaged, and paged with the live predictor recording a trace (6 of 16 experts in slots)."""
    tiny = sys.modules["make_tiny_moe"]
    model = tiny_checkpoint(tiny.TinyShape(), "bf16", seed=3)
    trace = tmp_path_factory.mktemp("live-predictor") / "trace.npz"
    unpaged, _ = greedy(model, {})
    env = {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": "6", "BIGMOE_PREDICT": "router", "BIGMOE_TRACE_PATH": str(trace)}
    env["BIGMOE_SSD_READ_AHEAD_LAYERS"] = str(LAYERS - 1)  # and the proposals for layers 2 and 3 ahead
    predicted, log = greedy(model, env)
    return unpaged, predicted, log, trace


def test_the_live_predictor_changes_no_token(runs):
    unpaged, predicted, log, _ = runs
    assert predicted == unpaged
    assert len({tuple(t) for t in unpaged}) > 1, "prompts should not all decode the same"
    assert "predicts nothing" not in log  # every next layer's router was found in vLLM's MoERunner


def test_recorded_proposals_are_predicted_ids_and_score(runs, capsys):
    *_, trace = runs
    topk, predicted = load_trace(trace, EXPERTS), load_predictions(trace, EXPERTS)
    assert predicted is not None and predicted.dtype.name == "int32"
    assert predicted.shape == (topk.shape[0], LAYERS, TOP_K)  # P = the model's top-k (BIGMOE_PREDICT_TOP unset)
    assert topk.shape[0] >= len(PROMPTS) * 24
    assert (predicted[:, :-1] >= 0).all() and (predicted[:, -1] == -1).all()  # layer l proposes l+1; the last none
    assert all(len(set(row)) == TOP_K for row in predicted[:, :-1].reshape(-1, TOP_K).tolist())  # distinct top-P
    assert score_predictor.main([str(trace), "--experts", str(EXPERTS), "--json"]) == 0
    score = json.loads(capsys.readouterr().out)
    assert [row["layer"] for row in score["per_layer"]] == list(range(LAYERS - 1))
    assert score["chance"]["recall"] == TOP_K / EXPERTS
    # Random weights: the residual stream carries layer l's state into l+1, so l+1's router on it beats chance
    # (0.7 against 0.25 here); a trained model's figure is not shown by this.
    assert score["chance"]["recall"] < score["overall"]["recall"] <= 1.0
    deeper = load_predictions_ahead(trace, EXPERTS)
    assert deeper is not None and deeper.shape == (LAYERS - 2, topk.shape[0], LAYERS, TOP_K)
    for ahead in range(2, LAYERS):  # layer l proposes l + ahead; the last `ahead` layers none
        rows = deeper[ahead - 2]
        assert (rows[:, : LAYERS - ahead] >= 0).all() and (rows[:, LAYERS - ahead :] == -1).all()
    assert [d["ahead"] for d in score["further_ahead"]] == list(range(2, LAYERS))
    assert all(score["chance"]["recall"] < d["overall"]["recall"] <= 1.0 for d in score["further_ahead"])
