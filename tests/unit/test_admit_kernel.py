"""The one-program Triton admit (run by Triton's interpreter here) equals SlotTable's torch admit bit for bit:
outputs, full table state and counters after every call, over acquire/admit rounds of trace-like routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.admit_kernel import SourceRows
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.slots import SlotTable
from bigmoe_pager.core.stats import PagerStats
from duel_testkit import duel_state, led_by_each, psel_side

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds


def state(table: SlotTable) -> dict[str, torch.Tensor]:
    """Every tensor of a table's decision state (not the write sinks nor the scratch areas: never read)."""
    return {
        "expert_slot": table.expert_slot,
        "slot_expert": table.slot_expert,
        "last_use": table.last_use,
        "step": table.step,
        "use_count": table.use_count,
        "prefetched": table.rounds[0].prefetched[: table.num_slots],
        "would_fetch": table.rounds[0].would_fetch[: table.num_experts],
        "prefetch_step": table.rounds[0].prefetch_step,
        "used_score": table.used_score,
        "wasted_score": table.wasted_score,
        "gate_closed": table.gate_closed,
        **duel_state(table),
    }


def routing(experts: int, k: int, rounds: int, seed: int, slide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Layer 1 of a 2-layer topic-shift trace ([rounds, k]) and layer 0's predictions of it ([rounds, P]). slide:
    its second half is a window of 2k experts moving by one every token instead (lfu-duel's lru shadow leads there)."""
    trace = traces.family_trace(traces.FAMILIES["topic-shift"], rounds, 2, experts, k, seed=seed)
    if slide:
        rng = np.random.default_rng(seed)
        for t in range(rounds // 2, rounds):
            trace[t] = (t + rng.choice(2 * k, size=k, replace=False)) % experts
    return trace[:, 1], traces.predictions(trace, 0.7, 0.6, experts, seed=seed)[:, 0]


def source_rows(rng: np.random.Generator, experts: int, rows: int) -> SourceRows:
    """A partial tier of `rows` records holding random experts, a fifth of its rows awaiting a posted read."""
    expert_row = np.full(experts, -1, dtype=np.int64)
    expert_row[rng.permutation(experts)[:rows]] = rng.permutation(rows)
    posted = np.where(rng.random(rows + 1) < 0.2, rng.integers(1, 99, rows + 1), 0)
    posted[rows] = 0  # the sink row
    return SourceRows(torch.from_numpy(expert_row), torch.from_numpy(posted))


def assert_same(ref: SlotTable, ker: SlotTable, rows: dict[str, torch.Tensor], what: str) -> None:
    want, got = state(ref), state(ker)
    for name in want:
        assert torch.equal(want[name], got[name]), (what, name)
    assert torch.equal(rows["ref"], rows["ker"]), (what, rows["ref"].tolist(), rows["ker"].tolist())


@pytest.mark.parametrize(
    "experts,slots,policy,masks,gate,rounds,budget,lift",
    [
        (256, 102, "lru", False, 10, 20, 0, None),
        (256, 102, "lfu-fast", True, 60, 20, 0, None),
        (256, 32, "lru", True, 0, 20, 0, None),
        (256, 32, "lfu", False, 40, 20, 0, None),
        (512, 35, "lfu-fast", False, 10, 20, 0, None),
        (512, 35, "lru", True, 40, 20, 0, None),
        (64, 16, "lfu", True, 10, 20, 0, None),
        (64, 16, "lru", False, 40, 20, 0, None),
        (64, 16, "lfu-duel", True, 40, 300, 0, None),  # past DUEL_SLOW_DECAY (256) steps: the slow counts halve too
        (256, 102, "lfu-duel", False, 0, 40, 1, None),  # budgets: the most used candidates (ties: lower id) only
        (256, 32, "lfu-fast", True, 40, 20, 2, None),
        (64, 16, "lru", False, 0, 20, 3, None),
        (256, 102, "lfu-duel", False, 25, 40, 1, 30),  # the budget lifted on the rounds whose scores reach 30%
        (64, 16, "lfu-fast", True, 10, 40, 1, 45),
    ],
)
def test_admit_kernel_matches_torch_over_rounds(experts, slots, policy, masks, gate, rounds, budget, lift):
    """masks: pass `available`, `keep_slots` (a RAM tier's rows with unconfirmed reads) and the rows of a
    partial RAM tier below (some holding unconfirmed reads). gate: min_used_percent; the strict ones close the gate
    on some rounds (which then only score their proposals) and reopen it on others. lfu-duel: admits rank by the
    counts its selectors name, each of the three leading some round (so admits under every ranking are compared).
    budget: prefetch_budget (0: none); lift: lift_percent (None: the budget always holds, and no admit fetches more;
    else some rounds are lifted and fetch more, some are not)."""
    k, rb = 8, 3 << 20
    rng = np.random.default_rng(experts * 7 + slots)
    ids, pred = routing(experts, k, 2 * rounds, seed=slots, slide=policy == "lfu-duel" and rounds >= 300)
    decay = 3 if policy == "lfu" else None
    opts = {"policy": policy, "decay": decay, "min_used_percent": gate, "prefetch_budget": budget, "lift_percent": lift}
    ref = SlotTable(experts, slots, use_kernel=False, **opts)
    ker = SlotTable(experts, slots, use_kernel=True, **opts)
    warm = torch.from_numpy(rng.permutation(experts)[:slots].copy())
    ref.place(warm), ker.place(warm)  # a full table from the start: admits evict
    rows = {name: torch.zeros(10, dtype=torch.int64) for name in ("ref", "ker")}
    admits = 0
    sides = set()
    sizes = []  # experts each admit fetched
    for t in range(rounds):
        tokens = slice(2 * t, 2 * t + 1 + t % 2)  # one or two tokens per step
        guess = torch.from_numpy(pred[tokens].astype(np.int64))  # what the layer before predicts for them
        if t % 3 == 1:
            guess[0, 0] = experts + 5  # an invalid prediction is ignored
        extra = {}
        if masks:
            extra["available"] = torch.from_numpy(rng.random(experts) < 0.7)
            extra["keep_slots"] = torch.from_numpy(rng.random(slots) < 0.25)
            extra["source"] = source_rows(rng, experts, rows=experts // 2)
        for _ in range(1 + (t % 4 == 2)):  # now and then a second admit with no step between (one round)
            admits += 1
            a = ref.admit(guess, stats_row=rows["ref"], record_bytes=rb, **extra)
            b = ker.admit(guess, stats_row=rows["ker"], record_bytes=rb, **extra)
            for field in ("experts", "slots", "evicted", "rows"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (t, field)
            fetched = int((a.experts >= 0).sum())
            if budget and lift is None:
                assert fetched <= budget
            sizes.append(fetched)
            assert_same(ref, ker, rows, f"admit {t}")
            guess = torch.roll(guess, 1)
        step = torch.from_numpy(ids[tokens].copy())
        for table, name in ((ref, "ref"), (ker, "ker")):
            table.acquire(step, rows[name], record_bytes=rb)
        assert_same(ref, ker, rows, f"acquire {t}")
        sides.add(psel_side(ref))
    installed, used, closed = int(rows["ref"][7]), int(rows["ref"][8]), int(ref.gate_closed)
    if gate == 0:  # no gate: many installs, some of them used
        assert closed == 0 and installed > rounds and used > 0
    if gate >= 40:  # the strict gates closed on some rounds and admitted on others: both paths compared
        assert 0 < closed < admits and installed > 0 and used > 0
    if budget and lift is not None:  # lifted rounds and budgeted ones both compared
        assert max(sizes) > budget and sizes.count(budget) > 0
    if ref.duel and rounds >= 300:
        assert led_by_each(sides)  # each leader ranked some step


@pytest.mark.parametrize("policy", ["lru", "lfu-fast", "lfu-duel"])
def test_admit_kernel_on_a_crowded_table(policy):
    """More predictions than slots, slots all kept or all recent: the capped and the empty decision agree too."""
    experts, slots = 64, 16
    ref = SlotTable(experts, slots, use_kernel=False, policy=policy, prefetch_budget=0)
    ker = SlotTable(experts, slots, use_kernel=True, policy=policy, prefetch_budget=0)
    rows = {name: torch.zeros(10, dtype=torch.int64) for name in ("ref", "ker")}
    many = torch.arange(40, 0, -1).reshape(2, 20)  # 2 tokens x 20 predictions, m = 16
    calls = [
        ("admit", {"predicted": many}),  # an empty table: the 16 lowest predicted ids fill it
        ("acquire", torch.arange(16).reshape(2, 8)),  # every slot used by the latest step
        ("admit", {"predicted": many + 20}),  # nothing may be evicted
        ("acquire", torch.tensor([[1, 2, 3, 40, 41, 42, 43, 44]])),
        ("admit", {"predicted": many + 3, "keep_slots": torch.ones(slots, dtype=torch.bool)}),  # all kept
        ("admit", {"predicted": torch.full((3,), -1)}),  # recall 0
        ("acquire", torch.tensor([[50, 51, -1, 52, 53, 54, 55, 56]])),
        ("admit", {"predicted": many + 7, "available": torch.zeros(experts, dtype=torch.bool)}),  # nothing in RAM
        ("admit", {"predicted": torch.tensor([60, 61, 62, 63, 1, 2])}),
    ]
    for i, (op, arg) in enumerate(calls):
        if op == "acquire":
            ref.acquire(arg, rows["ref"])
            ker.acquire(arg, rows["ker"])
        else:
            a = ref.admit(stats_row=rows["ref"], record_bytes=10, **arg)
            b = ker.admit(stats_row=rows["ker"], record_bytes=10, **arg)
            for field in ("experts", "slots", "evicted", "rows"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (i, field)
        assert_same(ref, ker, rows, f"call {i} ({op})")
    assert int(rows["ker"][7]) == 16 + 4  # the first admit filled the table, the last one four slots


class RowsFromRecords:
    """An SSD tier stand-in: fills record row `slots[i]` with expert `experts[i]`'s bytes at once."""

    def __init__(self, ram: RamTier, records: torch.Tensor) -> None:
        self.ram, self.records = ram, records

    def fetch(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        for e, s in zip(experts.tolist(), slots.tolist()):
            if e >= 0:
                self.ram.records[s].copy_(self.records[e])


@pytest.mark.parametrize("policy", ["lru", "lfu-fast", "lfu-duel"])
def test_pager_prefetch_over_a_partial_ram_tier_copies_the_same_rows_with_the_kernel(policy):
    """ExpertPager.prefetch with the kernel's decision (Admitted.rows from the RAM tier's SourceRows) leaves
    the same tables and the same slot bytes as with the torch decision; rows with a posted read are left out."""
    experts, vram, ram_rows, k = 32, 8, 16, 4
    layout = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
    records = torch.randint(
        0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    pagers = []
    for use_kernel in (False, True):
        ram = RamTier(layout, experts, ram_rows)
        ram.attach_ssd(RowsFromRecords(ram, records))
        pager = ExpertPager(layout, experts, vram, ram, policy=policy, stats=PagerStats(1))
        pager.vram.use_kernel = use_kernel
        pagers.append(pager)
    rng = np.random.default_rng(5)
    ids, pred = routing(experts, k, 24, seed=4)
    for t in range(24):
        posted = torch.from_numpy(np.where(rng.random(ram_rows) < 0.3, 9, 0))
        for p in pagers:
            p.ram.posted[:ram_rows].copy_(posted)  # unconfirmed reads: those rows must not be copied from
            p.prefetch(torch.from_numpy(pred[t].astype(np.int64)))
            p.ram.posted.zero_()
            p.acquire(torch.from_numpy(ids[t : t + 1].copy()))
        ref, ker = pagers
        assert_same(ref.vram, ker.vram, {"ref": ref._rows["vram"], "ker": ker._rows["vram"]}, f"round {t}")
        for slot, expert in enumerate(ker.vram.slot_expert.tolist()):
            if expert >= 0:
                for c in layout.components:
                    got = ker.buffers[c.name].view(vram, -1).view(torch.uint8)[slot]
                    assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (t, slot, c.name)
    assert int(ker._rows["vram"][7]) > 0  # the kernel's decision prefetched
