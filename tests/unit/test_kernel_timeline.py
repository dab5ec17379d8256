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
    assert s["prefetch_busy_us_per_token"] == 4.0  # by name: only the copy is the prefetch's ("admit" is not a name)
    assert s["prefetch_alone_us_per_token"] == 4.0  # 20-28: nothing else ran
    assert s["gpu_idle_us_per_token"] == 1.0  # 28-30: no kernel on any stream
    gemv = next(k for k in s["top_kernels"] if k["name"] == "gemv")
    assert (gemv["per_token"], gemv["us_per_token"], gemv["mean_us"]) == (0.5, 5.0, 10.0)


GRAPH = [  # a replayed graph: the driver put prefetch and compute on streams of its choosing, both on each
    ("attention", 1, 0, 10),
    ("_replayed_rows_kernel_0d1d", 2, 2, 3),
    ("_admit_kernel_0d1d", 1, 10, 14),  # alone: nothing else runs
    ("_copy_kernel_0d1d", 2, 12, 26),  # 12-14 beside the admit only, 14-20 beside the MoE, 20-26 alone
    ("fused_moe_kernel", 2, 14, 20),
    ("_step_kernel_0d1d", 1, 26, 28),  # the next layer's step, after the join
]


def test_prefetch_time_by_name_whatever_the_streams():
    events = [
        {"ph": "X", "cat": "kernel", "name": n, "ts": a, "dur": b - a, "args": {"stream": st}} for n, st, a, b in GRAPH
    ]
    s = summarize({"traceEvents": events}, tokens=1)
    assert s["prefetch_busy_us_per_token"] == 17.0  # 2-3 and 10-26
    assert s["prefetch_alone_us_per_token"] == 10.0  # 10-14 and 20-26: what the steps waited for


def test_a_trace_without_kernels_says_so(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}))
    assert summarize_file(path, tokens=4) == {"error": "the trace holds no GPU kernels"}


def test_gpu_idle_around_each_step_is_summed_where_no_kernel_runs():
    """Idle just before a step (a join's latency) and just after it (a fork's), counted only where nothing ran."""
    timeline = [
        ("attention", 1, 0, 10),
        ("_step_kernel_0d1d", 1, 13, 15),  # 3 us idle before (10-13), 4 after (15-19)
        ("fused_moe_kernel", 1, 19, 30),
        ("_copy_kernel_0d1d", 2, 25, 40),  # runs across the next step's start: no idle before it
        ("_step_kernel_0d1d", 1, 32, 34),  # 32-34 beside the copy; after: the copy runs on, so no idle
        ("attention", 1, 41, 50),
    ]
    events = [
        {"ph": "X", "cat": "kernel", "name": n, "ts": a, "dur": b - a, "args": {"stream": st}}
        for n, st, a, b in timeline
    ]
    s = summarize({"traceEvents": events}, tokens=2)
    assert s["steps_per_token"] == 1.0
    assert s["gpu_idle_before_steps_us_per_token"] == 1.5  # 3 us over 2 tokens
    assert s["gpu_idle_after_steps_us_per_token"] == 2.0  # 4 us over 2 tokens


def chain_with_side(gap_alone: float, gap_beside: float, side: tuple[str, float, float] | None) -> dict:
    """Ten 2-us chain kernels: gaps of gap_alone, except gap_beside from the fifth kernel on where a side kernel
    runs (start/end in us); one longer wait (a token's end) between the fifth and sixth."""
    events, t = [], 0.0
    for i in range(10):
        name = "_step_kernel_0d1d" if i % 2 else "fused_moe_kernel"
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": 2.0, "args": {"stream": 1}})
        t += 2.0 + (50.0 if i == 4 else gap_beside if side and i >= 5 else gap_alone)
    if side:
        name, start, end = side
        events.append(
            {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "args": {"stream": 2}}
        )
    return {"traceEvents": events}


@pytest.mark.parametrize("side_kernel", ["_forward_rounds_kernel", "_wait_kernel", "_copy_kernel_0d1d"])
def test_chain_gaps_split_by_a_side_kernel_running_beside(side_kernel):
    t = chain_with_side(0.1, 0.4, (side_kernel, 60.0, 200.0))
    gaps = summarize(t, tokens=2)["chain_gaps"]
    assert gaps["alone"]["per_token"] == 2.0  # four gaps before the wait
    assert gaps["alone"]["median_us"] == pytest.approx(0.1)
    assert gaps["beside_side"]["per_token"] == 2.0  # four gaps while the side kernel runs; the 50-us wait is not one
    assert gaps["beside_side"]["median_us"] == pytest.approx(0.4)
    assert gaps["beside_side"]["us_per_token"] == pytest.approx(0.8)


def test_chain_gaps_without_a_prefetch_path_are_all_alone():
    gaps = summarize(chain_with_side(0.1, 0.4, None), tokens=1)["chain_gaps"]
    assert gaps["beside_side"] == {"per_token": 0.0, "median_us": None, "mean_us": None, "us_per_token": 0.0}
    assert gaps["alone"]["per_token"] == 8.0
    assert gaps["alone"]["mean_us"] == pytest.approx(0.1)


def test_a_side_kernel_that_starts_inside_a_gap_makes_it_beside():
    t = chain_with_side(0.1, 0.4, ("decide_round", 2.05, 2.08))  # inside the first gap only, 2.0-2.1
    gaps = summarize(t, tokens=1)["chain_gaps"]
    assert gaps["beside_side"]["per_token"] == 1.0
    assert gaps["alone"]["per_token"] == 3.0 + 4.0


@pytest.mark.parametrize(
    ("side", "beside"),
    [
        ((1.0, 2.05), 1),  # ends inside the first gap (2.0-2.1)
        ((2.05, 2.08), 1),  # wholly inside it
        ((2.1, 3.0), 0),  # starts as the gap ends: no part of the gap
        ((0.5, 2.0), 0),  # ends as the gap starts
    ],
)
def test_a_gap_is_beside_only_where_a_side_kernel_runs_during_part_of_it(side, beside):
    t = chain_with_side(0.1, 0.1, ("_admit_kernel", *side))
    gaps = summarize(t, tokens=1)["chain_gaps"]
    assert gaps["beside_side"]["per_token"] == beside
    assert gaps["alone"]["per_token"] == 8 - beside
