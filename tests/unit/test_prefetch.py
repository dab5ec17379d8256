"""Next-layer prefetch (ExpertPager.prefetch / SlotTable.admit): it changes what is resident, never what a
step computes; it never evicts the latest step's experts; its counters add up; recall r removes about a
share r of the misses. The steps run the fused Triton step kernel in Triton's interpreter, as on a GPU."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.prediction import predict_next, recall, replayed_predictions
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.slots import SlotTable
from bigmoe_pager.core.stats import PagerStats

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

LAYOUT = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
WHOLE = {"prefetch_budget": 0}
"""Tests of a whole proposal's round (the budget has its own tests) run without the pager's default budget."""


def records(experts: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (experts, LAYOUT.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def make_pager(experts: int, slots: int, policy: str, rec: torch.Tensor, fused: bool = True, budget: dict = WHOLE):
    """budget: ExpertPager's prefetch_budget keyword (WHOLE: none; {}: the pager's default, lifted as it decides)."""
    ram = RamTier(LAYOUT, experts, experts)
    ram.load_all(rec)
    stats = PagerStats(1)
    pager = ExpertPager(
        LAYOUT, experts, slots, ram, stats=stats, policy=policy, decay=5, fused=fused, step_programs=3, **budget
    )
    pager.warm_vram(torch.arange(slots))
    return pager, stats


def expert_bytes(pager: ExpertPager, remapped: torch.Tensor) -> list[torch.Tensor]:
    """What the MoE kernel reads for each (token, k): the bytes of the slot its id maps to (empty for -1)."""
    out = []
    for slot in remapped.reshape(-1).tolist():
        out.append(
            torch.cat([b.view(b.shape[0], -1).view(torch.uint8)[slot] for b in pager.buffers.values()])
            if slot >= 0
            else torch.empty(0, dtype=torch.uint8)
        )
    return out


def check_consistent(pager: ExpertPager, rec: torch.Tensor) -> None:
    """Maps agree both ways and every resident expert's slot holds exactly its record's bytes."""
    table = pager.vram
    for slot, expert in enumerate(table.slot_expert.tolist()):
        if expert >= 0:
            assert int(table.expert_slot[expert]) == slot
            for c in LAYOUT.components:
                got = pager.buffers[c.name].view(table.num_slots, -1).view(torch.uint8)[slot]
                assert torch.equal(got, rec[expert, c.offset : c.offset + c.nbytes]), (slot, expert, c.name)
    assert int((table.expert_slot >= 0).sum()) == int((table.slot_expert >= 0).sum())


@pytest.mark.parametrize("budget", [WHOLE, {}], ids=["whole rounds", "the default budget"])
@pytest.mark.parametrize("experts,slots,k,policy", [(32, 10, 4, "lru"), (40, 12, 6, "lfu"), (24, 8, 2, "lru")])
def test_prefetch_changes_residency_never_what_a_step_reads(experts, slots, k, policy, budget):
    rng = random.Random(experts + slots)
    rec = records(experts, seed=experts)
    plain, _ = make_pager(experts, slots, policy, rec)
    eager, _ = make_pager(experts, slots, policy, rec, budget=budget)
    hot = rng.sample(range(experts), experts // 3)
    for step in range(16):
        ids = torch.tensor([rng.sample(hot if rng.random() < 0.7 else range(experts), k)], dtype=torch.int32)
        right = [e for e in ids[0].tolist() if rng.random() < 0.6]
        wrong = rng.sample(range(experts), 3)
        guess = torch.tensor((right + wrong + [-1] * 2 * k)[: 2 * k])
        eager.prefetch(guess)
        check_consistent(eager, rec)
        a, b = plain.prepare(ids), eager.prepare(ids)
        assert all(torch.equal(x, y) for x, y in zip(expert_bytes(plain, a), expert_bytes(eager, b))), step
        assert (b >= 0).all()
        check_consistent(eager, rec)


def test_no_prediction_leaves_the_pager_exactly_as_without_prefetch():
    rec = records(30, seed=3)
    plain, pstats = make_pager(30, 8, "lfu", rec)
    eager, estats = make_pager(30, 8, "lfu", rec)
    rng = random.Random(1)
    for _ in range(12):
        ids = torch.tensor([rng.sample(range(30), 4)])
        eager.prefetch(torch.full((6,), -1))
        a, b = plain.acquire(ids), eager.acquire(ids)
        assert torch.equal(a.remapped, b.remapped)
        for name in ("expert_slot", "slot_expert", "last_use", "step", "use_count"):
            assert torch.equal(getattr(plain.vram, name), getattr(eager.vram, name)), name
    assert torch.equal(pstats.device_counts, estats.device_counts)


def test_prefetch_never_evicts_the_latest_steps_or_predicted_experts():
    table = SlotTable(16, 4, **WHOLE)
    table.acquire(torch.tensor([0, 1, 2, 3]))
    table.acquire(torch.tensor([0, 1]))  # 2 and 3 are now cold, 0 and 1 were just used
    got = table.admit(torch.tensor([5, 6, 7, 0]))
    assert got.experts.tolist() == [5, 6, -1, -1]  # two slots only: 0 and 1 stay
    assert sorted(got.evicted.tolist()) == [-1, -1, 2, 3]
    assert sorted(table.slot_expert.tolist()) == [0, 1, 5, 6]
    again = table.admit(torch.tensor([9, 5, 6]))  # no step since: 5, 6 are predicted again, 0, 1 still latest
    assert again.experts.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize(
    "policy,budget,fetched",
    [
        ("lfu-fast", 0, [8, 9, 10, 11]),  # no budget: every candidate
        ("lfu-fast", 2, [9, 11]),  # the two most used (11: 3 uses, 9 and 10: 2, 8: 1): 9 beats 10 on the lower id
        ("lfu-fast", 1, [11]),
        ("lfu-duel", 2, [9, 11]),  # the leader's counts, the same here (nothing has decayed)
        ("lru", 2, [8, 9]),  # no counts: the lowest ids
    ],
)
def test_a_prefetch_budget_takes_the_most_used_candidates(policy, budget, fetched, use_kernel):
    table = SlotTable(
        16, 8, policy=policy, prefetch_budget=budget, use_kernel=use_kernel, min_used_percent=0, lift_percent=None
    )  # the budget never lifted (a first round, with no evidence yet, would be)
    for ids in ([8, 9, 10, 11], [9, 10, 11], [11]):  # uses: 8 once, 9 and 10 twice, 11 three times
        table.acquire(torch.tensor(ids))
    table.acquire(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))  # fills the 8 slots: 8-11 are out again
    table.acquire(torch.tensor([0, 1, 2, 3]))  # 4-7 are free to take now
    got = table.admit(torch.tensor([11, 10, 9, 8, 2]))  # 2 is resident: never a candidate, always kept
    assert sorted(e for e in got.experts.tolist() if e >= 0) == fetched
    assert table.expert_slot[2] >= 0


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("budget", [0, 2])
def test_the_order_of_a_proposal_is_never_read(budget, use_kernel):
    """A replayed trace's rows list their right ids first: a pager that read the order would prefetch better than
    any real predictor lets it. Every permutation of a proposal admits the same experts into the same slots."""
    results = set()
    for seed in range(4):
        table = SlotTable(
            32,
            8,
            policy="lfu-fast",
            prefetch_budget=budget,
            use_kernel=use_kernel,
            min_used_percent=0,
            lift_percent=None,
        )
        for ids in ([20, 21, 22, 23], [21, 22, 23], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3]):
            table.acquire(torch.tensor(ids))
        proposal = torch.tensor([23, 9, 21, 11, 20, 22, 2])[
            torch.randperm(7, generator=torch.Generator().manual_seed(seed))
        ]
        got = table.admit(proposal)
        results.add((tuple(got.experts.tolist()), tuple(got.slots.tolist()), tuple(table.slot_expert.tolist())))
    assert len(results) == 1


def test_prefetch_counters_add_up():
    experts, slots = 20, 6
    rec = records(experts, seed=5)
    pager, stats = make_pager(experts, slots, "lru", rec)
    pager.acquire(torch.tensor([[0, 1]]))
    pager.prefetch(torch.tensor([10, 11, 12]))  # 10 and 11 will be needed, 12 will not
    pager.acquire(torch.tensor([[10, 11]]))
    pager.prefetch(torch.tensor([-1, -1, -1]))  # settles the round before
    snap = stats.snapshot()["vram"]
    assert (snap.prefetched, snap.prefetch_used, snap.prefetch_wasted_bytes) == (3, 2, LAYOUT.record_bytes)
    assert snap.hits == 4 and snap.misses == 0  # 0, 1 were warm; both prefetched experts were hits
    assert snap.bytes == 3 * LAYOUT.record_bytes


def test_prefetch_takes_only_available_experts():
    """A partial RAM tier passes the experts it holds: the others are left to the step (and the SSD)."""
    table = SlotTable(16, 4, **WHOLE)
    table.acquire(torch.tensor([0]))
    available = torch.zeros(16, dtype=torch.bool)
    available[:8] = True
    got = table.admit(torch.tensor([6, 12, 7]), available)
    assert got.experts.tolist() == [6, 7, -1]
    assert set(table.slot_expert.tolist()) == {0, 6, 7, -1}


@pytest.mark.parametrize("r", [0.5, 0.8, 1.0])
def test_recall_r_removes_about_a_share_r_of_the_misses(r):
    """Replayed predictions at recall r (precision 1) for layer 1 of a 2-layer standard trace."""
    experts, slots, k, tokens = 64, 16, 4, 300
    trace = traces.family_trace(traces.FAMILIES["standard"], tokens, 2, experts, k, seed=2)
    predicted = torch.from_numpy(traces.predictions(trace, r, 1.0, experts, seed=3))
    rec = records(experts, seed=7)
    misses = {}
    for with_prefetch in (False, True):
        pager, stats = make_pager(experts, slots, "lru", rec, fused=False)
        for t in range(tokens):
            if with_prefetch:
                pager.prefetch(replayed_predictions(predicted, torch.tensor(t), 0, 1))
            pager.acquire(torch.from_numpy(trace[t : t + 1, 1]))
        misses[with_prefetch] = stats.snapshot()["vram"].misses
    assert misses[True] / misses[False] == pytest.approx(1 - r, abs=0.08)


def test_predictions_have_the_stated_recall_and_precision():
    trace = traces.family_trace(traces.FAMILIES["topic-shift"], 200, 3, 64, 8, seed=1)
    pred = traces.predictions(trace, 0.8, 0.5, 64, seed=1)
    assert pred.shape[:2] == (200, 3) and (pred[:, 2] == -1).all()
    got = torch.from_numpy(pred[:, :2].reshape(-1, pred.shape[2]))
    truth = torch.from_numpy(trace[:, 1:].reshape(-1, 8))
    assert recall(got, truth) == pytest.approx(0.8, abs=0.02)
    proposed = int((got >= 0).sum())
    assert proposed * 0.5 == pytest.approx(0.8 * truth.numel(), rel=0.05)  # precision 0.5


def test_live_predictor_is_the_next_routers_top_p():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 32, generator=gen), torch.randn(16, 32, generator=gen)
    got = predict_next(hidden, weight, 4)
    probs = torch.softmax(hidden @ weight.t(), dim=-1)
    assert torch.equal(got, torch.topk(probs, 4).indices)
    # A router that routes on what layer l's state carries predicts perfectly at P = k.
    assert recall(predict_next(hidden, weight, 4), torch.topk(hidden @ weight.t(), 4).indices) == 1.0
    assert predict_next(hidden, weight, 99).shape == (5, 16)


def test_replayed_predictions_wrap_like_route_replay():
    pred = torch.arange(3 * 2 * 2, dtype=torch.int32).reshape(3, 2, 2)
    got = replayed_predictions(pred, torch.tensor([2]), 1, 2)
    assert got.tolist() == [pred[2, 1].tolist(), pred[0, 1].tolist()] and got.dtype == torch.int64
    assert np.array_equal(got.numpy(), np.stack([pred[2, 1].numpy(), pred[0, 1].numpy()]))


def test_replayed_predictions_are_the_next_layers_rows_just_replayed(tmp_path):
    trace = traces.named_trace("standard", 6, 3, 16, 2)
    pred = traces.predictions(trace, 1.0, 1.0, 16)
    traces.save_trace(tmp_path / "p.npz", trace, pred)
    from bigmoe_pager.core.prediction import ReplayedPredictions

    replay = ReplayedPredictions.for_trace(tmp_path / "p.npz", torch.device("cpu"))
    cursor = torch.zeros(8, dtype=torch.int64)
    cursor[1] = 5  # layer 1 has just replayed rows 3 and 4
    rows = replay.rows(1, 2, cursor)
    assert rows.tolist() == pred[3:5, 1].reshape(-1).tolist()
    assert sorted(e for e in rows.tolist() if e >= 0) == sorted(trace[3:5, 2].reshape(-1).tolist())
    traces.save_trace(tmp_path / "plain.npz", trace)
    assert ReplayedPredictions.for_trace(tmp_path / "plain.npz", torch.device("cpu")).rows(1, 2, cursor) is None


@pytest.mark.parametrize("with_ahead", [True, False], ids=["its-own-rows", "next-layer-rows"])
def test_a_proposal_further_ahead_is_its_own_row_where_the_trace_has_one(tmp_path, with_ahead):
    """Layer 0 just replayed rows 2 and 3: a caller three layers ahead gets layer 0's proposals for layer 3 where
    the trace carries them (depths 2 and 3 here), else layer 2's next-layer rows; four ahead (beyond what the trace
    carries) always the latter."""
    from bigmoe_pager.core.prediction import ReplayedPredictions

    trace = traces.named_trace("topic-shift", 8, 5, 16, 2)
    pred = traces.predictions(trace, 1.0, None, 16)
    deeper = traces.deeper_predictions(trace, [0.5, 0.5], None, 16) if with_ahead else None
    traces.save_trace(tmp_path / "p.npz", trace, pred, deeper)
    replay = ReplayedPredictions.for_trace(tmp_path / "p.npz", torch.device("cpu"))
    cursor = torch.zeros(8, dtype=torch.int64)
    cursor[0] = 4
    want = deeper[1, 2:4, 0] if with_ahead else pred[2:4, 2]
    assert replay.rows(0, 2, cursor, ahead=3).tolist() == want.reshape(-1).tolist()
    assert replay.rows(0, 2, cursor, ahead=4).tolist() == pred[2:4, 3].reshape(-1).tolist()
    assert replay.rows(0, 2, cursor, ahead=1).tolist() == pred[2:4, 0].reshape(-1).tolist()
