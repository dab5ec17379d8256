"""What a torch.profiler trace of decode steps says about streams: does the prefetch overlap the compute?

Run 7 (H200, vLLM 0.33) measured next-layer prefetch hiding its copies in a CUDA-graph probe of the
pager's own parts but not inside vLLM. A kernel timeline of a few decode tokens answers why: how long
the main stream sat idle while the side stream still had work (the join waiting for the prefetch),
how much side-stream time ran beside main-stream kernels, and how long the copies took.

`summarize(trace, tokens)` reads a Chrome trace that torch.profiler exported (kernels are "X" events of
category "kernel" with args.stream; kernels replayed inside CUDA graphs are listed one by one) and
returns per-token microseconds. The main stream is the one with the most kernel time.

A replayed graph's branches run on streams the driver picks (run 8), so the per-stream figures do not
separate a prefetch from the compute there; the `prefetch_*` figures go by kernel name instead
(PREFETCH_KERNELS): how long the prefetch's kernels ran, and how long they ran with no other kernel on
the GPU, which is what the rest of the step waited for them (the copies a layer's window did not hide).
The GPU's idle time just before and after each fused step (where a prefetch path's joins and forks sit)
tells launch latency at those edges from kernels slowed by what runs beside them (run 16's open question).

`chain_gaps` (run 20): the launch gaps between the engine's own back-to-back kernels (everything not a prefetch
path's), split by whether a prefetch-path kernel ran during the gap. Run 20 found them 0.10 us apart (median)
with no prefetch and 0.42 us while a side kernel ran, about 0.3 ms a token over some 1,000 kernels, in profiled
tokens; whether the untraced engine pays that too is scripts/gpu_launch_gap_probe.py's question.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path

Interval = tuple[float, float]

TOP_KERNELS = 16
"""Kernels (by name and stream) the summary ranks by their time per token."""

STEP_KERNEL = "_step_kernel"
"""The fused step's kernel: a prefetch path's cross-stream edges sit next to it (forks after, joins before)."""

PREFETCH_KERNELS = ("_admit_kernel", "_replayed_rows_kernel", "_copy_kernel")
"""Names of the prefetch path's kernels: its decision, a replayed trace's proposal, its copy. Over a full RAM tier a
step copies inside its own _step_kernel, so every _copy_kernel there is a prefetch's; over a partial tier the steps'
two-launch copies count too."""


SIDE_PATH_KERNELS = PREFETCH_KERNELS + (
    "_forward_rounds_kernel",
    "_wait_kernel",
    "_wait_all_kernel",
    "decide_round",
    "_publish_kernel",
)
"""Every kernel a prefetch path runs beside the engine's chain: its decisions, proposals, copies, one-node program,
waits and mailbox publications (the drain at a forward's end runs on the engine's stream, in the chain)."""

LAUNCH_GAP_US = 5.0
"""Gaps between chain kernels up to this long are launch gaps; longer ones are waits (the host, a join, a token's
end) and are left out of chain_gaps."""


def kernels(trace: dict) -> list[dict]:
    """The trace's GPU kernels: {"name", "stream", "start", "end"} in microseconds, by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "stream" in e.get("args", {}):
            start = float(e["ts"])
            out.append(
                {
                    "name": e.get("name", ""),
                    "stream": int(e["args"]["stream"]),
                    "start": start,
                    "end": start + float(e.get("dur", 0.0)),
                }
            )
    return sorted(out, key=lambda k: k["start"])


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if start < end:
            out.append((start, end))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy: list[Interval]) -> list[Interval]:
    """The idle stretches between a merged list's first start and last end."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] > a[1]]


def idle_around(ks: list[dict], name: str) -> tuple[int, float, float]:
    """(count, microseconds, microseconds): how many kernels named `name` ran, and the GPU-wide idle time (no kernel
    on any stream) just before and just after them, summed. A cross-stream edge that costs launch latency shows up
    there; one that slows the kernels beside it does not."""
    ends = sorted(k["end"] for k in ks)
    starts = sorted(k["start"] for k in ks)
    count, before, after = 0, 0.0, 0.0
    for k in ks:
        if name not in k["name"]:
            continue
        count += 1
        ended = [e for e in ends if e <= k["start"]]
        running = any(o["start"] < k["start"] < o["end"] for o in ks)
        if ended and not running:
            before += k["start"] - ended[-1]
        later = [b for b in starts if b >= k["end"]]
        busy = any(o["start"] < k["end"] < o["end"] for o in ks)
        if later and not busy:
            after += later[0] - k["end"]
    return count, before, after


def chain_gaps(ks: list[dict], tokens: int) -> dict:
    """The engine chain's launch gaps (microseconds, up to LAUNCH_GAP_US), as {"beside_side", "alone"}: each with
    gaps per token, their median and mean, and their sum per token. A gap is `beside_side` where a prefetch-path
    kernel (SIDE_PATH_KERNELS) ran during any part of it. Overlapping chain kernels (two graph branches of the
    engine's own) count no gap."""
    is_side = [any(name in k["name"] for name in SIDE_PATH_KERNELS) for k in ks]
    side = union([(k["start"], k["end"]) for k, s in zip(ks, is_side) if s])
    chain = [k for k, s in zip(ks, is_side) if not s]
    starts = [a for a, _ in side]
    found: dict[str, list[float]] = {"beside_side": [], "alone": []}
    reached = chain[0]["end"] if chain else 0.0
    for k in chain[1:]:
        gap = k["start"] - reached
        if 0.0 <= gap <= LAUNCH_GAP_US:
            # the last side stretch that starts before the gap ends (merged and sorted, so no other can reach into it)
            i = bisect.bisect_left(starts, k["start"]) - 1
            beside = i >= 0 and side[i][1] > reached
            found["beside_side" if beside else "alone"].append(gap)
        reached = max(reached, k["end"])
    per = 1.0 / max(1, tokens)
    return {
        where: {
            "per_token": round(len(xs) * per, 1),
            "median_us": round(statistics.median(xs), 3) if xs else None,
            "mean_us": round(statistics.fmean(xs), 3) if xs else None,
            "us_per_token": round(sum(xs) * per, 1),
        }
        for where, xs in found.items()
    }


def summarize(trace: dict, tokens: int, copy_name: str = "_copy_kernel") -> dict:
    """Per-token microseconds of the main stream's busy and idle time, side streams' time beside and outside it,
    the main stream's idle time while a side stream works (a join waiting for it), the time no kernel ran anywhere
    (launch and dependency latency between graph nodes), and the copy kernels."""
    ks = kernels(trace)
    if not ks:
        return {"error": "the trace holds no GPU kernels"}
    by_stream: dict[int, list[Interval]] = defaultdict(list)
    for k in ks:
        by_stream[k["stream"]].append((k["start"], k["end"]))
    busy = {s: union(iv) for s, iv in by_stream.items()}
    main = max(busy, key=lambda s: length(busy[s]))
    side = union([iv for s, ivs in busy.items() if s != main for iv in ivs])
    idle = gaps(busy[main])
    per = 1.0 / max(1, tokens)
    copies = [k for k in ks if copy_name in k["name"]]
    copy_streams = defaultdict(lambda: [0, 0.0])
    for k in copies:
        entry = copy_streams["main" if k["stream"] == main else "side"]
        entry[0] += 1
        entry[1] += k["end"] - k["start"]
    top: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for k in ks:
        entry = top[(k["name"][:80], "main" if k["stream"] == main else "side")]
        entry[0] += 1
        entry[1] += k["end"] - k["start"]
    ranked = sorted(top.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    everything = union([(k["start"], k["end"]) for k in ks])
    is_prefetch = [any(name in k["name"] for name in PREFETCH_KERNELS) for k in ks]
    prefetch = union([(k["start"], k["end"]) for k, p in zip(ks, is_prefetch) if p])
    others = union([(k["start"], k["end"]) for k, p in zip(ks, is_prefetch) if not p])
    steps, before_step, after_step = idle_around(ks, STEP_KERNEL)
    return {
        "tokens": tokens,
        "streams": len(busy),
        "window_us_per_token": round((busy[main][-1][1] - busy[main][0][0]) * per, 1),
        "main_busy_us_per_token": round(length(busy[main]) * per, 1),
        "main_idle_us_per_token": round(length(idle) * per, 1),
        "gpu_idle_us_per_token": round(length(gaps(everything)) * per, 1),
        "main_idle_while_side_busy_us_per_token": round(length(intersect(idle, side)) * per, 1),
        "side_busy_us_per_token": round(length(side) * per, 1),
        "side_beside_main_us_per_token": round(length(intersect(side, busy[main])) * per, 1),
        "prefetch_busy_us_per_token": round(length(prefetch) * per, 1),
        "prefetch_alone_us_per_token": round((length(prefetch) - length(intersect(prefetch, others))) * per, 1),
        "steps_per_token": round(steps * per, 2),
        "gpu_idle_before_steps_us_per_token": round(before_step * per, 1),
        "gpu_idle_after_steps_us_per_token": round(after_step * per, 1),
        "chain_gaps": chain_gaps(ks, tokens),
        "copy_kernels": {
            where: {"per_token": round(n * per, 2), "us_per_token": round(us * per, 1), "mean_us": round(us / n, 1)}
            for where, (n, us) in copy_streams.items()
        },
        "top_kernels": [
            {
                "name": name,
                "stream": where,
                "per_token": round(n * per, 2),
                "us_per_token": round(us * per, 1),
                "mean_us": round(us / n, 2),
            }
            for (name, where), (n, us) in ranked
        ],
    }


def summarize_file(path: Path, tokens: int) -> dict:
    return summarize(json.loads(Path(path).read_text()), tokens)
