"""The fused prefetch round (prefetch_kernel, compiled) on a side stream inside a CUDA graph equals the two-launch
round (admit kernel, then copy kernel) replay by replay: what it admits, the table and gate state, the counters and
the slot bytes."""

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

TABLE = ("expert_slot", "slot_expert", "last_use", "step", "use_count", "used_score", "wasted_score", "gate_closed")


def twin_pagers(layout, experts, slots, policy, programs):
    g = torch.Generator().manual_seed(11)
    host = pinned_empty((experts, layout.pitch))
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=g))
    made = []
    for fused in (True, False):
        ram = RamTier(layout, experts, experts, "cuda")
        ram.load_all(host)
        stats = PagerStats(1, "cuda")
        pager = ExpertPager(
            layout, experts, slots, ram, device="cuda", stats=stats, policy=policy, prefetch_programs=programs
        )
        pager.fused_prefetch = fused
        pager.warm_vram(torch.arange(slots))
        made.append((pager, stats))
    return made


@pytest.mark.parametrize("policy,programs,recall", [("lru", 16, 0.8), ("lfu-duel", 16, 0.8), ("lfu-duel", 3, 0.0)])
def test_fused_round_in_a_graph_equals_the_two_launch_round(policy, programs, recall):
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    experts, slots, k = 64, 16, 8
    (fused, fstats), (split, sstats) = twin_pagers(layout, experts, slots, policy, programs)
    ids = torch.zeros((1, k), dtype=torch.int32, device="cuda")
    guess = torch.zeros((k,), dtype=torch.int64, device="cuda")
    graphs, admitted = [], []
    for pager in (fused, split):
        side = torch.cuda.Stream()

        def token(pager=pager, side=side) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                got = pager.prefetch(guess)
            torch.cuda.current_stream().wait_stream(side)
            pager.prepare(ids)
            return got

        token()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            admitted.append(token())
        graphs.append(graph)
    # the warm-up token ran eagerly on both: the twins start from equal states
    rng = random.Random(7)
    hot = list(range(0, experts, 3))
    copied = 0
    for replay in range(150):
        truth = rng.sample(hot if rng.random() < 0.7 else range(experts), k)
        ids.copy_(torch.tensor([truth], dtype=torch.int32))
        guess.copy_(torch.tensor([e if rng.random() < recall else rng.randrange(experts) for e in truth]))
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        a, b = admitted
        for field in ("experts", "slots", "evicted", "rows"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (replay, field)
        for name in TABLE:
            assert torch.equal(getattr(fused.vram, name), getattr(split.vram, name)), (replay, name)
        for name, buf in fused.buffers.items():
            assert torch.equal(buf.view(torch.uint8), split.buffers[name].view(torch.uint8)), (replay, name)
        assert int(fused.vram.admit_state()["prefetch_done"]) == 0
        copied += int((a.experts >= 0).sum())
    assert torch.equal(fstats.device_counts, sstats.device_counts)
    if recall:
        assert copied > 0
