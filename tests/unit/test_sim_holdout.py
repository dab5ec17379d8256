"""The held-out check of the eviction default: families drawn from a stated box, and the default no worse than lru on
routing it was not chosen on, including routing that shifts faster than its fast counts forget."""

from __future__ import annotations

import json

import pytest
import sim_eviction  # scripts/ is on pytest's pythonpath (pyproject)
import sim_holdout
from bigmoe_bench import traces

FAST_SHIFTS = traces.Family(alpha=1.3, keep=0.09, shift_every=17, shift_share=0.78, corr=0.4)
"""A drawn family (seed 2026's holdout-29) where lru beat the two-shadow lfu-duel by 0.019 of VRAM hit at 32 slots."""
SLIDING = traces.Family(alpha=1.75, keep=0.15, shift_every=12, shift_share=0.34, corr=0.06)
"""Another (holdout-27): lru 0.7733 against the two-shadow duel's 0.7626 at 32 slots."""


@pytest.mark.parametrize(
    "family,experts,k,slots",
    [
        (FAST_SHIFTS, 256, 8, 32),
        (SLIDING, 256, 8, 32),
        (SLIDING, 512, 10, 35),
        (traces.FAMILIES["standard"], 256, 8, 32),
        (traces.FAMILIES["topic-shift"], 256, 8, 32),
    ],
)
def test_the_default_is_no_worse_than_lru(family, experts, k, slots):
    trace = traces.family_trace(family, 900, 1, experts, k, seed=5)
    rate = {p: sim_eviction.simulate(trace, experts, slots, experts, p)["vram_hit"] for p in ("lru", "lfu-duel")}
    assert rate["lfu-duel"] >= rate["lru"] - sim_holdout.TIE


def test_draws_are_seeded_inside_the_box_and_never_a_committed_trace_seed():
    first, again, other = (sim_holdout.draw_families(30, s) for s in (11, 11, 12))
    assert first == again and first != other
    for family, trace_seed in first:
        assert sim_holdout.ALPHA[0] <= family.alpha <= sim_holdout.ALPHA[1]
        assert sim_holdout.KEEP[0] <= family.keep <= sim_holdout.KEEP[1]
        assert sim_holdout.CORR[0] <= family.corr <= sim_holdout.CORR[1]
        if family.shift_every:
            assert sim_holdout.SHIFT_EVERY[0] <= family.shift_every <= sim_holdout.SHIFT_EVERY[1]
            assert sim_holdout.SHIFT_SHARE[0] <= family.shift_share <= sim_holdout.SHIFT_SHARE[1]
        assert trace_seed != 0
    stationary = sum(f.shift_every == 0 for f, _ in first)
    assert 0 < stationary < len(first)  # both kinds drawn


def rows_for(hits: list[tuple[float, float]]) -> list[dict]:
    """Result rows of one shape: (lru, lfu-duel) VRAM hits per family."""
    return [
        {"family": f"holdout-{i}", "shape": "s", "lru": {"vram_hit": lru}, "lfu-duel": {"vram_hit": duel}}
        for i, (lru, duel) in enumerate(hits)
    ]


def test_summary_counts_losses_beyond_a_tie_and_names_the_worst_family():
    rows = rows_for([(0.80, 0.81), (0.70, 0.699), (0.60, 0.59), (0.50, 0.52)])
    got = sim_holdout.summary(rows, ("lru", "lfu-duel"), tie=0.002)["lfu-duel"]["s"]
    assert got["families"] == 4 and got["losses_to_lru"] == 1  # 0.001 below is a tie, 0.01 below a loss
    assert got["worst_vs_lru"] == pytest.approx(-0.01) and got["worst_vs_lru_family"] == "holdout-2"
    assert got["mean_vs_lru"] == pytest.approx((0.01 - 0.001 - 0.01 + 0.02) / 4, abs=1e-4)
    assert got["worst_vs_best"] == pytest.approx(-0.01)


def test_a_small_run_writes_every_policy_for_every_family_and_shape(tmp_path, capsys):
    out = tmp_path / "h.json"
    argv = ["--families", "2", "--tokens", "120", "--layers", "1", "--workers", "1", "--out", str(out)]
    assert sim_holdout.main([*argv, "--policies", "lru,lfu-duel"]) == 0
    result = json.loads(out.read_text())
    assert len(result["results"]) == 2 * len(sim_holdout.SHAPES)
    for row in result["results"]:
        assert set(row["params"]) == {"alpha", "keep", "shift_every", "shift_share", "corr"}
        assert 0 <= row["lru"]["vram_hit"] <= row["lru"]["ram_hit"] <= 1
    assert set(result["summary"]) == {"lfu-duel"} and "| lfu-duel |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,words",
    [(["--policies", "lfu,lfu-duel"], "lru"), (["--policies", "mru,lru"], "mru"), (["--families", "0"], "at least")],
)
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert sim_holdout.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
