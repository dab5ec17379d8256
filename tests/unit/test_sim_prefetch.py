"""scripts/sim_prefetch.py: prefetch replayed with the pager's own tables, per routing family."""

from __future__ import annotations

import argparse
import json

import pytest
import sim_prefetch  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces
from bigmoe_pager.core.slots import MIN_USED_PERCENT

WHOLE_ROUND_GATE = 60
"""The gate's threshold chosen for rounds without a budget (run 10; slots.MIN_USED_PERCENT's doc)."""


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform"])
def test_right_predictions_take_copies_off_the_wait_and_wrong_ones_add_copies_never_used(family):
    trace = traces.named_trace(family, 80, 3, 64, 4, seed=1)
    plain = sim_prefetch.simulate(trace, None, 64, 16, "lfu-fast")
    perfect = sim_prefetch.simulate(trace, traces.predictions(trace, 1.0, 1.0, 64), 64, 16, "lfu-fast")
    sloppy = sim_prefetch.simulate(trace, traces.predictions(trace, 1.0, 0.5, 64), 64, 16, "lfu-fast")
    assert plain["prefetch_copies_per_token"] == 0 and plain["prefetched_unused_per_token"] == 0
    assert perfect["prefetched_unused_per_token"] == 0 and perfect["prefetch_copies_per_token"] > 0
    assert perfect["demand_copies_per_token"] < plain["demand_copies_per_token"]
    assert sloppy["prefetched_unused_per_token"] > 0
    assert sloppy["copies_per_token"] > plain["copies_per_token"]


@pytest.mark.parametrize("family", ["standard", "near-uniform"])
def test_the_gate_keeps_a_useless_predictor_near_no_prefetch_and_a_good_one_open(family):
    """Top-k proposals (precision = recall): at recall 0 the gate copies a fraction of what no gate copies;
    at recall 1 it never closes and copies what no gate copies."""
    trace = traces.named_trace(family, 200, 3, 64, 4, seed=2)
    plain = sim_prefetch.simulate(trace, None, 64, 16, "lfu-fast")
    runs = {}
    for recall in (0.0, 1.0):
        pred = traces.predictions(trace, recall, None, 64, seed=2)
        for gate in (MIN_USED_PERCENT, 0):
            runs[recall, gate] = sim_prefetch.simulate(trace, pred, 64, 16, "lfu-fast", min_used_percent=gate)
    useless, ungated = runs[0.0, MIN_USED_PERCENT], runs[0.0, 0]
    assert useless["gate_closed"] > 0.9 and ungated["gate_closed"] == 0
    assert useless["prefetch_copies_per_token"] < 0.2 * ungated["prefetch_copies_per_token"]
    assert useless["copies_per_token"] < plain["copies_per_token"] + 0.2 * ungated["prefetch_copies_per_token"]
    assert runs[1.0, MIN_USED_PERCENT]["gate_closed"] == 0 and runs[1.0, MIN_USED_PERCENT] == runs[1.0, 0]


@pytest.mark.parametrize(
    "shape,tables",
    [("qwen3.6", [(256, 102), (256, 32)]), ("flash-next-ram", [(512, 218)])],
)
def test_the_script_writes_one_row_per_case_with_a_no_prefetch_baseline(tmp_path, shape, tables):
    out = tmp_path / "sim.json"
    argv = ["--tokens", "30", "--layers", "2", "--families", "standard", "--recalls", "0.8", "--precisions", "0.5"]
    assert sim_prefetch.main([*argv, "--shape", shape, "--gates", "25,0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    got = [(r["experts"], r["vram"], r["recall"], r["min_used_percent"]) for r in report["rows"]]
    want = [(e, s, r, g) for e, s in tables for r, g in [(None, None), (0.8, 25), (0.8, 0)]]
    assert report["shape"] == shape and got == want


def test_an_unknown_shape_is_refused_in_one_line(capsys):
    assert sim_prefetch.main(["--tokens", "10", "--shape", "flash"]) == 2
    assert "--shape takes one of qwen3.6, flash-next-ram" in capsys.readouterr().err


def test_topk_is_a_precision_and_bad_lists_are_refused(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--tokens", "20", "--layers", "2", "--families", "standard", "--recalls", "0.5", "--gates", "25"]
    assert sim_prefetch.main([*argv, "--precisions", "topk", "--out", str(out)]) == 0
    assert [r["precision"] for r in json.loads(out.read_text())["rows"]] == [None, None, None, None]
    assert sim_prefetch.main([*argv, "--precisions", "best"]) == 2
    assert "expected comma-separated numbers" in capsys.readouterr().err


def test_popular_wrong_ids_cost_fewer_copies_than_uniform_ones_and_bad_models_are_refused(tmp_path, capsys):
    """At recall 0.8 a top-k proposal's wrong fifth copies less when it names popular experts (often resident)."""
    out = {w: tmp_path / f"{w}.json" for w in ("uniform", "popular")}
    argv = ["--tokens", "200", "--layers", "3", "--families", "standard", "--recalls", "0.8", "--gates", "0"]
    for wrong, path in out.items():
        assert sim_prefetch.main([*argv, "--wrong", wrong, "--out", str(path)]) == 0
    rows = {w: [r for r in json.loads(p.read_text())["rows"] if r["recall"] == 0.8] for w, p in out.items()}
    for uniform, popular in zip(rows["uniform"], rows["popular"]):
        assert popular["prefetched_unused_per_token"] < uniform["prefetched_unused_per_token"]
    assert json.loads(out["popular"].read_text())["wrong"] == "popular"
    assert sim_prefetch.main([*argv, "--wrong", "near"]) == 2
    assert "--wrong takes one of uniform, popular, none" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform"])
def test_a_useless_predictor_stops_copying_after_its_first_rounds(family):
    """Recall 0: every proposed expert is wrong. The gate closes once its first copies are judged, and its closed
    rounds score their proposals without copying, so the copies of a long run are those of its first few tokens."""
    layers, tokens, k = 8, 256, 4
    trace = traces.named_trace(family, tokens, layers, 64, k, seed=3)
    pred = traces.predictions(trace, 0.0, None, 64, seed=3)
    got = sim_prefetch.simulate(trace, pred, 64, 16, "lfu-fast")
    assert 0 < got["prefetch_copies_per_token"] * tokens <= 3 * layers * k
    assert got["gate_closed"] > 0.95


@pytest.mark.parametrize(
    "family,recall,closes",
    [("standard", 0.6, True), ("topic-shift", 0.6, True), ("near-uniform", 0.8, False), ("standard", 1.0, False)],
)
def test_a_whole_round_gate_closes_where_most_copies_would_go_unused(family, recall, closes):
    """Without a budget the gate's threshold sat at a whole proposal's measured break-even (60: about half used): a
    top-k predictor at recall 0.6 on the skewed families copies mostly experts nobody needs, and is shut out; at
    recall 0.8 on near-uniform routing most of its (many) copies are used, and it stays open."""
    trace = traces.named_trace(family, 300, 4, 64, 4, seed=1)
    pred = traces.predictions(trace, recall, None, 64, seed=1)
    ungated = sim_prefetch.simulate(trace, pred, 64, 16, "lfu-fast", min_used_percent=0, budget=0)
    gated = sim_prefetch.simulate(trace, pred, 64, 16, "lfu-fast", min_used_percent=WHOLE_ROUND_GATE, budget=0)
    used_share = 1 - ungated["prefetched_unused_per_token"] / ungated["prefetch_copies_per_token"]
    assert (used_share < WHOLE_ROUND_GATE / 100) == closes
    assert (gated["gate_closed"] > 0.9) if closes else (gated["gate_closed"] < 0.05)


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_a_budget_caps_each_round(family):
    """Top-k proposals at recall 0.8, no gate: a budget of one copies at most one expert a round (two rounds a token
    over three layers), fewer than without a budget, and still takes some copies off the steps."""
    trace = traces.named_trace(family, 200, 3, 64, 4, seed=3)
    pred = traces.predictions(trace, 0.8, None, 64, seed=3)
    plain = sim_prefetch.simulate(trace, None, 64, 16, "lfu-duel")
    free, one = (sim_prefetch.simulate(trace, pred, 64, 16, "lfu-duel", min_used_percent=0, budget=b) for b in (0, 1))
    assert 0 < one["prefetch_copies_per_token"] <= 2 < free["prefetch_copies_per_token"]
    assert free["demand_copies_per_token"] < one["demand_copies_per_token"] < plain["demand_copies_per_token"]


@pytest.mark.parametrize("family", ["near-uniform", "topic-shift"])
def test_a_right_predictor_lifts_the_budget_and_a_sloppy_one_keeps_it(family):
    """Recall 1: lifted, the budget's rounds copy what unbounded ones do; recall 0.6: the budget holds (a round, two
    a token over three layers)."""
    trace = traces.named_trace(family, 200, 3, 64, 4, seed=3)
    right, sloppy = (traces.predictions(trace, r, None, 64, seed=3) for r in (1.0, 0.6))
    free = sim_prefetch.simulate(trace, right, 64, 16, "lfu-duel", min_used_percent=0, budget=0)
    lifted = sim_prefetch.simulate(trace, right, 64, 16, "lfu-duel", min_used_percent=0, budget=1)
    held = sim_prefetch.simulate(trace, right, 64, 16, "lfu-duel", min_used_percent=0, budget=1, lift=None)
    assert lifted["demand_copies_per_token"] < held["demand_copies_per_token"]
    assert lifted["prefetch_copies_per_token"] > 2 >= held["prefetch_copies_per_token"]
    assert abs(lifted["demand_copies_per_token"] - free["demand_copies_per_token"]) < 0.5
    capped = sim_prefetch.simulate(trace, sloppy, 64, 16, "lfu-duel", min_used_percent=0, budget=1)
    assert capped["prefetch_copies_per_token"] <= 2 + 8 / 200  # the first round, with no evidence, is whole


def test_budgets_are_cases_and_negative_ones_are_refused(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--tokens", "20", "--layers", "2", "--families", "standard", "--recalls", "0.8", "--gates", "0"]
    assert sim_prefetch.main([*argv, "--budgets", "0,1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["vram"], r["budget"]) for r in rows] == [(102, None), (102, 0), (102, 1), (32, None), (32, 0), (32, 1)]
    assert sim_prefetch.main([*argv, "--budgets", "-1"]) == 2
    assert "--budgets" in capsys.readouterr().err
    assert sim_prefetch.main([*argv, "--budgets", "1", "--lift", "120"]) == 2
    assert "--lift" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform"])
def test_proposals_further_ahead_that_repeat_the_next_layers_read_nothing_more(family):
    """Without a recall drop, the rows for l+2 .. l+4 are the later layers' next-layer proposals (as the pager replays
    them): they reach each table earlier but are the same ids, so where no gate closes the reads are depth 1's."""
    trace = traces.named_trace(family, 120, 6, 64, 4, seed=3)
    pred = traces.predictions(trace, 0.9, None, 64, seed=3)
    case = sim_prefetch.Case(family, 64, 4, 24, 0.9, None, MIN_USED_PERCENT)
    args = argparse.Namespace(ahead_depth=4, ahead_drop=0.0, seed=3, wrong="uniform")
    deeper = sim_prefetch.further_ahead(trace, pred, case, args)
    assert deeper.shape[0] == 3 and (deeper[0, :, :-2] == pred[:, 1:-1]).all()
    # budget 0: the RAM tier's (ram_tier.RamTier), whose rounds of reads ahead are not bounded
    one = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", budget=0)
    four = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", budget=0, deeper=deeper)
    assert four["copies_per_token"] == one["copies_per_token"]
    assert four["demand_copies_per_token"] == one["demand_copies_per_token"]


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_proposals_further_ahead_that_are_right_less_often_add_reads_never_used(family):
    """Worse proposals two to four layers ahead (no gate): each depth's wrong ids are reads of their own."""
    trace = traces.named_trace(family, 120, 6, 64, 4, seed=4)
    pred = traces.predictions(trace, 0.9, None, 64, seed=4)
    case = sim_prefetch.Case(family, 64, 4, 24, 0.9, None, 0)
    worse = sim_prefetch.further_ahead(
        trace, pred, case, argparse.Namespace(ahead_depth=4, ahead_drop=0.2, seed=4, wrong="uniform")
    )
    one = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", min_used_percent=0, budget=0)
    four = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", min_used_percent=0, budget=0, deeper=worse)
    assert four["prefetched_unused_per_token"] > one["prefetched_unused_per_token"] + 1.0
    assert four["copies_per_token"] > one["copies_per_token"]


@pytest.mark.parametrize("argv,message", [(["--ahead-depth", "0"], "--ahead-depth"), (["--ahead-drop", "2"], "drop")])
def test_a_depth_below_one_or_a_drop_outside_0_1_is_one_line(argv, message, capsys):
    assert sim_prefetch.main(["--tokens", "10", "--layers", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim_prefetch: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_a_gate_per_depth_keeps_the_next_layers_reads_where_one_gate_shuts_them(family):
    """Proposals 0.2 less right a layer further ahead, at the RAM tables' gate of 50: one gate for every depth closes
    most rounds and the reads a step waits for go back toward none ahead; a gate per depth keeps them near depth 1's."""
    trace = traces.named_trace(family, 150, 6, 64, 4, seed=5)
    pred = traces.predictions(trace, 1.0, None, 64, seed=5)
    case = sim_prefetch.Case(family, 64, 4, 24, 1.0, None, 50)
    worse = sim_prefetch.further_ahead(
        trace, pred, case, argparse.Namespace(ahead_depth=4, ahead_drop=0.2, seed=5, wrong="uniform")
    )
    run = {"min_used_percent": 50, "budget": 0}
    none = sim_prefetch.simulate(trace, None, 64, 24, "lfu-duel", **run)
    one = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", **run)
    shared = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", **run, deeper=worse, one_gate=True)
    apart = sim_prefetch.simulate(trace, pred, 64, 24, "lfu-duel", **run, deeper=worse)
    assert shared["demand_copies_per_token"] > one["demand_copies_per_token"] + 0.5 * (
        none["demand_copies_per_token"] - one["demand_copies_per_token"]
    )
    assert apart["demand_copies_per_token"] <= one["demand_copies_per_token"] * 1.1
