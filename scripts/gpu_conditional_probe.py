"""What a CUDA graph's IF node costs: the price of letting a quiet forward choose plain steps on the device.

Recall 0's remaining cost in vLLM is the joinless steps' handoff, about 1 us a step over a plain one (runs 35, 39:
0.03-0.05 ms a token over 40 steps). One way to drop it without a host read (docs/benchmarks.md, "after session 49")
is a conditional node per step: the drain writes a device word, each step is captured twice behind IF nodes, and the
graph runs one. torch exposes such nodes while capturing (`CUDAGraph.begin_capture_to_if_node(pred)`: a small kernel
copies the scalar tensor into the node's condition, then the body runs or not). That pays only if a node costs well
under the 1 us it would save; this times it.

    plain   --steps small kernels (one add on --bytes of int32 each, the step's stand-in), captured plainly
    if-on   each kernel behind an IF node whose condition is true (the body runs)
    if-off  the same, condition false (the body is skipped): what a node costs when it saves its whole body
    either  each kernel twice behind two IF nodes, one true and one false: a step chosen from two captured forms
            (torch's own if/else before CUDA 12.8 is this plus a logical_not kernel)

Each variant is one graph replayed --replays times between two events, in turn --rounds times; the figure is
microseconds per graph and per step over plain. After the timed replays each variant's buffer is checked: a body
ran exactly as often as its condition said.

    GPU: python3 scripts/gpu_conditional_probe.py --out $OUT/conditional.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bigmoe_bench.graph_timing import replay_us  # noqa: E402

IF_NODE = "begin_capture_to_if_node"
"""torch's CUDAGraph method that opens an IF node's body during a capture (vLLM 0.33's torch 2.14 has it; the
image's 2.11 does not)."""

VARIANTS = ("plain", "if-on", "if-off", "either")
"""The graph shapes timed, in the order each round replays them."""


def bodies_per_step(variant: str) -> int:
    """How many times one step's body runs in one replay of the variant's graph."""
    return 0 if variant == "if-off" else 1


def capture(variant: str, steps: int, buf: torch.Tensor, on: torch.Tensor, off: torch.Tensor) -> torch.cuda.CUDAGraph:
    """The variant's graph: `steps` adds of one to `buf`, each behind the IF nodes the variant names (conditions:
    scalar bool tensors on the GPU, `on` true and `off` false)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        buf.add_(1)  # warm the kernel outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(steps):
            if variant == "plain":
                buf.add_(1)
                continue
            conditions = {"if-on": [on], "if-off": [off], "either": [on, off]}[variant]
            for condition in conditions:
                graph.begin_capture_to_if_node(condition)
                buf.add_(1)
                graph.end_capture_to_conditional_node()
    torch.cuda.synchronize()
    return graph


def summarize(times: dict[str, list[float]], steps: int) -> dict:
    """Median microseconds per replay of each variant and, beside plain, per step."""
    medians = {v: statistics.median(t) for v, t in times.items()}
    base = medians["plain"]
    return {
        v: {"us_per_graph": round(m, 3), "us_per_step_over_plain": round((m - base) / steps, 4), "rounds": times[v]}
        for v, m in medians.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="steps a graph holds (the benchmark's 40 MoE layers)")
    p.add_argument("--bytes", type=int, default=4096, help="bytes each step's kernel adds to")
    p.add_argument("--replays", type=int, default=2000, help="timed replays of each graph a round")
    p.add_argument("--rounds", type=int, default=5, help="times each variant is timed, in turn")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_conditional_probe: no CUDA device; this probe times graph nodes on a GPU", file=sys.stderr)
        return 2
    if not hasattr(torch.cuda.CUDAGraph, IF_NODE):
        print(
            f"gpu_conditional_probe: torch {torch.__version__} has no CUDAGraph.{IF_NODE}; run it with vLLM 0.33's "
            "torch (source /tmp/site/env.sh)",
            file=sys.stderr,
        )
        return 2
    on = torch.ones((), dtype=torch.bool, device="cuda")
    off = torch.zeros((), dtype=torch.bool, device="cuda")
    bufs = {v: torch.zeros(args.bytes // 4, dtype=torch.int32, device="cuda") for v in VARIANTS}
    graphs = {v: capture(v, args.steps, bufs[v], on, off) for v in VARIANTS}
    for buf in bufs.values():
        buf.zero_()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            times[v].append(round(replay_us(graphs[v], args.replays, warmups=20), 3))
    torch.cuda.synchronize()
    replays = args.rounds * (args.replays + 20)
    ran = {v: int(bufs[v][0].item()) for v in VARIANTS}
    wrong = {v: n for v, n in ran.items() if n != replays * args.steps * bodies_per_step(v)}
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": args.steps,
        "bytes": args.bytes,
        "replays": args.replays,
        "variants": summarize(times, args.steps),
        "bodies_wrong": wrong,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({v: r["us_per_step_over_plain"] for v, r in result["variants"].items()}), "wrong:", wrong)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
