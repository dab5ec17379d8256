"""scripts/sim_live_depths.py: a trace's own proposals, one to D layers ahead, replayed through the RAM tier's
admit and gates; right proposals take reads off the demand path, wrong ones are gated back to none's reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sim_live_depths  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces

EXPERTS, LAYERS, K, TOKENS = 32, 5, 4, 120


def recorded(tmp_path: Path, family: str, recall: float, depths: int) -> Path:
    """A trace as an eager run with BIGMOE_SSD_READ_AHEAD_LAYERS=depths writes it, at a stated recall every depth."""
    topk = traces.named_trace(family, TOKENS, LAYERS, EXPERTS, K, 1)
    predicted = traces.predictions(topk, recall, None, EXPERTS, seed=1)
    deeper = traces.deeper_predictions(topk, [recall] * (depths - 1), None, EXPERTS, seed=1) if depths > 1 else None
    path = tmp_path / f"{family}-{recall}.npz"
    traces.save_trace(path, topk, predicted, deeper)
    return path


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_right_proposals_take_reads_off_the_demand_path_at_every_depth(tmp_path: Path, family):
    rows = sim_live_depths.rows(recorded(tmp_path, family, 1.0, 3), EXPERTS, 12, [1, 3])
    none, *ahead = rows
    assert (none["depth"], none["gates"]) == (0, None)
    assert [(r["depth"], r["gates"]) for r in ahead] == [(1, "one a depth"), (3, "one a depth"), (3, "one for all")]
    for r in ahead:
        assert r["demand_copies_per_token"] < 0.5 * none["demand_copies_per_token"]
        assert r["prefetched_unused_per_token"] < 0.2 * r["prefetch_copies_per_token"] + 0.1


def test_wrong_proposals_are_gated_back_to_about_nones_reads(tmp_path: Path):
    none, *ahead = sim_live_depths.rows(recorded(tmp_path, "standard", 0.0, 2), EXPERTS, 12, [1, 2])
    for r in ahead:
        assert r["gate_closed"] > 0.8
        assert r["copies_per_token"] < 1.25 * none["copies_per_token"]


def test_the_command_writes_rows_and_refuses_depths_the_trace_lacks(tmp_path: Path, capsys):
    path = recorded(tmp_path, "standard", 0.8, 2)
    out = tmp_path / "sim.json"
    assert sim_live_depths.main([str(path), "--experts", str(EXPERTS), "--depths", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["depth"] for r in report["rows"]] == [0, 2, 2] and report["rows"][0]["slots"] == 14  # 32 x 218/512
    capsys.readouterr()
    assert sim_live_depths.main([str(path), "--depths", "1,3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sim_live_depths: ") and "BIGMOE_SSD_READ_AHEAD_LAYERS=3" in err and "\n" not in err
