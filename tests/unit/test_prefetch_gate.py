"""The prefetch gate of SlotTable.admit (issue 15: prefetch must never cost more than it saves).

A top-k predictor at recall 0 proposes k wrong experts a token: the gate closes after the first round and
copies nothing after that; at recall 1 it never closes; a predictor that turns useful reopens it within a few
rounds, because a closed round still scores its proposal (would-fetch marks, judged by the next step) without copying;
min_used_percent=0 admits every round as before the gate. Each runs with the torch reference and with the Triton
kernel (in Triton's interpreter), which must decide the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.slots import READ_AHEAD_MIN_USED_PERCENT, SlotTable, SlotTableError
from bigmoe_pager.core.stats import PREFETCH_WASTED_BYTES, PREFETCHED

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
    """A whole proposal a round (no budget: the gate judges every copy a round makes), the gate's default unless
    `gate` names one."""
    return SlotTable(EXPERTS, SLOTS, use_kernel=use_kernel, policy=policy, **{"prefetch_budget": 0, **gate})


CASES = [(False, "lru"), (False, "lfu-fast"), (True, "lru"), (True, "lfu-fast")]
"""(use_kernel, policy)."""


@pytest.mark.parametrize("use_kernel,policy", CASES)
@pytest.mark.parametrize("seed", [0, 3])
def test_all_wrong_proposals_copy_only_in_the_first_round(use_kernel, policy, seed):
    ids, pred = routing(80, 0.0, seed=seed)
    t0 = table(use_kernel, policy)
    got = play(t0, ids, pred)
    admitting = [t for t, (n, _) in enumerate(got) if n]
    assert admitting == [0]  # the first round admits (no evidence yet), then nothing is copied
    assert sum(absent for _, absent in got[1:]) > 40  # (though every later round had absent experts to copy)
    assert int(t0.gate_closed) == 79


@pytest.mark.parametrize("use_kernel,policy", CASES)
def test_all_right_proposals_admit_every_round(use_kernel, policy):
    ids, pred = routing(40, 1.0, seed=1)
    t0 = table(use_kernel, policy)
    got = play(t0, ids, pred)
    assert all(n == absent for n, absent in got)  # every absent predicted expert is copied in
    assert sum(n for n, _ in got) > len(got) and int(t0.gate_closed) == 0  # near-uniform: misses every round


@pytest.mark.parametrize("use_kernel,policy", CASES)
@pytest.mark.parametrize("switch", [20, 37])
def test_a_predictor_that_turns_useful_reopens_the_gate_within_a_few_rounds(use_kernel, policy, switch):
    """Recall 0, then recall 1 from round `switch` on: no copy until then, every absent expert copied soon after."""
    rounds = switch + 30
    ids, wrong = routing(rounds, 0.0, seed=3)
    _, right = routing(rounds, 1.0, seed=3)
    got = play(table(use_kernel, policy), ids, np.concatenate([wrong[:switch], right[switch:]]))
    assert all(n == 0 for n, _ in got[1:switch])
    reopened = 1 + max(t for t in range(switch, rounds) if got[t][1] and not got[t][0])  # last closed round + 1
    assert reopened <= switch + 12  # the closed rounds' right proposals were scored, no explore period to wait for
    assert all(n == absent for n, absent in got[reopened:])  # and from then on every round admits


@pytest.mark.parametrize("use_kernel,policy", CASES)
def test_scoring_a_closed_round_moves_the_gate_but_not_the_prefetch_counters(use_kernel, policy):
    """Shadow judgments are evidence for the gate only: prefetch_used and wasted bytes count real copies."""
    ids, pred = routing(30, 0.0, seed=9)
    t0 = table(use_kernel, policy)
    row = torch.zeros(10, dtype=torch.int64)
    for t in range(30):
        t0.admit(torch.from_numpy(pred[t].astype(np.int64)), stats_row=row, record_bytes=3)
        t0.acquire(torch.from_numpy(ids[t : t + 1].copy()))
    first = int((pred[0] >= 0).sum())
    assert int(row[PREFETCHED]) <= first and int(row[PREFETCH_WASTED_BYTES]) <= 3 * first
    assert int(t0.wasted_score) > 64 * K  # still scored every round: the decayed score holds several rounds' worth


@pytest.mark.parametrize("use_kernel,policy", [(False, "lru"), (True, "lfu-fast")])
@pytest.mark.parametrize("recall", [0.0, 0.5])
def test_min_used_percent_zero_admits_every_round(use_kernel, policy, recall):
    ids, pred = routing(40, recall, seed=7)
    t0 = table(use_kernel, policy, min_used_percent=0)
    got = play(t0, ids, pred)
    assert all(n == absent for n, absent in got) and sum(n for n, _ in got) > 40
    assert int(t0.gate_closed) == 0 and int(t0.wasted_score) > 0  # scored, never closed


@pytest.mark.parametrize("use_kernel,policy", CASES)
@pytest.mark.parametrize("recall,lifted", [(1.0, True), (0.5, False)])
def test_the_budget_is_lifted_only_for_a_predictor_that_is_nearly_always_right(use_kernel, policy, recall, lifted):
    """The pager's defaults (a budget of one, lifted at LIFT_PERCENT used): past the first rounds a predictor that is
    always right copies every absent expert it names, one that is right half the time at most one a round."""
    ids, pred = routing(40, recall, seed=11)
    t0 = SlotTable(EXPERTS, SLOTS, use_kernel=use_kernel, policy=policy, min_used_percent=0)
    got = play(t0, ids, pred)[4:]
    if lifted:
        assert all(n == absent for n, absent in got) and any(n > 1 for n, _ in got)
    else:
        assert all(n <= 1 for n, _ in got) and any(absent > 1 for _, absent in got)


@pytest.mark.parametrize(
    "gate,error",
    [
        ({"min_used_percent": -1}, "prefetch gate"),
        ({"min_used_percent": 101}, "prefetch gate"),
        ({"lift_percent": 101}, "lift"),
        ({"lift_percent": -5}, "lift"),
    ],
)
def test_gate_settings_out_of_range_are_refused(gate, error):
    with pytest.raises(SlotTableError, match=error):
        table(False, "lru", **gate)


def play_two_depths(table: SlotTable, ids: np.ndarray, near: np.ndarray, far: np.ndarray) -> list[int]:
    """Per round: the far proposal admitted at depth 2, then the near one at depth 1, then the step they predicted;
    returns the experts the near admit copied each round."""
    out = []
    for t in range(len(ids)):
        table.admit(torch.from_numpy(far[t].astype(np.int64)), depth=2)
        got = table.admit(torch.from_numpy(near[t].astype(np.int64)), depth=1)
        out.append(int((got.experts >= 0).sum()))
        table.acquire(torch.from_numpy(ids[t : t + 1].copy()))
    return out


@pytest.mark.parametrize("use_kernel,policy", CASES)
def test_each_depths_rounds_are_shut_by_their_own_evidence(use_kernel, policy):
    """Right proposals for the next layer (depth 1) and wrong ones made further ahead (depth 2) for the same step, at
    the RAM tables' gate: with a gate per depth the far one closes and the near one keeps copying; with one gate for
    both (gates=1, as before session 67), the wrong copies outnumber the right ones and shut the near proposals out."""
    ids, near = routing(60, 1.0, seed=5)
    rng = np.random.default_rng(6)  # 2K ids a round, none of them the step's
    far = np.stack([rng.choice(np.setdiff1d(np.arange(EXPERTS), row), 2 * K, replace=False) for row in ids])
    gate = {"min_used_percent": READ_AHEAD_MIN_USED_PERCENT}
    apart = table(use_kernel, policy, gates=2, **gate)
    copied = play_two_depths(apart, ids, near, far)
    assert not apart.gate_is_open(depth=2) and apart.gate_is_open(depth=1)
    assert int(apart.round_state(2).gate_closed) >= 55 and int(apart.round_state(1).gate_closed) == 0
    assert sum(copied[5:]) > 40  # near-uniform routing: the next layer's proposals keep finding absent experts
    shared = table(use_kernel, policy, **gate)
    assert sum(play_two_depths(shared, ids, near, far)[5:]) < sum(copied[5:]) / 4
    assert not shared.gate_is_open(depth=1)


@pytest.mark.parametrize("gates", [0, -1])
def test_a_table_keeps_at_least_one_round(gates):
    with pytest.raises(SlotTableError, match="at least one prefetch round"):
        SlotTable(EXPERTS, SLOTS, gates=gates)
