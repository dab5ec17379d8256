"""HostPager: the host-driven pager used inside vLLM's CPU build.

Every step must leave, in the slot each id is remapped to, exactly that expert's
bytes; LRU decisions must match a plain reference; SSD failures must surface.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch
from bigmoe_pager.core.host_pager import HostPager, PagerError, TierSizes
from bigmoe_pager.core.layout import ExpertLayout


def make_experts(layout: ExpertLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.pitch), dtype=torch.uint8, generator=g)


class ArraySource:
    """An in-memory SSD source (a fake: the real one reads files; tested in its own module)."""

    def __init__(self, records: torch.Tensor, fail: set[int] = frozenset()):
        self.records, self.fail, self.reads = records, fail, 0

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        self.reads += 1
        if expert in self.fail:
            raise OSError(5, "Input/output error")
        dst[: self.records.shape[1]].copy_(self.records[expert])


def loaded_pager(layout, records, sizes, source):
    pager = HostPager(layout, sizes, source)
    for e in range(sizes.experts):
        slot = pager.ram_slot_for_load(e)
        if slot is not None:
            pager.ram[slot].copy_(records[e])
            for c in layout.components:
                pager.mark_loaded(e, c.name)
    return pager


LAYOUT = ExpertLayout.for_moe(hidden=64, intermediate=32, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "experts,vram,ram,k", [(16, 4, 16, 2), (16, 4, 8, 4), (32, 10, 12, 3), (8, 8, 8, 8), (24, 3, 3, 3)]
)
def test_every_step_leaves_the_right_bytes_and_matches_reference_lru(experts, vram, ram, k):
    records = make_experts(LAYOUT, experts, seed=experts * 31 + vram)
    source = ArraySource(records) if ram < experts else None
    pager = loaded_pager(LAYOUT, records, TierSizes(experts, vram, ram), source)
    slots = torch.zeros((vram, LAYOUT.pitch), dtype=torch.uint8)

    def install(slot, views):
        for c in LAYOUT.components:
            slots[slot, c.offset : c.offset + c.nbytes].copy_(views[c.name].reshape(-1).view(torch.uint8))

    ref = OrderedDict()  # reference VRAM LRU: expert -> None
    rng = random.Random(7)
    for step in range(400):
        tokens = rng.randint(1, 3)
        ids = [[rng.randrange(experts) for _ in range(k)] for _ in range(tokens)]
        if rng.random() < 0.1:
            ids[0][0] = -1
        topk = torch.tensor(ids)
        for rows in pager.token_chunks(topk):
            part = topk[rows]
            needed = list(dict.fromkeys(e for e in part.flatten().tolist() if e >= 0))
            expected_hits = sum(1 for e in needed if e in ref)
            hits_before = pager.stats["vram"].hits
            remapped = pager.prepare(part, install)
            assert pager.stats["vram"].hits - hits_before == expected_hits
            for e in needed:
                ref.pop(e, None)
                ref[e] = None
            while len(ref) > vram:
                ref.popitem(last=False)
            assert set(pager.vram_of) == set(ref)
            for e, s in zip(part.flatten().tolist(), remapped.flatten().tolist()):
                if e < 0:
                    assert s == -1
                    continue
                assert torch.equal(slots[s, : LAYOUT.record_bytes], records[e, : LAYOUT.record_bytes])
    c = pager.stats
    assert c["vram"].lookups == c["vram"].hits + c["ram"].lookups
    assert c["ram"].lookups == c["ram"].hits + c["ssd"].lookups


def test_token_chunks_cover_all_rows_and_each_fits():
    pager = loaded_pager(LAYOUT, make_experts(LAYOUT, 16, 1), TierSizes(16, 4, 16), None)
    topk = torch.tensor([[0, 1], [2, 3], [4, 5], [4, 6], [7, 8]])
    chunks = pager.token_chunks(topk)
    covered = [i for c in chunks for i in range(c.start, c.stop)]
    assert covered == list(range(5))
    for c in chunks:
        assert len(set(topk[c].flatten().tolist())) <= 4
    assert len(chunks) > 1


def test_ssd_failure_is_surfaced_and_never_used():
    records = make_experts(LAYOUT, 8, 3)
    source = ArraySource(records, fail={6})
    pager = loaded_pager(LAYOUT, records, TierSizes(8, 2, 4), source)
    with pytest.raises(PagerError, match="expert 6: SSD read failed"):
        pager.prepare(torch.tensor([[6, 1]]), lambda s, v: None)
    assert 6 not in pager.ram_of and 6 not in pager.vram_of
    source.fail = set()
    got = {}
    pager.prepare(torch.tensor([[6, 1]]), lambda s, v: got.__setitem__(s, v["w13_weight"].clone()))
    assert 6 in pager.vram_of
    assert pager.stats["ssd"].errors == 1


def test_missing_component_at_load_is_reported():
    pager = HostPager(LAYOUT, TierSizes(4, 2, 4), None)
    for e in range(4):
        pager.mark_loaded(e, "w13_weight")
    with pytest.raises(PagerError, match="did not provide"):
        pager.prepare(torch.tensor([[0]]), lambda s, v: None)


@pytest.mark.parametrize("vram,ram", [(0, 4), (5, 4), (2, 9)])
def test_bad_tier_sizes_are_refused(vram, ram):
    with pytest.raises(ValueError):
        TierSizes(8, vram, ram)


class GlitchySource(ArraySource):
    """A fake SSD source whose record `expert` fails its checksum for the first `bad_reads` reads."""

    def __init__(self, records: torch.Tensor, expert: int, bad_reads: int):
        super().__init__(records)
        self.expert, self.bad_reads = expert, bad_reads

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        from bigmoe_pager.core.paging_file import ChecksumError

        super().read_record(expert, dst)
        if expert == self.expert and self.bad_reads:
            self.bad_reads -= 1
            raise ChecksumError(f"paging file /x.pages: record (0, {expert}) fails its crc32 check")


@pytest.mark.parametrize("bad_reads, fails", [(1, False), (2, True), (5, True)])
def test_a_checksum_failure_is_read_once_more_then_ends_the_step_naming_the_file(bad_reads, fails):
    records = make_experts(LAYOUT, 8, 4)
    source = GlitchySource(records, expert=6, bad_reads=bad_reads)
    pager = loaded_pager(LAYOUT, records, TierSizes(8, 2, 4), source)
    got = {}
    step = lambda: pager.prepare(torch.tensor([[6, 1]]), lambda s, v: got.__setitem__(s, v["w13_weight"].clone()))  # noqa: E731
    if fails:
        with pytest.raises(PagerError, match=r"expert 6: SSD read failed: paging file /x.pages: .*crc32"):
            step()
        assert source.reads == 2 and 6 not in pager.ram_of and pager.stats["ssd"].errors == 1
    else:
        step()
        assert source.reads == 2 and 6 in pager.vram_of and pager.stats["ssd"].errors == 0
