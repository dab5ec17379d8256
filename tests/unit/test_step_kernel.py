"""The fused decode step (acquire + copy + stats in one launch, run by Triton's interpreter here)
equals the two-launch path step by step: outputs, table state, counters and slot bytes."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_bench.streaming import chunks
from bigmoe_pager.core import step_kernel
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier, RamTierError
from bigmoe_pager.core.slots import SlotTable
from bigmoe_pager.core.stats import PagerStats
from duel_testkit import duel_state, led_by_each, psel_side, shifting_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

LAYOUT = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
ACQUIRED = (
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
)
STATE = ("expert_slot", "slot_expert", "last_use", "step", "use_count")


def records(experts: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (experts, LAYOUT.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def pager_pair(experts: int, slots: int, policy: str, programs: int, rec: torch.Tensor):
    """The same layer twice: the fused launch and the two-launch path (torch decision, torch copy)."""
    made = []
    for fused in (True, False):
        ram = RamTier(LAYOUT, experts, experts)
        ram.load_all(rec)
        stats = PagerStats(1)
        pager = ExpertPager(
            LAYOUT,
            experts,
            slots,
            ram,
            stats=stats,
            policy=policy,
            decay=None if policy in ("lfu-fast", "lfu-duel") else 5,
            fused=fused,
            step_programs=programs,
        )
        for b in pager.buffers.values():
            b.view(b.shape[0], -1).view(torch.uint8).fill_(0xA5)
        made.append((pager, stats))
    return made


def step_ids(rng: random.Random, experts: int, tokens: int, k: int, hot: list[int]) -> torch.Tensor:
    """Routing with hot experts, -1 pairs, duplicates inside a token and now and then an invalid id."""
    rows = []
    for _ in range(tokens):
        row = rng.sample(hot if rng.random() < 0.6 else range(experts), k)
        if rng.random() < 0.15:
            row[rng.randrange(k)] = -1
        if rng.random() < 0.15 and k > 1:
            row[0] = row[1]
        if rng.random() < 0.08:
            row[-1] = rng.choice([experts, experts + 7, -3])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def slot_bytes(pager: ExpertPager) -> dict[str, torch.Tensor]:
    return {n: b.view(b.shape[0], -1).view(torch.uint8) for n, b in pager.buffers.items()}


@pytest.mark.parametrize(
    "experts,slots,tokens,k,policy,programs,steps",
    [
        (40, 10, 1, 8, "lru", 3, 14),
        (24, 6, 2, 4, "lru", 1, 14),
        (30, 5, 3, 4, "lfu", 5, 14),
        (64, 16, 1, 10, "lfu", 3, 14),
        (30, 5, 3, 4, "lfu-fast", 3, 14),
        (64, 16, 2, 4, "lfu-duel", 3, 300),  # past DUEL_SLOW_DECAY (256) steps: the slow counts halve once too
        (40, 8, 3, 4, "lfu-duel", 2, 300),  # a fifth of its steps need more experts than slots
    ],
)
def test_fused_step_equals_two_launch_path(experts, slots, tokens, k, policy, programs, steps):
    """lfu-duel runs on routing whose stretches favour its slow counts, its fast ones and recency alone in turn: each
    must lead some step (so every ranking, the shadows and the selectors' moves by the last program are compared)."""
    rng = random.Random(experts * 7 + slots)
    rec = records(experts, seed=experts)
    (fused, fstats), (plain, pstats) = pager_pair(experts, slots, policy, programs, rec)
    hot = rng.sample(range(experts), max(k, experts // 4))
    loads, sides = 0, set()
    for step in range(steps):
        if plain.vram.duel:
            ids = torch.tensor(shifting_ids(rng, experts, tokens, k, step), dtype=torch.int32)
        else:
            ids = step_ids(rng, experts, tokens, k, hot)
        a, b = plain.acquire(ids), fused.acquire(ids)
        for field in ACQUIRED:
            assert torch.equal(getattr(a, field), getattr(b, field)), (step, field)
        for field in STATE:
            assert torch.equal(getattr(plain.vram, field), getattr(fused.vram, field)), (step, field)
        want, got = duel_state(plain.vram), duel_state(fused.vram)
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        sides.add(psel_side(plain.vram))
        want, got = slot_bytes(plain), slot_bytes(fused)
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        assert int(fused.vram.kernel_state()["done"]) == 0  # the last program reset it for the next step
        loads += int(b.loaded)
    assert torch.equal(pstats.device_counts, fstats.device_counts)
    assert loads > 0 and fstats.snapshot()["vram"].hits > 0
    if plain.vram.duel:
        assert led_by_each(sides)  # each leader ranked some step


@pytest.mark.parametrize("programs,block_bytes", [(2, 512), (7, 256), (40, 1024)])
def test_every_block_of_every_miss_is_copied_whatever_the_grid(programs, block_bytes):
    """Programs fewer or more than a miss's blocks: each (miss, block) unit is copied once, nothing else is touched."""
    experts, slots = 12, 5
    rec = records(experts, seed=1)
    table = SlotTable(experts, slots)
    buffers = LAYOUT.slot_buffers(slots, "cpu")
    for b in buffers.values():
        b.view(slots, -1).view(torch.uint8).fill_(0x5A)
    ids = torch.tensor([[3, 9, 3, 11]])
    out = step_kernel.launch_step(
        table.kernel_state(), ids, experts, slots, 4, rec, LAYOUT, buffers, programs=programs, block_bytes=block_bytes
    )
    assert out["miss_experts"].tolist() == [3, 9, 11, -1] and out["miss_slots"].tolist() == [0, 1, 2, -1]
    assert out["remapped"].tolist() == [[0, 1, 0, 2]]
    for c in LAYOUT.components:
        flat = buffers[c.name].view(slots, -1).view(torch.uint8)
        for slot, expert in ((0, 3), (1, 9), (2, 11)):
            assert torch.equal(flat[slot], rec[expert, c.offset : c.offset + c.nbytes]), (c.name, slot)
        assert (flat[3:] == 0x5A).all()
    assert table.slot_expert.tolist() == [3, 9, 11, -1, -1] and int(table.step) == 1


def test_a_step_that_needs_more_experts_than_slots_fills_what_fits():
    (fused, _), (plain, _) = pager_pair(16, 4, "lru", 3, records(16, seed=2))
    for pager in (fused, plain):
        pager.prepare(torch.tensor([[9, 10]]))
    ids = torch.tensor([[0, 1, 2], [3, 9, 4]])
    a, b = plain.acquire(ids), fused.acquire(ids)
    assert int(b.overflow) == 2 and int(b.loaded) == 3
    for field in ACQUIRED:
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert sorted(fused.vram.slot_expert.tolist()) == [0, 1, 2, 9]


@pytest.mark.parametrize(
    "experts,slots,ids,layout,lfu,ok",
    [
        (256, 102, 8, LAYOUT, False, True),
        (512, 205, 10, LAYOUT, True, True),
        (512, 205, 64, LAYOUT, False, True),
        (512, 205, 64, LAYOUT, True, False),  # experts x ids beyond MAX_CELLS: two launches
        (256, 102, 65, LAYOUT, False, False),  # a prefill-sized step
        (256, 102, 0, LAYOUT, False, False),
        (64, 16, 8, ExpertLayout.build([(f"p{i}", (33,), torch.uint8) for i in range(5)]), False, False),
    ],
)
def test_fits_says_which_steps_take_one_launch(experts, slots, ids, layout, lfu, ok):
    assert step_kernel.fits(experts, slots, ids, layout, lfu) is ok


def test_a_shape_that_does_not_fit_is_refused():
    table = SlotTable(16, 4)
    buffers = LAYOUT.slot_buffers(4, "cpu")
    with pytest.raises(step_kernel.StepKernelError, match="ids"):
        step_kernel.launch_step(
            table.kernel_state(),
            torch.zeros(65, dtype=torch.int64),
            16,
            4,
            4,
            records(16, 0),
            LAYOUT,
            buffers,
            programs=2,
        )
    with pytest.raises(step_kernel.StepKernelError, match="program"):
        step_kernel.launch_step(
            table.kernel_state(),
            torch.zeros(4, dtype=torch.int64),
            16,
            4,
            4,
            records(16, 0),
            LAYOUT,
            buffers,
            programs=0,
        )


def test_large_steps_fall_back_to_two_launches_with_the_same_result():
    """80 ids (beyond MAX_IDS) on a fused pager: streamed in chunks through the two-launch path, same decisions."""
    (fused, _), (plain, _) = pager_pair(32, 8, "lru", 3, records(32, seed=4))
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(20)])
    for pager in (fused, plain):
        pager.prepare(ids[:2])  # fused launch: 8 ids
    got = [c.remapped for c in chunks(fused, ids)]
    want = [c.remapped for c in chunks(plain, ids)]
    assert len(got) == len(want) > 1 and all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(fused.vram.slot_expert, plain.vram.slot_expert)


def test_an_unfilled_ram_tier_is_refused_on_the_fused_path():
    pager = ExpertPager(LAYOUT, 16, 4, RamTier(LAYOUT, 16, 16), fused=True)
    with pytest.raises(RamTierError, match="fill_all"):
        pager.prepare(torch.tensor([[1, 2]]))


def test_each_step_variant_keeps_the_first_compiled_kernels_registers_and_local_memory(monkeypatch):
    """core.step_kernel.COMPILED, which benchmark rows carry: a variant's first loaded kernel counts, a launch that
    returns no loaded kernel (Triton's interpreter) adds nothing."""
    from bigmoe_pager.core import step_kernel as sk
    from bigmoe_pager.core.prefetch_chain import PrefetchChain

    monkeypatch.setattr(sk, "COMPILED", {})
    chain = PrefetchChain(layers=3, device="cpu")
    variants = [sk.step_variant(s) for s in (None, chain.signal(0, True), chain.signal(1, False, joinless=True))]
    assert variants == ["plain", "chained", "joinless"]
    sk.note_compiled("joinless", type("Loaded", (), {"n_regs": 80, "n_spills": 8})())
    sk.note_compiled("joinless", type("Later", (), {"n_regs": 96, "n_spills": 0})())
    sk.note_compiled("plain", None)
    assert sk.COMPILED == {"joinless": {"registers": 80, "local_bytes": 8}}
