"""The prefetch gate of SlotTable.admit (issue 15: prefetch must never cost more than it saves).

A top-k predictor at recall 0 proposes k wrong experts a token: the gate closes after the first round and
only its explore rounds copy; at recall 1 it never closes; a predictor that turns useful reopens it through
an explore round; min_used_percent=0 admits every round as before the gate. Each runs with the torch
reference and with the Triton kernel (in Triton's interpreter), which must decide the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.slots import SlotTable, SlotTableError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

EXPERTS, SLOTS, K = 64, 16, 4


def routing(rounds: int, recall: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer 1 of a 2-layer near-uniform trace ([rounds, K]) and a top-k predictor's proposals for it ([rounds, K])."""
    trace = traces.family_trace(traces.FAMILIES["near-uniform"], rounds, 2, EXPERTS, K, seed=seed)
    return trace[:, 1], traces.predictions(trace, recall, None, EXPERTS, seed=seed)[:, 0]


def play(table: SlotTable, ids: np.ndarray, pred: np.ndarray) -> list[tuple[int, int]]:
    """Per round (admit, then the step it predicted): (experts admitted, predicted experts not resident before)."""
    out = []
    for t in range(len(ids)):
        guess = torch.from_numpy(pred[t].astype(np.int64))
        absent = int((table.expert_slot[guess.clamp(min=0)] < 0).logical_and(guess >= 0).sum())
        got = table.admit(guess)
        out.append((int((got.experts >= 0).sum()), absent))
        table.acquire(torch.from_numpy(ids[t : t + 1].copy()))
    return out


def table(use_kernel: bool, policy: str, **gate) -> SlotTable:
    return SlotTable(EXPERTS, SLOTS, use_kernel=use_kernel, policy=policy, **gate)


CASES = [(False, "lru", 16), (False, "lfu-fast", 8), (True, "lru", 8), (True, "lfu-fast", 16)]
"""(use_kernel, policy, explore_every)."""


@pytest.mark.parametrize("use_kernel,policy,explore", CASES)
@pytest.mark.parametrize("phase", [0, 3])
def test_all_wrong_proposals_admit_only_on_explore_rounds(use_kernel, policy, explore, phase):
    """phase: the table's explore_phase (a layer's index), which moves its explore rounds to other steps."""
    rounds = 5 * explore
    ids, pred = routing(rounds, 0.0, seed=explore)
    got = play(table(use_kernel, policy, explore_every=explore, explore_phase=phase), ids, pred)
    admitting = [t for t, (n, _) in enumerate(got) if n]
    assert admitting[0] == 0  # the first round admits (no evidence yet)
    assert all((t + phase) % explore == 0 for t in admitting[1:])  # then only its explore rounds
    assert len(admitting) >= 4  # and the explore rounds do copy (their proposals are not resident)


@pytest.mark.parametrize("use_kernel,policy,explore", CASES)
def test_all_right_proposals_admit_every_round(use_kernel, policy, explore):
    ids, pred = routing(3 * explore, 1.0, seed=explore + 1)
    t0 = table(use_kernel, policy, explore_every=explore)
    got = play(t0, ids, pred)
    assert all(n == absent for n, absent in got)  # every absent predicted expert is copied in
    assert sum(n for n, _ in got) > len(got) and int(t0.gate_closed) == 0  # near-uniform: misses every round


@pytest.mark.parametrize("use_kernel,policy,explore", CASES)
def test_a_predictor_that_turns_useful_reopens_the_gate_through_an_explore_round(use_kernel, policy, explore):
    switch, rounds = 4 * explore + explore // 2, 10 * explore  # recall 0, then recall 1 from mid-period on
    ids, wrong = routing(rounds, 0.0, seed=3)
    _, right = routing(rounds, 1.0, seed=3)
    got = play(table(use_kernel, policy, explore_every=explore), ids, np.concatenate([wrong[:switch], right[switch:]]))
    first_explore = (switch // explore + 1) * explore
    assert all(got[t] == (0, got[t][1]) for t in range(switch, first_explore))  # closed until an explore round
    assert sum(absent for _, absent in got[switch:first_explore]) > 0  # (there were copies to refuse)
    reopened = 1 + max(t for t in range(switch, rounds) if got[t][1] and not got[t][0])  # last closed round + 1
    assert first_explore <= reopened < switch + 4 * explore  # reopened by explore rounds, within 4 periods
    assert all(n == absent for n, absent in got[reopened:])  # and from then on every round admits


@pytest.mark.parametrize("use_kernel,policy", [(False, "lru"), (True, "lfu-fast")])
@pytest.mark.parametrize("recall", [0.0, 0.5])
def test_min_used_percent_zero_admits_every_round(use_kernel, policy, recall):
    ids, pred = routing(40, recall, seed=7)
    t0 = table(use_kernel, policy, min_used_percent=0, explore_every=64)
    got = play(t0, ids, pred)
    assert all(n == absent for n, absent in got) and sum(n for n, _ in got) > 40
    assert int(t0.gate_closed) == 0 and int(t0.wasted_score) > 0  # scored, never closed


@pytest.mark.parametrize("gate", [{"min_used_percent": -1}, {"min_used_percent": 101}, {"explore_every": 0}])
def test_gate_settings_out_of_range_are_refused(gate):
    with pytest.raises(SlotTableError, match="prefetch gate"):
        table(False, "lru", **gate)


def _state(t: SlotTable, row: torch.Tensor) -> list:
    """What a prefetch round may change and anything after it can observe: maps, stamps, counts, gate, counters."""
    parts = [t.expert_slot, t.slot_expert, t.last_use, t.use_count, t.used_score, t.wasted_score, t.gate_closed, row]
    return [p.clone() for p in parts]


@pytest.mark.parametrize("use_kernel,policy,explore", CASES)
@pytest.mark.parametrize("recalls", [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0), (0.0, 1.0)])
def test_skipping_the_rounds_prefetch_wanted_rules_out_changes_nothing(use_kernel, policy, explore, recalls):
    """A CUDA graph with skip_closed runs admit only where prefetch_wanted() says so; the tables must end each round
    exactly as admitting every round leaves them (recalls: the predictor's before and after mid-run)."""
    rounds = 6 * explore
    ids, first = routing(rounds, recalls[0], seed=11)
    _, second = routing(rounds, recalls[1], seed=11)
    pred = np.concatenate([first[: rounds // 2], second[rounds // 2 :]])
    every, gated = table(use_kernel, policy, explore_every=explore), table(use_kernel, policy, explore_every=explore)
    rows = [torch.zeros(10, dtype=torch.int64) for _ in range(2)]
    skipped = 0
    for t in range(rounds):
        guess = torch.from_numpy(pred[t].astype(np.int64))
        got = every.admit(guess, stats_row=rows[0], record_bytes=3)
        if bool(gated.prefetch_wanted()):
            gated.admit(guess, stats_row=rows[1], record_bytes=3)
        else:
            skipped += 1
            assert int((got.experts >= 0).sum()) == 0  # a round it rules out would have copied nothing
        step = torch.from_numpy(ids[t : t + 1].copy())
        every.acquire(step)
        gated.acquire(step)
        for a, b in zip(_state(every, rows[0]), _state(gated, rows[1])):
            assert torch.equal(a, b), t
    if recalls == (0.0, 0.0):
        assert skipped >= rounds // 2  # a useless predictor's rounds are mostly skipped
    if recalls == (1.0, 1.0):
        assert skipped == 0


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_look_without_counting_leaves_the_gate_count(use_kernel):
    t0 = table(use_kernel, "lru", explore_every=64)
    ids, pred = routing(8, 0.0, seed=5)
    play(t0, ids, pred)  # the gate closes after the first round
    closed = int(t0.gate_closed)
    assert not bool(t0.prefetch_wanted(count=False)) and int(t0.gate_closed) == closed
    assert not bool(t0.prefetch_wanted()) and int(t0.gate_closed) == closed + 1
