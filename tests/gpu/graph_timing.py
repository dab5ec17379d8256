"""Timing of work captured in one CUDA graph, for the GPU tests that compare decision kernels."""

from __future__ import annotations

from typing import Callable

import torch


def replay_us(work: Callable[[], None], replays: int) -> float:
    """Microseconds per replay of `work` captured in one CUDA graph (two eager warm-ups, five untimed replays)."""
    for _ in range(2):
        work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays
