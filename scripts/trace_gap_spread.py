"""Where in a decode forward the engine's launch gaps widen: per profiled trace (torch.profiler's Chrome trace, as
scripts/gpu_vllm_bench.py --profile-tokens leaves them), the median gap between back-to-back kernels of the main
stream in each tenth of the forward (by how many fused steps came before: the gaps of layers t*L/10 .., with the
gap after the step before them), and for the kernel pairs that follow each other most often, their median gap. Run 25
used it to tell a uniform widening of every launch (a property of the whole graph) from one around the steps.

    python scripts/trace_gap_spread.py NAME=TRACE.json ... --out gaps.json
    python scripts/trace_gap_spread.py --bench bench-o.json --out gaps.json   (every profiled row's trace, where the
                                                                              bench left it: on the machine)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bigmoe_bench.kernel_timeline import LAUNCH_GAP_US, STEP_KERNEL, kernels  # noqa: E402

PAIRS = 8
"""Kernel pairs reported per trace (the most frequent)."""


def spread(trace: dict) -> dict:
    ks = kernels(trace)
    main = collections.Counter(k["stream"] for k in ks).most_common(1)[0][0]
    chain = [k for k in ks if k["stream"] == main]
    total_steps = sum(STEP_KERNEL in k["name"] for k in chain)
    tenths: list[list[float]] = [[] for _ in range(10)]
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    steps = 0
    forward = _forward_steps(chain, total_steps)
    for a, b in zip(chain, chain[1:]):
        steps += STEP_KERNEL in a["name"]
        gap = b["start"] - a["end"]
        if gap > LAUNCH_GAP_US:
            continue
        tenths[(steps % forward) * 10 // forward].append(gap)
        pairs[(a["name"][:40], b["name"][:40])].append(gap)
    top = sorted(pairs.items(), key=lambda kv: -len(kv[1]))[:PAIRS]
    return {
        "kernels": len(chain),
        "steps": total_steps,
        "median_gap_us": round(statistics.median(g for t in tenths for g in t), 3),
        "median_gap_us_by_tenth": [round(statistics.median(t), 3) if t else None for t in tenths],
        "pairs": [
            {"from": a, "to": b, "count": len(v), "median_gap_us": round(statistics.median(v), 3)} for (a, b), v in top
        ],
    }


def _forward_steps(chain: list[dict], steps: int) -> int:
    """Fused steps in one forward, of `steps` in the trace: the steps between two launches of the forward's rarest
    frequent kernel (the lm_head GEMM, once a token), or all of them when there is no such marker."""
    counts = collections.Counter(k["name"] for k in chain)
    once = [n for n, c in counts.items() if 4 <= c and steps and steps % c == 0 and steps // c >= 2]
    return steps // counts[min(once, key=lambda n: counts[n])] if once else max(1, steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", help="NAME=PATH of a profiled trace")
    parser.add_argument("--bench", type=Path, help="a bench run (gpu_vllm_bench.py --out): its rows' traces")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    items = list(args.traces)
    if args.bench is not None:
        try:
            rows = json.loads(args.bench.read_text())["configs"]
        except (OSError, ValueError, KeyError) as e:
            print(f"trace_gap_spread: {args.bench}: not a bench run ({e})", file=sys.stderr)
            return 2
        items += [f"{r['name']}/{r['family']}={r['decode_profile']['trace']}" for r in rows if r.get("decode_profile")]
    if not items:
        parser.error("give NAME=PATH traces or --bench")
    result = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"{item!r}: give NAME=PATH")
        try:
            result[name] = spread(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"trace_gap_spread: {path}: cannot read a trace ({e})", file=sys.stderr)
            return 2
        print(name, result[name]["median_gap_us"], result[name]["median_gap_us_by_tenth"])
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
