"""Microseconds per replay of a captured CUDA graph, timed between two events: the figure of the GPU probes and of
the GPU tests that compare kernels."""

from __future__ import annotations

import torch


def replay_us(graph: torch.cuda.CUDAGraph, replays: int, warmups: int = 5) -> float:
    """Microseconds per replay of `graph` over `replays` back-to-back replays, after `warmups` untimed ones (a graph's
    first replays upload it and run slower)."""
    for _ in range(warmups):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays
