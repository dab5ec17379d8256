"""The fused prefetch round (admit + copy + counters in one launch, run by Triton's interpreter here) equals the
two-launch round (SlotTable.admit, then copy_records) round by round: what it admits, the table and gate state,
the counters and the slot bytes; and it serves exactly the rounds it says it fits."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core import prefetch_kernel
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.stats import PagerStats
from duel_testkit import shifting_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

LAYOUT = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
ADMITTED = ("experts", "slots", "evicted", "rows")
TABLE = ("expert_slot", "slot_expert", "last_use", "step", "use_count", "used_score", "wasted_score", "gate_closed")
SCRATCH = ("prefetched", "would_fetch", "prefetch_step")


def pager_pair(experts, slots, policy, programs, gate, budget, lift):
    """The same layer twice: fused rounds (and steps) on one, SlotTable.admit + copy_records on the other."""
    rec = torch.randint(0, 256, (experts, LAYOUT.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
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
            fused=fused,
            step_programs=3,
            prefetch_programs=programs,
            prefetch_gate=gate,
            prefetch_budget=budget,
            prefetch_one_launch=True,
        )
        pager.vram.lift_percent = lift
        for b in pager.buffers.values():
            b.view(b.shape[0], -1).view(torch.uint8).fill_(0xA5)
        made.append((pager, stats))
    return made


def proposal(rng: random.Random, truth: list[list[int]], experts: int, recall: float) -> torch.Tensor:
    """Each token's next ids with about `recall` of them right and the rest drawn at random; a -1 now and then."""
    rows = []
    for row in truth:
        guess = [e if e >= 0 and rng.random() < recall else rng.randrange(experts) for e in row]
        if rng.random() < 0.1:
            guess[rng.randrange(len(guess))] = -1
        rows.append(guess)
    return torch.tensor(rows, dtype=torch.int64)


def state(pager: ExpertPager) -> dict[str, torch.Tensor]:
    table = pager.vram
    got = {name: getattr(table, name) for name in TABLE}
    admit = table.admit_state()
    got.update({name: admit[name] for name in SCRATCH})
    got.update({name: b.view(b.shape[0], -1).view(torch.uint8) for name, b in pager.buffers.items()})
    return got


@pytest.mark.parametrize(
    "experts,slots,tokens,k,policy,programs,gate,budget,lift,recall",
    [
        (40, 10, 1, 8, "lru", 3, 25, 1, 90, 0.8),
        (40, 10, 1, 8, "lfu-duel", 16, 25, 1, 90, 0.8),  # the defaults
        (24, 6, 2, 4, "lfu-fast", 2, 0, 0, None, 0.9),  # gate always open, no budget: whole proposals
        (30, 8, 3, 4, "lfu-duel", 5, 60, 2, 90, 0.5),  # the gate shuts and opens
        (64, 16, 1, 10, "lfu", 1, 25, 3, 50, 1.0),  # one program does everything; the lift opens the budget
        (32, 12, 2, 4, "lru", 4, 25, 1, 90, 0.0),  # the idle path: nothing right, the gate stays shut
    ],
)
def test_fused_round_equals_admit_then_copy(experts, slots, tokens, k, policy, programs, gate, budget, lift, recall):
    rng = random.Random(experts * 13 + slots)
    (fused, fstats), (plain, pstats) = pager_pair(experts, slots, policy, programs, gate, budget, lift)
    copied = closed = 0
    truth = shifting_ids(rng, experts, tokens, k, 0)
    for step in range(120):
        guess = proposal(rng, truth, experts, recall)
        a, b = plain.prefetch(guess), fused.prefetch(guess)
        for field in ADMITTED:
            assert torch.equal(getattr(a, field), getattr(b, field)), (step, field)
        want, got = state(plain), state(fused)
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        assert int(fused.vram.admit_state()["prefetch_done"]) == 0  # the last program reset it for the next round
        copied += int((b.experts >= 0).sum())
        ids = torch.tensor(truth, dtype=torch.int32)
        a, b = plain.acquire(ids), fused.acquire(ids)
        assert torch.equal(a.remapped, b.remapped), step
        truth = shifting_ids(rng, experts, tokens, k, step + 1)
    closed = int(fused.vram.gate_closed)
    assert torch.equal(pstats.device_counts, fstats.device_counts)
    if recall >= 0.8:
        assert copied > 0  # rounds that copy were compared, not only empty ones
    if recall == 0.0:
        assert closed > 0


@pytest.mark.parametrize("programs,block_bytes", [(1, 512), (7, 256), (40, 1024)])
def test_every_block_of_every_chosen_expert_is_copied_whatever_the_grid(programs, block_bytes):
    """Programs fewer or more than an expert's blocks: each chosen expert lands whole, nothing else moves."""
    experts, slots = 12, 6
    rec = torch.randint(0, 256, (experts, LAYOUT.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    ram = RamTier(LAYOUT, experts, experts)
    ram.load_all(rec)
    pager = ExpertPager(
        LAYOUT, experts, slots, ram, fused=True, prefetch_gate=0, prefetch_budget=0, prefetch_one_launch=True
    )
    pager.warm_vram(torch.arange(slots - 3))
    before = {n: b.clone() for n, b in pager.buffers.items()}
    table = pager.vram
    out = prefetch_kernel.launch_prefetch(
        table.admit_state(),
        torch.tensor([7, 9, 11, -1]),
        experts,
        slots,
        4,
        ram.records,
        LAYOUT,
        pager.buffers,
        programs=programs,
        block_bytes=block_bytes,
    )
    chosen = {int(e): int(s) for e, s in zip(out["experts"], out["slots"]) if e >= 0}
    assert sorted(chosen) == [7, 9, 11]
    views = LAYOUT.rows_views(ram.records)
    for name, buf in pager.buffers.items():
        for slot in range(slots):
            expert = next((e for e, s in chosen.items() if s == slot), None)
            want = before[name][slot] if expert is None else views[name][expert]
            assert torch.equal(buf[slot].view(torch.uint8), want.view(torch.uint8)), (name, slot)


@pytest.mark.parametrize(
    "experts,slots,ids,ok",
    [
        (256, 102, 8, True),  # the benchmark's decode round
        (512, 200, 8, True),  # Flash-Next's shape, one token
        (512, 200, 64, False),  # [experts x ids] would not stay in registers
        (256, 102, 0, False),
        (256, 102, 65, False),
        (2048, 64, 8, True),
    ],
)
def test_fits_says_which_rounds_take_one_launch(experts, slots, ids, ok):
    assert prefetch_kernel.fits(experts, slots, ids, LAYOUT) is ok


def test_rounds_that_do_not_fit_take_two_launches_with_the_same_result():
    """A proposal wider than one launch takes (or a partial RAM tier) goes through admit + copy_records."""
    (fused, fstats), (plain, pstats) = pager_pair(40, 20, "lru", 3, 0, 0, None)
    guess = torch.arange(66) % 40  # 66 ids: more than a fused round takes
    assert not prefetch_kernel.fits(40, 20, guess.numel(), LAYOUT)
    a, b = plain.prefetch(guess), fused.prefetch(guess)
    for field in ADMITTED:
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(pstats.device_counts, fstats.device_counts)


def test_a_shape_that_does_not_fit_is_refused():
    (fused, _), _ = pager_pair(40, 10, "lru", 3, 0, 0, None)
    with pytest.raises(prefetch_kernel.PrefetchKernelError, match="fused prefetch takes"):
        prefetch_kernel.launch_prefetch(
            fused.vram.admit_state(),
            torch.arange(70) % 40,
            40,
            10,
            10,
            fused.ram.records,
            LAYOUT,
            fused.buffers,
            programs=2,
        )


@pytest.mark.parametrize("one_launch", [True, False])
def test_the_setting_picks_one_launch_or_two_for_a_device_layer(one_launch, monkeypatch):
    """BIGMOE_PREFETCH_ONE_LAUNCH reaches the layer's pager: its rounds take one launch only where it says so."""
    from bigmoe_pager.core import device_layer
    from bigmoe_pager.core.host_pager import TierSizes

    class KernelPager(ExpertPager):  # as on CUDA, where steps and rounds default to their kernels
        def __init__(self, *args, **kwargs):
            super().__init__(*args, fused=True, **kwargs)

    monkeypatch.setattr(device_layer, "ExpertPager", KernelPager)
    sizes = TierSizes(8, 4, 8)
    layer = device_layer.DeviceLayerPager(
        LAYOUT, sizes, "cpu", layer=0, stats=PagerStats(1), prefetch_one_launch=one_launch
    )
    views = layer.ram_views()
    for e in range(8):
        for c in LAYOUT.components:
            views[c.name][layer.ram_slot_for_load(e)].view(torch.uint8).fill_(e)
            layer.mark_loaded(e, c.name)
    layer.start(LAYOUT.slot_buffers(4, "cpu"))
    launches = []
    monkeypatch.setattr(prefetch_kernel, "launch_prefetch", lambda *a, **k: launches.append(1) or _none(4))
    layer.prefetch(torch.tensor([5, 6]))
    assert bool(launches) is one_launch


def _none(m: int) -> dict[str, torch.Tensor]:
    empty = torch.full((m,), -1, dtype=torch.int64)
    return {"experts": empty, "slots": empty, "evicted": empty, "rows": empty}
