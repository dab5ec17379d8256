"""How far the pager's eviction is from the offline reference: Belady's farthest-next-use rule, per routing family.

Each layer's table sees one step's set of distinct experts at a time (a decode step's top-k ids). Belady's rule,
which knows the whole trace, keeps every expert the step needs and, for each miss with no free slot, evicts the
resident expert whose next use lies farthest ahead (never used again: first). No online policy can beat it on a
trace; its VRAM hit rate is the ceiling any eviction policy could reach, so the gap to it says how much is left to
win by eviction and how much only prefetch or more slots can give. The online rows are sim_eviction.simulate's (the
pager's own SlotTable.acquire), over the same traces.

    PYTHONPATH=pager:bench python scripts/sim_belady.py --tokens 1200 --layers 3 --out docs/bench/eviction-belady.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import traces
from sim_eviction import Shape, cases, simulate

FAMILIES = (*traces.FAMILIES, "recorded")
"""The synthetic families and the trace recorded from the tiny model in vLLM."""
ONLINE = ("lru", "lfu-duel")
"""The online policies set beside the reference: the old default and today's."""
NEVER = np.iinfo(np.int64).max


def needed_sets(layer_trace: np.ndarray, experts: int) -> list[np.ndarray]:
    """Per step, the distinct valid expert ids of one layer's rows [tokens, k] (what a step looks up)."""
    return [np.unique(row[(row >= 0) & (row < experts)]) for row in layer_trace]


def next_uses(steps: list[np.ndarray], experts: int) -> np.ndarray:
    """int64 [steps, experts]: the first step after t that needs e (NEVER where none does)."""
    out = np.full((len(steps), experts), NEVER, dtype=np.int64)
    upcoming = np.full(experts, NEVER, dtype=np.int64)
    for t in range(len(steps) - 1, -1, -1):
        out[t] = upcoming
        upcoming[steps[t]] = t
    return out


def belady(layer_trace: np.ndarray, experts: int, slots: int) -> tuple[int, int]:
    """(lookups, hits) of Belady's farthest-next-use rule over one layer's trace [tokens, k] with `slots` slots."""
    steps = needed_sets(layer_trace, experts)
    ahead = next_uses(steps, experts)
    resident = np.zeros(experts, dtype=bool)
    lookups = hits = 0
    for t, need in enumerate(steps):
        lookups += need.size
        present = resident[need]
        hits += int(present.sum())
        missing = need[~present]
        over = int(resident.sum()) + missing.size - slots
        if over > 0:
            held = np.flatnonzero(resident)
            candidates = held[~np.isin(held, need)]
            # farthest next use first; ties (never used again) by id, so runs repeat
            order = np.lexsort((candidates, -ahead[t, candidates]))
            resident[candidates[order[:over]]] = False
        resident[missing] = True
    return lookups, hits


def reference(trace: np.ndarray, experts: int, vram: int) -> dict[str, float]:
    """Belady's VRAM hit rate and misses per token over a trace [tokens, layers, k], one table per layer."""
    lookups = hits = 0
    for layer in range(trace.shape[1]):
        got = belady(trace[:, layer], experts, vram)
        lookups, hits = lookups + got[0], hits + got[1]
    return {"vram_hit": round(hits / lookups, 4), "vram_misses_per_token": round((lookups - hits) / trace.shape[0], 3)}


def _row(family: str, shape: Shape, trace: np.ndarray) -> dict:
    torch.set_num_threads(1)
    row = {"family": family, "shape": shape.name, "experts": shape.experts, "top_k": shape.top_k}
    row |= {"vram_slots": shape.vram, "tokens": trace.shape[0], "layers": trace.shape[1]}
    row["belady"] = reference(trace, shape.experts, shape.vram)
    for policy in ONLINE:  # VRAM tier alone: RAM holds every expert
        row[policy] = simulate(trace, shape.experts, shape.vram, shape.experts, policy)
    row["headroom"] = round(row["belady"]["vram_hit"] - max(row[p]["vram_hit"] for p in ONLINE), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1200)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    families = tuple(f for f in args.families.split(",") if f)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or args.tokens < 1 or args.layers < 1:
        print(f"sim_belady: unknown family {unknown} or no tokens/layers", file=sys.stderr)
        return 2
    seen, jobs = set(), []
    for family, shape, trace in cases(args.tokens, args.layers, args.seed, families):
        if (family, shape.experts, shape.vram) not in seen:  # RAM-tier shapes repeat a VRAM size: once each
            seen.add((family, shape.experts, shape.vram))
            jobs.append((family, shape, trace))
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        rows = pool.starmap(_row, jobs, chunksize=1)
    for row in rows:
        print(json.dumps({k: row[k] for k in ("family", "shape", "headroom")} | {"belady": row["belady"]["vram_hit"]}))
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv, "online": ONLINE, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
