"""The eviction default checked on routing families it was not chosen on.

lfu-duel became the default on four families (standard, topic-shift, near-uniform, recorded:
sim_eviction.py). This draws --families more from a stated parameter box (ALPHA .. CORR), each with
its own trace seed, none of them the four, and replays every policy over each with the pager's
own decision code (sim_eviction.simulate). The question it answers: is the default no worse than
lru on routing nobody tuned it to, and how far is it from the best policy of each family?

    PYTHONPATH=pager:bench:scripts python scripts/sim_holdout.py --families 40 --seed 2026 \
        --out docs/bench/eviction-holdout.json

A family is drawn as: alpha uniform in ALPHA, keep uniform in KEEP, no topic shifts with
probability STATIONARY_SHARE and otherwise a shift every log-uniform SHIFT_EVERY tokens of a share
uniform in SHIFT_SHARE, corr uniform in CORR. The draws depend on --seed alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import sim_eviction
import torch
from bigmoe_bench import traces

ALPHA = (0.3, 1.8)
"""Zipf exponent range (near-uniform's 0.2 and standard's 1.4 are inside or next to it)."""
KEEP = (0.0, 0.7)
"""Range of the chance that a token keeps each of the previous token's experts."""
STATIONARY_SHARE = 0.3
"""Share of drawn families without topic shifts."""
SHIFT_EVERY = (8, 512)
"""Tokens between topic shifts, drawn log-uniform in this range."""
SHIFT_SHARE = (0.1, 1.0)
"""Range of the share of each layer's experts re-ranked at a shift."""
CORR = (0.0, 0.5)
"""Range of the cross-layer pull (traces.Family.corr)."""
SHAPES = tuple(s for s in sim_eviction.SHAPES if s.name != "qwen3.6-40l/32+ram128")
"""The 40-layer benchmark at 32 and 102 VRAM slots, and Qwen3.8-Flash-Next's 4090 tiers (35 VRAM / 218 RAM)."""
POLICIES = ("lru", "lfu", "lfu-fast", "lfu-duel")
"""lru (the yardstick), the two decays lfu-duel plays against each other, and lfu-duel (the default)."""
TIE = 0.002
"""VRAM-hit differences this small are ties: the same policies on the same seed's 512-expert traces moved by up to
0.0022 between two machines (docs/benchmarks.md, sessions 12-13), so finer differences are not told apart here."""


def draw_family(rng: np.random.Generator) -> traces.Family:
    """One family from the box above."""
    alpha, keep, corr = rng.uniform(*ALPHA), rng.uniform(*KEEP), rng.uniform(*CORR)
    if rng.random() < STATIONARY_SHARE:
        shift_every, share = 0, 0.0
    else:
        shift_every = int(round(np.exp(rng.uniform(*np.log(SHIFT_EVERY)))))
        share = rng.uniform(*SHIFT_SHARE)
    return traces.Family(
        alpha=round(alpha, 3), keep=round(keep, 3), shift_every=shift_every, shift_share=round(share, 3),
        corr=round(corr, 3),
    )  # fmt: skip


def draw_families(count: int, seed: int) -> list[tuple[traces.Family, int]]:
    """(family, trace seed) pairs; trace seeds start at seed + 1 so none is a committed trace's seed 0."""
    rng = np.random.default_rng(seed)
    return [(draw_family(rng), seed + 1 + i) for i in range(count)]


def run(count: int, seed: int, tokens: int, layers: int, policies: tuple[str, ...], workers: int) -> list[dict]:
    """One row per drawn family and shape: the family's parameters and each policy's hit rates."""
    drawn = draw_families(count, seed)
    cases = []
    for index, (family, trace_seed) in enumerate(drawn):
        for experts, k in sorted({(s.experts, s.top_k) for s in SHAPES}):
            trace = traces.family_trace(family, tokens, layers, experts, k, trace_seed)
            cases += [(index, family, trace_seed, shape, trace) for shape in SHAPES if shape.experts == experts]
    jobs = [(trace, shape.experts, shape.vram, shape.ram, p) for *_, shape, trace in cases for p in policies]
    with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        rates = iter(pool.starmap(sim_eviction.simulate, jobs, chunksize=1))
    rows = []
    for index, family, trace_seed, shape, _ in cases:
        row = sim_eviction.shape_row(f"holdout-{index}", shape) | {"params": asdict(family), "trace_seed": trace_seed}
        row.update({p: {k: v for k, v in next(rates).items() if k in ("vram_hit", "ram_hit")} for p in policies})
        rows.append(row)
    return rows


def summary(rows: list[dict], policies: tuple[str, ...], tie: float = TIE) -> dict:
    """Per policy but lru, per shape: how often it loses to lru beyond a tie, its worst gap to lru and to the
    family's best policy, and its mean gain over lru (VRAM hit)."""
    out = {}
    for policy in (p for p in policies if p != "lru"):
        out[policy] = {}
        for shape in sorted({r["shape"] for r in rows}):
            mine = [r for r in rows if r["shape"] == shape]
            vs_lru = [r[policy]["vram_hit"] - r["lru"]["vram_hit"] for r in mine]
            vs_best = [r[policy]["vram_hit"] - max(r[p]["vram_hit"] for p in policies) for r in mine]
            worst = min(range(len(mine)), key=lambda i: vs_lru[i])
            out[policy][shape] = {
                "families": len(mine),
                "losses_to_lru": sum(d < -tie for d in vs_lru),
                "worst_vs_lru": round(vs_lru[worst], 4),
                "worst_vs_lru_family": mine[worst]["family"],
                "mean_vs_lru": round(float(np.mean(vs_lru)), 4),
                "worst_vs_best": round(min(vs_best), 4),
                "mean_vs_best": round(float(np.mean(vs_best)), 4),
            }
    return out


def markdown(result: dict) -> str:
    """The summary as one Markdown table: a row per policy and shape."""
    lines = [
        "| policy | shape | families | lost to lru (> tie) | worst vs lru | mean vs lru | worst vs best "
        "| mean vs best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, shapes in result["summary"].items():
        for shape, v in shapes.items():
            lines.append(
                f"| {policy} | {shape} | {v['families']} | {v['losses_to_lru']} | {v['worst_vs_lru']:+.4f} "
                f"({v['worst_vs_lru_family']}) | {v['mean_vs_lru']:+.4f} | {v['worst_vs_best']:+.4f} | "
                f"{v['mean_vs_best']:+.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", type=int, default=40, help="how many families to draw")
    ap.add_argument("--seed", type=int, default=2026, help="seed of the draws (and, +1 on, of the traces)")
    ap.add_argument("--tokens", type=int, default=2400, help="tokens per trace (several shifts at the slowest)")
    ap.add_argument("--layers", type=int, default=3, help="layers per trace (each layer is its own table)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (one simulation each)")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    args = ap.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    try:
        for p in policies:
            sim_eviction.parse_policy(p)
        if "lru" not in policies or len(policies) < 2:
            raise sim_eviction.SlotTableError("--policies must hold lru and at least one more")
        if args.families < 1 or args.tokens < 1 or args.layers < 1:
            raise traces.TraceError("--families, --tokens and --layers must be at least 1")
        started = time.perf_counter()
        rows = run(args.families, args.seed, args.tokens, args.layers, policies, max(1, args.workers))
    except (sim_eviction.SlotTableError, traces.TraceError) as e:
        print(f"sim_holdout: {e}", file=sys.stderr)
        return 2
    result = {
        "command": "python scripts/sim_holdout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "box": {"alpha": ALPHA, "keep": KEEP, "stationary_share": STATIONARY_SHARE, "shift_every": SHIFT_EVERY,
                "shift_share": SHIFT_SHARE, "corr": CORR},
        "policies": list(policies),
        "tie": TIE,
        "summary": summary(rows, policies),
        "results": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    print(markdown(result), end="")
    if args.out:
        args.out.write_text(dumps(result))
    return 0


def dumps(result: dict) -> str:
    """JSON with one line a result row (the file stays small enough for the repository: 120 rows a run)."""
    head = json.dumps({k: v for k, v in result.items() if k != "results"}, indent=1)
    rows = ",\n".join("  " + json.dumps(r) for r in result["results"])
    return head[: -len("\n}")] + ',\n "results": [\n' + rows + "\n ]\n}\n"


if __name__ == "__main__":
    sys.exit(main())
