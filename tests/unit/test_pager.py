"""ExpertPager: VRAM slots fed from RAM (and a fake SSD), streamed chunks, stats, warm start."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_bench import moe_ref
from bigmoe_bench.streaming import chunk_count, chunks, stream_pairs
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager, PagerError
from bigmoe_pager.core.ram_tier import RamTier, RamTierError
from bigmoe_pager.core.stats import PagerStats

BLOCK = 32


class FakeSsdService:
    """A fake of the SSD tier's service (the real one reads files with O_DIRECT; tested by its own helper).

    Copies records from an in-memory array into the RAM tier's rows, synchronously, and counts reads.
    """

    def __init__(self, source: torch.Tensor, ram: RamTier) -> None:
        self.source, self.ram, self.reads = source, ram, 0

    def fetch(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        for e, s in zip(experts.tolist(), slots.tolist()):
            if e >= 0:
                self.ram.records[s].copy_(self.source[e])
                self.reads += 1


def make_layout(fp8: bool) -> ExpertLayout:
    if fp8:
        return ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=BLOCK)
    return ExpertLayout.for_moe(64, 32, torch.bfloat16)


def make_records(layout: ExpertLayout, experts: int, seed: int) -> torch.Tensor:
    """Experts with random weights (and positive scales) packed as records."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros((experts, layout.pitch), dtype=torch.uint8)
    for e in range(experts):
        parts = {}
        for c in layout.components:
            if c.dtype == torch.float32:
                parts[c.name] = torch.rand(c.shape, generator=g) * 0.05 + 0.01
            else:
                parts[c.name] = (torch.randn(c.shape, generator=g) * 0.5).to(c.dtype)
        layout.pack(parts, out[e])
    return out


def build(layout, records, vram, ram_slots, stats=None, work=0):
    experts = records.shape[0]
    ram = RamTier(layout, experts, ram_slots)
    ssd = None
    if ram.full:
        ram.fill_all(lambda e, dst: dst.copy_(records[e]))
    else:
        ssd = FakeSsdService(records, ram)
        ram.attach_ssd(ssd)
    pager = ExpertPager(layout, experts, vram, ram, stats=stats, work_slots=work)
    return pager, ssd


def assert_slots_hold_their_experts(pager: ExpertPager, records: torch.Tensor) -> None:
    for slot, expert in enumerate(pager.vram.slot_expert.tolist()):
        if expert < 0:
            continue
        for c in pager.layout.components:
            got = pager.buffers[c.name][slot].reshape(-1).view(torch.uint8)
            assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (slot, expert, c.name)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("experts,vram,ram_slots,k", [(24, 4, 24, 4), (24, 6, 10, 3), (16, 3, 3, 3)])
def test_every_needed_expert_lands_in_its_slot(fp8, experts, vram, ram_slots, k):
    layout = make_layout(fp8)
    records = make_records(layout, experts, seed=experts + vram)
    stats = PagerStats(1)
    pager, ssd = build(layout, records, vram, ram_slots, stats)
    rng = random.Random(7)
    for _ in range(60):
        ids = torch.tensor([rng.sample(range(experts), k)])
        remapped = pager.prepare(ids)
        held = pager.vram.slot_expert
        assert [int(held[s]) for s in remapped[0].tolist()] == ids[0].tolist()
        assert_slots_hold_their_experts(pager, records)
    snap = stats.snapshot()
    assert snap["vram"].lookups == 60 * k == snap["vram"].hits + snap["vram"].misses
    assert snap["vram"].bytes == snap["vram"].misses * layout.record_bytes
    assert snap["ram"].lookups == snap["vram"].misses
    if ssd is not None:
        assert snap["ram"].misses == ssd.reads == snap["ssd"].lookups
    else:
        assert snap["ram"].hits == snap["ram"].lookups


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize(
    "experts,vram,work,tokens,k", [(32, 6, 0, 16, 4), (32, 8, 3, 12, 4), (20, 4, 4, 5, 4), (12, 2, 1, 3, 2)]
)
def test_chunked_step_is_bit_identical_to_unchunked(fp8, experts, vram, work, tokens, k):
    layout = make_layout(fp8)
    block = BLOCK if fp8 else None
    records = make_records(layout, experts, seed=3)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[0, 0] = -1  # a pair with no expert
    weights = torch.rand((tokens, k), generator=g)
    x = torch.randn((tokens, 64), generator=g).to(torch.bfloat16)

    everything = layout.slot_buffers(experts, "cpu")
    for e in range(experts):
        for name, view in layout.views(records[e]).items():
            everything[name][e].copy_(view)
    want = moe_ref.moe(x, ids, weights, everything, block)

    pager, _ = build(layout, records, vram, ram_slots=experts, work=work)
    pager.prepare(torch.tensor([[1, 2]]))  # something already resident
    assert not pager.fits(ids)
    pairs, seen = None, torch.zeros_like(ids, dtype=torch.bool)
    for chunk in chunks(pager, ids):
        assert int((pager.vram.slot_expert >= 0).sum()) <= vram
        assert not (seen & chunk.mask).any()
        seen |= chunk.mask
        pairs = chunk.merge(pairs, moe_ref.pair_outputs(x, chunk.remapped, pager.buffers, block))
    assert torch.equal(seen, ids >= 0)
    got = moe_ref.combine(pairs, weights)
    assert torch.equal(got, want)
    again = stream_pairs(pager, ids, lambda remapped: moe_ref.pair_outputs(x, remapped, pager.buffers, block))
    assert torch.equal(moe_ref.combine(again, weights), want)


def test_chunk_count_bound_and_exact():
    layout = make_layout(False)
    pager, _ = build(layout, make_records(layout, 16, 0), 4, 16)
    ids = torch.tensor([[0, 1, 2], [2, 3, 4], [5, 0, 1]])
    assert chunk_count(pager, ids) == 3  # min(16, 9) ids / 4 slots
    assert chunk_count(pager, ids, sync=True) == 2  # 6 distinct experts
    assert len(list(chunks(pager, ids, sync=False))) == 3
    assert len(list(chunks(pager, ids))) == 2


def test_overflow_without_chunks_is_reported():
    layout = make_layout(False)
    pager, _ = build(layout, make_records(layout, 16, 0), 2, 16)
    got = pager.acquire(torch.tensor([[0, 1, 2]]))
    assert int(got.overflow) == 1 and int((got.remapped >= 0).sum()) == 2


def test_warm_places_the_hottest_experts():
    layout = make_layout(True)
    records = make_records(layout, 12, 1)
    stats = PagerStats(1)
    pager, ssd = build(layout, records, 3, 6, stats)
    pager.warm(torch.tensor([7, 3, 9, 1, 0, 11, 5]), read=lambda e, dst: dst.copy_(records[e]))
    assert pager.vram.slot_expert.tolist() == [7, 3, 9]
    assert sorted(e for e in pager.ram.table.slot_expert.tolist()) == [0, 1, 3, 7, 9, 11]
    assert_slots_hold_their_experts(pager, records)
    pager.prepare(torch.tensor([[7, 9, 11]]))
    snap = stats.snapshot()
    assert (snap["vram"].hits, snap["ram"].hits, ssd.reads) == (2, 1, 0)


def test_partial_ram_without_ssd_is_refused():
    layout = make_layout(False)
    ram = RamTier(layout, 16, 8)
    with pytest.raises(RamTierError, match="SSD"):
        ExpertPager(layout, 16, 4, ram)


def test_unfilled_full_ram_is_refused_at_the_first_step():
    layout = make_layout(False)
    pager = ExpertPager(layout, 16, 4, RamTier(layout, 16, 16))
    with pytest.raises(RamTierError, match="fill_all"):
        pager.prepare(torch.tensor([[1]]))


@pytest.mark.parametrize("vram,ram_slots,work", [(0, 16, 0), (17, 16, 0), (8, 4, 0), (4, 16, 5)])
def test_bad_sizes_are_refused(vram, ram_slots, work):
    layout = make_layout(False)
    ram = RamTier(layout, 16, max(1, min(ram_slots, 16)))
    ram.attach_ssd(FakeSsdService(torch.zeros((16, layout.pitch), dtype=torch.uint8), ram))
    with pytest.raises(PagerError):
        ExpertPager(layout, 16, vram, ram, work_slots=work)


@pytest.mark.parametrize("shape,dtype", [((3, 4096 + 64), torch.uint8), ((5, 7), torch.float32), ((0, 4), torch.uint8)])
def test_ram_records_are_page_aligned_and_exact(shape, dtype):
    from bigmoe_pager.core.pinned import PAGE, pinned_empty

    t = pinned_empty(shape, dtype)
    assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
    assert t.numel() == 0 or t.data_ptr() % PAGE == 0
    t.fill_(3)  # writable, the whole extent
    assert t.numel() == 0 or int(t.sum()) == 3 * t.numel()
