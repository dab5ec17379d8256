"""Timing of work captured in one CUDA graph, for the GPU tests that compare decision kernels."""

from __future__ import annotations

from typing import Callable

import torch
from bigmoe_bench.graph_timing import replay_us as graph_replay_us


def replay_us(work: Callable[[], None], replays: int) -> float:
    """Microseconds per replay of `work` captured in one CUDA graph (two eager warm-ups, five untimed replays)."""
    for _ in range(2):
        work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph_replay_us(graph, replays)
