"""SlotTable.acquire against a plain-Python LRU, step by step."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.slots import SlotTable, SlotTableError
from duel_testkit import duel_state, led_by_each, psel_side, shifting_ids


class PyPolicy:
    """The policies in plain Python: dict expert -> last-use step; evict min (step, expert) under
    lru, min (use count, step, expert) under lfu, counts halved every `decay` steps."""

    def __init__(self, experts: int, slots: int, policy: str = "lru", decay: int = 0) -> None:
        self.experts, self.slots, self.policy, self.decay = experts, slots, policy, decay
        self.last: dict[int, int] = {}
        self.count = [0] * experts
        self.step = 0

    def rank(self, e: int) -> tuple[int, ...]:
        if self.policy != "lru":
            return (min(self.count[e], 1023), self.last[e], e)
        return (self.last[e], e)

    def acquire(self, ids: list[int]) -> tuple[int, int, set[int], int]:
        self.step += 1
        need = sorted({i for i in ids if 0 <= i < self.experts})
        if self.policy != "lru":
            if self.decay and self.step % self.decay == 0:
                self.count = [c >> 1 for c in self.count]
            for e in need:
                self.count[e] += 1
        hits = [e for e in need if e in self.last]
        misses = [e for e in need if e not in self.last]
        free = self.slots - len(self.last)
        victims = sorted((*self.rank(e)[:-1], e) for e in self.last if e not in need)
        loaded = 0
        for e in misses:
            if free > 0:
                free -= 1
            elif victims:
                old = victims.pop(0)[-1]
                del self.last[old]
            else:
                continue
            self.last[e] = 0
            loaded += 1
        for e in need:
            if e in self.last:
                self.last[e] = self.step
        return len(hits), len(misses), set(self.last), loaded


def _check_consistent(table: SlotTable) -> None:
    es, se = table.expert_slot.tolist(), table.slot_expert.tolist()
    for slot, expert in enumerate(se):
        if expert >= 0:
            assert es[expert] == slot
    for expert, slot in enumerate(es):
        if slot >= 0:
            assert se[slot] == expert


def _random_step(rng: random.Random, experts: int, tokens: int, k: int, hot: list[int]) -> list[list[int]]:
    rows = []
    for _ in range(tokens):
        pool = hot if rng.random() < 0.7 else list(range(experts))
        row = rng.sample(pool, min(k, len(pool)))
        row += [-1] * (k - len(row))
        if rng.random() < 0.1:
            row[rng.randrange(k)] = -1
        if rng.random() < 0.1 and k > 1:
            row[0] = row[1]  # duplicate inside a token
        rows.append(row)
    return rows


@pytest.mark.parametrize(
    "experts,slots,k,tokens,policy",
    [
        (16, 4, 4, 1, "lru"),
        (16, 4, 4, 3, "lru"),
        (64, 8, 8, 1, "lru"),
        (256, 32, 8, 1, "lru"),
        (40, 10, 6, 4, "lru"),
        (8, 8, 2, 2, "lru"),
        (64, 8, 8, 1, "lfu"),
        (40, 10, 6, 4, "lfu"),
        (16, 4, 4, 3, "lfu"),
        (64, 8, 8, 1, "lfu-fast"),
        (40, 10, 6, 4, "lfu-fast"),
    ],
)
def test_acquire_matches_python_policy(experts, slots, k, tokens, policy):
    rng = random.Random(experts * 1000 + slots * 10 + k)
    decay = {"lru": 0, "lfu": 16, "lfu-fast": 16}[policy]  # lfu-fast: its own default period
    table = SlotTable(experts, slots, policy=policy, decay=None if policy == "lfu-fast" else decay)
    ref = PyPolicy(experts, slots, policy, decay)
    hot = rng.sample(range(experts), max(k, experts // 4))
    for _ in range(700):
        rows = _random_step(rng, experts, tokens, k, hot)
        ids = torch.tensor(rows, dtype=torch.int32)
        got = table.acquire(ids)
        hits, misses, contents, loaded = ref.acquire([i for r in rows for i in r])
        assert (int(got.hits), int(got.misses), int(got.loaded)) == (hits, misses, loaded)
        assert {e for e in table.slot_expert.tolist() if e >= 0} == contents
        _check_remap(table, ids, got.remapped)
    _check_consistent(table)


def _check_remap(table: SlotTable, ids: torch.Tensor, remapped: torch.Tensor) -> None:
    assert remapped.shape == ids.shape and remapped.dtype == ids.dtype
    held = table.slot_expert
    for i, r in zip(ids.reshape(-1).tolist(), remapped.reshape(-1).tolist()):
        if i < 0 or i >= table.num_experts:
            assert r == -1
        elif r >= 0:
            assert int(held[r]) == i
        else:
            assert int(table.expert_slot[i]) == -1  # only an overflowed expert may stay out


def test_slots_equal_top_k_loads_exactly_the_step():
    table = SlotTable(32, 4)
    for step in range(50):
        ids = torch.tensor([[(step * 4 + j) % 32 for j in range(4)]])
        got = table.acquire(ids)
        assert int(got.overflow) == 0
        assert sorted(table.slot_expert.tolist()) == sorted(ids[0].tolist())
        _check_remap(table, ids, got.remapped)


def test_miss_list_names_slots_and_evictions():
    table = SlotTable(10, 3)
    table.acquire(torch.tensor([0, 1, 2]))
    table.acquire(torch.tensor([1, 2, -1]))
    got = table.acquire(torch.tensor([5, 2, 7]))
    assert int(got.misses) == 2 and int(got.hits) == 1 and int(got.overflow) == 0
    # 0 is least recently used, then 1: misses 5 and 7 take their slots in that order.
    assert got.miss_experts.tolist() == [5, 7, -1]
    assert got.evicted.tolist() == [0, 1, -1]
    assert got.miss_slots.tolist()[:2] == [0, 1]
    assert got.remapped.tolist() == [0, 2, 1]


def test_duplicates_and_minus_one_are_single_lookups():
    table = SlotTable(8, 4)
    got = table.acquire(torch.tensor([[3, 3, -1], [3, -1, -1]]))
    assert (int(got.lookups), int(got.misses), int(got.loaded)) == (1, 1, 1)
    slot = int(table.expert_slot[3])
    assert got.remapped.tolist() == [[slot, slot, -1], [slot, -1, -1]]


def test_all_minus_one_changes_nothing_but_the_step():
    table = SlotTable(8, 4)
    table.acquire(torch.tensor([1, 2]))
    before = table.slot_expert.clone(), table.last_use.clone()
    got = table.acquire(torch.full((3, 2), -1))
    assert (int(got.lookups), int(got.loaded)) == (0, 0)
    assert (got.miss_experts == -1).all() and (got.remapped == -1).all()
    assert torch.equal(table.slot_expert, before[0]) and torch.equal(table.last_use, before[1])


def test_overflow_is_reported_and_fills_what_fits():
    table = SlotTable(16, 4)
    table.acquire(torch.tensor([9, 10]))
    got = table.acquire(torch.tensor([[0, 1, 2], [3, 9, 4]]))
    assert int(got.lookups) == 6 and int(got.overflow) == 2
    assert int(got.hits) == 1 and int(got.misses) == 5 and int(got.loaded) == 3
    # Needed 9 stays; 10 is evicted; the lowest misses 0, 1, 2 fill the three other slots.
    assert sorted(table.slot_expert.tolist()) == [0, 1, 2, 9]
    assert got.remapped[1, 0] == -1 and got.remapped[1, 2] == -1
    _check_remap(table, torch.tensor([[0, 1, 2], [3, 9, 4]]), got.remapped)


def test_invalid_ids_are_counted_and_never_mapped():
    table = SlotTable(8, 4)
    got = table.acquire(torch.tensor([2, 8, -5, 100]))
    assert int(got.invalid) == 3 and int(got.lookups) == 1
    assert got.remapped.tolist()[1:] == [-1, -1, -1]


def test_place_warms_an_empty_table():
    table = SlotTable(8, 4)
    slots = table.place(torch.tensor([5, 1]))
    assert slots.tolist() == [0, 1] and table.expert_slot[5] == 0 and table.expert_slot[1] == 1
    got = table.acquire(torch.tensor([1, 6, 7, 0]))
    assert int(got.hits) == 1 and int(got.loaded) == 3
    with pytest.raises(SlotTableError):
        table.place(torch.tensor([2]))


def test_lfu_keeps_the_frequent_expert_that_lru_drops():
    steps = [[0, 1], [0, 2], [0, 3], [4, 5], [6, 7]]
    kept = {}
    for policy in ("lru", "lfu"):
        table = SlotTable(16, 3, policy=policy)
        for ids in steps:
            table.acquire(torch.tensor(ids))
        kept[policy] = set(table.slot_expert.tolist())
    assert 0 not in kept["lru"] and 0 in kept["lfu"]


@pytest.mark.parametrize(
    "experts,slots,policy", [(0, 1, "lru"), (4, 0, "lru"), (4, 5, "lru"), (8, 4, "mru"), (2000, 4, "lfu")]
)
def test_bad_sizes_are_refused(experts, slots, policy):
    with pytest.raises(SlotTableError):
        SlotTable(experts, slots, policy=policy)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds
@pytest.mark.parametrize(
    "experts,slots,k,tokens,steps,policy",
    [
        (16, 4, 4, 3, 25, "lru"),
        (40, 10, 6, 2, 20, "lru"),
        (300, 24, 8, 1, 12, "lru"),
        (40, 10, 6, 2, 20, "lfu"),
        (40, 10, 6, 2, 36, "lfu-fast"),
        (64, 16, 6, 2, 300, "lfu-duel"),  # past DUEL_SLOW_DECAY (256): the slow counts halve once too
        (64, 16, 8, 1, 300, "lfu-duel"),
        (32, 6, 3, 3, 300, "lfu-duel"),  # a third of its steps need more experts than slots: shadows overflow too
    ],
)
def test_kernel_matches_torch_decision(experts, slots, k, tokens, steps, policy):
    """The one-program Triton acquire (run by Triton's interpreter here) equals the torch ops, output and state.
    lfu-duel runs on routing whose stretches favour the slow counts, the fast ones and recency alone in turn (each
    must lead some step, so every ranking and the moves of both selectors are compared)."""
    rng = random.Random(experts + slots)
    decay = None if policy in ("lfu-fast", "lfu-duel") else 8  # their own period (16), crossed twice in 36 steps
    ref = SlotTable(experts, slots, use_kernel=False, policy=policy, decay=decay)
    ker = SlotTable(experts, slots, use_kernel=True, policy=policy, decay=decay)
    rows = {name: torch.zeros(7, dtype=torch.int64) for name in ("ref", "ker", "ref_aux", "ker_aux")}
    hot = rng.sample(range(experts), max(k, experts // 4))
    sides = set()
    for step in range(steps):
        if ref.duel:
            ids = torch.tensor(shifting_ids(rng, experts, tokens, k, step), dtype=torch.int64)
        else:
            ids = torch.tensor(_random_step(rng, experts, tokens, k, hot), dtype=torch.int64)
        if rng.random() < 0.1:
            ids[0, 0] = experts + 3  # an invalid id
        a = ref.acquire(ids, rows["ref"], rows["ref_aux"], record_bytes=100)
        b = ker.acquire(ids, rows["ker"], rows["ker_aux"], record_bytes=100)
        for field in (
            "remapped",
            "miss_experts",
            "miss_slots",
            "evicted",
            "lookups",
            "hits",
            "misses",
            "loaded",
            "overflow",
            "invalid",
        ):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        for state in ("expert_slot", "slot_expert", "last_use", "step", "use_count"):
            assert torch.equal(getattr(ref, state), getattr(ker, state)), state
        want, got = duel_state(ref), duel_state(ker)
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        sides.add(psel_side(ref))
    assert torch.equal(rows["ref"], rows["ker"]) and torch.equal(rows["ref_aux"], rows["ker_aux"])
    assert int(rows["ref"][0]) > 0
    if ref.duel:
        assert led_by_each(sides)  # each leader ranked some step
