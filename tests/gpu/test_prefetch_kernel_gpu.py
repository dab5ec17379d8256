"""The fused prefetch on a real GPU: on a side stream in a CUDA graph, replayed, it equals the two-launch path
(admit kernel + copy_records), and one launch costs less than two when there is nothing to copy."""

from __future__ import annotations

import pytest
import torch
from bigmoe_pager.core import prefetch_kernel
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.stats import PagerStats
from graph_timing import replay_us  # tests/gpu, beside this file
from test_admit_gpu import state  # tests/gpu, beside this file
from test_step_kernel_gpu import fp8_layout, full_ram, slot_bytes

pytestmark = pytest.mark.gpu

ADMITTED = ("experts", "slots", "evicted", "rows")


class Inputs:
    """Static device tensors the captured graphs read, refilled before each replay."""

    def __init__(self, experts: int, tokens: int, k: int, predictions: int) -> None:
        self.experts = experts
        self.ids = torch.zeros((tokens, k), dtype=torch.int32, device="cuda")
        self.predicted = torch.full((tokens, predictions), -1, dtype=torch.int64, device="cuda")

    def refill(self, g: torch.Generator) -> None:
        """Routing with a hot quarter; predictions of the next step's ids, about half right, a fifth -1 padding."""
        e, (tokens, k) = self.experts, self.ids.shape
        hot = torch.randperm(e, generator=g)[: e // 4]
        ids = torch.stack([hot[torch.randperm(hot.numel(), generator=g)[:k]] for _ in range(tokens)])
        guess = torch.randint(0, e, self.predicted.shape, generator=g)
        nxt = hot[torch.randint(0, hot.numel(), (tokens, k), generator=g)]
        guess[:, :k] = torch.where(torch.rand(tokens, k, generator=g) < 0.5, nxt, guess[:, :k])
        guess[torch.rand(guess.shape, generator=g) < 0.2] = -1
        self.ids.copy_(ids)
        self.predicted.copy_(guess)


@pytest.mark.parametrize(
    "experts,slots,policy,gate,programs",
    [
        (256, 102, "lru", 0, 16),
        (256, 32, "lfu-fast", 60, 16),
        (128, 24, "lfu", 20, 0),
        (64, 16, "lfu-duel", 60, 4),
    ],
)
def test_fused_prefetch_in_a_graph_equals_two_launches(experts, slots, policy, gate, programs):
    """Per replay: a fused step on the main stream, then the prefetch on a side stream; each path captured in its
    own graph and replayed 200 times with new inputs: same lists, tables, counters and slot bytes every time."""
    layout = fp8_layout()
    assert prefetch_kernel.fits(slots, layout)
    ram = full_ram(layout, experts, seed=experts)
    inputs = Inputs(experts, 1, 8, 12)
    side = torch.cuda.Stream()
    pagers, stats, out, graphs = {}, {}, {}, {}
    for fused in (True, False):
        stats[fused] = PagerStats(1, "cuda")
        pagers[fused] = ExpertPager(
            layout,
            experts,
            slots,
            ram,
            device="cuda",
            stats=stats[fused],
            policy=policy,
            prefetch_programs=programs,
            prefetch_gate=gate,
            fused_prefetch=fused,
        )

    def round_of(fused: bool) -> None:
        pager = pagers[fused]
        pager.acquire(inputs.ids)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out[fused] = pager.prefetch(inputs.predicted)
        torch.cuda.current_stream().wait_stream(side)

    g = torch.Generator().manual_seed(experts + slots)
    for _ in range(2):  # compile outside the capture; both pagers see the same rounds
        inputs.refill(g)
        round_of(True)
        round_of(False)
    torch.cuda.synchronize()
    captured = {}
    for fused in (True, False):
        graphs[fused] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[fused]):
            round_of(fused)
        captured[fused] = out[fused]
    for replay in range(200):
        inputs.refill(g)
        graphs[True].replay()
        graphs[False].replay()
        torch.cuda.synchronize()
        for name in ADMITTED:
            assert torch.equal(getattr(captured[True], name), getattr(captured[False], name)), (replay, name)
        want, got = state(pagers[False].vram), state(pagers[True].vram)
        for name in want:
            assert torch.equal(want[name], got[name]), (replay, name)
        want, got = slot_bytes(pagers[False]), slot_bytes(pagers[True])
        full = pagers[True].vram.slot_expert >= 0
        for name in want:
            assert torch.equal(want[name][full], got[name][full]), (replay, name)
        assert pagers[True].vram.admit_state()["sync"].tolist() == [0, 0, 0]
    assert torch.equal(stats[False].device_counts, stats[True].device_counts)
    assert stats[True].snapshot()["vram"].prefetched > 0


def test_fused_prefetch_costs_less_than_two_launches_with_nothing_to_copy():
    """Qwen3.6-like shapes (102 of 256 slots), 40 layers' prefetches in one graph, proposals all -1 (recall 0):
    one launch per layer against two."""
    layout = fp8_layout()
    layers, experts, slots, replays = 40, 256, 102, 50
    ram = full_ram(layout, experts, seed=3)
    predicted = torch.full((1, 8), -1, dtype=torch.int64, device="cuda")
    us = {}
    for fused in (False, True):
        pagers = [
            ExpertPager(layout, experts, slots, ram, device="cuda", layer=i, fused_prefetch=fused)
            for i in range(layers)
        ]

        def prefetches() -> None:
            for p in pagers:
                p.prefetch(predicted)

        us[fused] = replay_us(prefetches, replays) / layers
    print(f"one prefetch with nothing to copy: two launches {us[False]:.2f} us, fused {us[True]:.2f} us")
    assert us[True] < us[False]
