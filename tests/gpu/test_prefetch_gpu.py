"""Next-layer prefetch on a side stream, captured with the steps in one CUDA graph and replayed: every id reads
its own expert's bytes (a wrong or late prediction never changes what a step reads), and right predictions hit."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.pinned import pinned_empty
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.stats import PagerStats

pytestmark = pytest.mark.gpu


def full_ram(layout: ExpertLayout, experts: int, seed: int) -> tuple[RamTier, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    host = pinned_empty((experts, layout.pitch))
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=g))
    ram = RamTier(layout, experts, experts, "cuda")
    ram.load_all(host)
    return ram, host.cuda()


def read_bytes(pager: ExpertPager, remapped: torch.Tensor) -> torch.Tensor:
    """What a MoE kernel reads for each id: its slot's bytes, components concatenated ([ids, record bytes])."""
    slots = remapped.reshape(-1).long().clamp(min=0)
    return torch.cat([b.view(b.shape[0], -1).view(torch.uint8)[slots] for b in pager.buffers.values()], dim=1)


@pytest.mark.parametrize("policy", ["lru", "lfu-fast", "lfu-duel"])
def test_side_stream_prefetch_in_a_graph_never_changes_what_a_step_reads(policy):
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    experts, slots, k, p = 64, 16, 4, 8
    rams = [full_ram(layout, experts, seed=layer) for layer in range(2)]
    stats = PagerStats(2, "cuda")
    pagers = [
        ExpertPager(layout, experts, slots, ram, device="cuda", layer=layer, stats=stats, policy=policy)
        for layer, (ram, _) in enumerate(rams)
    ]
    for pager in pagers:
        pager.warm_vram(torch.arange(slots))
        # Every round copies: this test is about the bytes a step reads while copies land, not the gate (these
        # proposals, half of them random ids, use under half their copies and would close the default gate).
        pager.vram.min_used_percent = 0
    ids = torch.zeros((2, 1, k), dtype=torch.int32, device="cuda")
    guess = torch.full((p,), -1, dtype=torch.int64, device="cuda")
    # the components' bytes back to back (a record also holds alignment padding between them)
    component_bytes = sum(c.nbytes for c in layout.components)
    out = [torch.zeros((k, component_bytes), dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()

    def token() -> None:
        for layer in range(2):
            if layer == 1:
                torch.cuda.current_stream().wait_stream(side)  # layer 1 waits for its prefetch copies
            remapped = pagers[layer].prepare(ids[layer])
            if layer == 0:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    pagers[1].prefetch(guess)
            out[layer].copy_(read_bytes(pagers[layer], remapped))

    def expected(layer: int) -> torch.Tensor:
        records = rams[layer][1]
        rows = ids[layer].reshape(-1).long()
        return torch.cat([records[rows, c.offset : c.offset + c.nbytes] for c in layout.components], dim=1)

    rng = random.Random(3)
    hot = rng.sample(range(experts), 24)

    def new_token() -> None:
        rows = [rng.sample(hot, k) for _ in range(2)]
        right = [e for e in rows[1] if rng.random() < 0.8]
        wrong = rng.sample(range(experts), p - len(right))
        ids.copy_(torch.tensor(rows, dtype=torch.int32).view(2, 1, k))
        guess.copy_(torch.tensor(right + wrong))

    for _ in range(3):  # compile outside the capture
        new_token()
        token()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token()
    stats.reset()
    for step in range(200):
        new_token()
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(2):
            assert torch.equal(out[layer], expected(layer)), (step, layer)
    snap = stats.snapshot(1)["vram"]
    assert snap.prefetched > 0 and snap.prefetch_used > 0
