"""scripts/sim_prefetch.py: prefetch replayed with the pager's own tables, per routing family."""

from __future__ import annotations

import json

import pytest
import sim_prefetch  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces


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


def test_the_script_writes_one_row_per_case_with_a_no_prefetch_baseline(tmp_path):
    out = tmp_path / "sim.json"
    argv = ["--tokens", "30", "--layers", "2", "--families", "standard", "--recalls", "0.8", "--precisions", "0.5"]
    assert sim_prefetch.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["vram"], r["recall"]) for r in rows] == [(102, None), (102, 0.8), (32, None), (32, 0.8)]
