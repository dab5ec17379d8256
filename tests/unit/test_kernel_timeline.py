"""kernel_timeline reads a profiler trace's streams: main-stream idle time while the side stream works, and overlap."""

from __future__ import annotations

import json
import random

import pytest
from bigmoe_bench.kernel_timeline import summarize, summarize_file

MAIN, SIDE = 7, 13
KERNELS = [  # (name, stream, start us, end us): main busy 0-10, 12-20, 30-40; side 5-15 and a copy 20-28
    ("gemv", MAIN, 0, 10),
    ("admit", SIDE, 5, 15),
    ("fused_moe", MAIN, 12, 20),
    ("_copy_kernel", SIDE, 20, 28),
    ("attention", MAIN, 30, 40),
]


def trace(order_seed: int | None = None) -> dict:
    events = [
        {"ph": "X", "cat": "kernel", "name": n, "ts": a, "dur": b - a, "args": {"stream": s, "device": 0}}
        for n, s, a, b in KERNELS
    ]
    events += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 3, "args": {"stream": MAIN}},
    ]
    if order_seed is not None:
        random.Random(order_seed).shuffle(events)
    return {"traceEvents": events}


@pytest.mark.parametrize("order_seed", [None, 0, 1])
def test_streams_idle_and_overlap_per_token(order_seed):
    s = summarize(trace(order_seed), tokens=2)
    assert s["streams"] == 2
    assert s["window_us_per_token"] == 20.0
    assert s["main_busy_us_per_token"] == 14.0  # 28 us of main-stream kernels
    assert s["main_idle_us_per_token"] == 6.0  # gaps 10-12 and 20-30
    assert s["main_idle_while_side_busy_us_per_token"] == 5.0  # 10-12 and 20-28: the main stream waits on the side
    assert s["side_busy_us_per_token"] == 9.0
    assert s["side_beside_main_us_per_token"] == 4.0  # 5-10 and 12-15
    assert s["copy_kernels"] == {"side": {"per_token": 0.5, "us_per_token": 4.0, "mean_us": 8.0}}
    assert s["top_kernels"][0]["name"] in ("gemv", "admit", "attention")


def test_a_trace_without_kernels_says_so(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}))
    assert summarize_file(path, tokens=4) == {"error": "the trace holds no GPU kernels"}
