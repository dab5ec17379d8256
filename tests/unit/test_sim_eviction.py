"""The eviction simulator runs the pager's SlotTable: its lru agrees with traces.py's plain-Python LRU, and its
two-tier mode feeds the RAM table the VRAM misses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sim_eviction  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces


@pytest.mark.parametrize("family,slots", [("standard", 6), ("topic-shift", 10), ("near-uniform", 4)])
def test_simulated_lru_is_the_reference_lru(family, slots):
    trace = traces.named_trace(family, 150, 2, 32, 3, seed=1)
    got = sim_eviction.simulate(trace, 32, slots, 32, "lru")
    # traces.lru_hit_rate breaks ties between experts of one step by insertion order, SlotTable by id
    assert got["vram_hit"] == pytest.approx(traces.lru_hit_rate(trace, slots), abs=0.015)
    assert got["ram_hit"] == 1.0 and got["ssd_reads_per_token"] == 0


def test_two_tiers_count_ssd_reads_and_policies_differ():
    trace = traces.named_trace("standard", 200, 1, 32, 4, seed=2)
    two = sim_eviction.simulate(trace, 32, 5, 12, "lfu-fast")
    assert two["vram_hit"] < two["ram_hit"] < 1.0 and two["ssd_reads_per_token"] > 0
    lru, lfu = (sim_eviction.simulate(trace, 32, 5, 32, p)["vram_hit"] for p in ("lru", "lfu:4"))
    assert lru != lfu


def test_bad_policy_is_one_line_and_exit_2(capsys):
    assert sim_eviction.main(["--policies", "mru"]) == 2
    assert "mru" in capsys.readouterr().err
