"""scripts/sim_belady.py: Belady's farthest-next-use rule as the offline ceiling of eviction. It evicts what the
classic example says it must, and no policy of the pager beats it on any routing family."""

from __future__ import annotations

import numpy as np
import pytest
import sim_belady  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces
from sim_eviction import simulate


def test_it_evicts_the_expert_used_farthest_ahead():
    # two slots, one id a step: 1 2 3 1 2 -> at 3 it evicts 2 (used at step 4, after 1 at step 3): 1 then hits
    trace = np.array([[1], [2], [3], [1], [2]])
    assert sim_belady.belady(trace, experts=4, slots=2) == (5, 1)
    # LRU evicts 1 at step 2 and misses every step
    assert simulate(trace[:, None, :], 4, 2, 4, "lru")["vram_hit"] == 0.0


def test_a_step_s_own_experts_are_never_evicted_and_invalid_ids_are_not_looked_up():
    trace = np.array([[0, 1, -1], [2, 3, 3], [0, 1, 9]])  # 9 >= experts: not looked up, as the pager counts it
    lookups, hits = sim_belady.belady(trace, experts=4, slots=4)
    assert (lookups, hits) == (6, 2)


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform"])
@pytest.mark.parametrize("slots", [12, 24])
def test_no_policy_of_the_pager_beats_it(family, slots):
    trace = traces.named_trace(family, 160, 2, 64, 4, 0)
    ceiling = sim_belady.reference(trace, 64, slots)["vram_hit"]
    for policy in ("lru", "lfu", "lfu-fast", "lfu-duel"):
        assert simulate(trace, 64, slots, 64, policy)["vram_hit"] <= ceiling, policy


def test_bad_families_get_one_line_and_exit_2(capsys):
    assert sim_belady.main(["--families", "nope"]) == 2
    assert "unknown family" in capsys.readouterr().err
