"""Eviction policies replayed over routing traces with the pager's own decision code.

Every step of every layer runs `SlotTable.acquire` (the torch reference the Triton
kernels are tested against, bit for bit), so the hit rates are the ones the
device-driven pager gets, not a model of it. Two tiers when RAM slots < experts: the
RAM table sees the VRAM misses, as ExpertPager.acquire feeds RamTier.locate.

Policies are written `name` or `name:decay` (lfu's halving period in steps). Every trace
is cut to --tokens x --layers (the recorded one too); layers are independent tables.
Shapes: the 40-layer Qwen3.6-shaped benchmark (256 experts, top-8) at 32 and 102 VRAM
slots and 32 VRAM / 128 RAM; Qwen3.8-Flash-Next (512 experts, top-10) at the slots
`bigmoe plan qwen3.8-flash-next --vram-gib 24 --ram-gib 64 --disk nvme` chooses.

    PYTHONPATH=pager:bench python scripts/sim_eviction.py --tokens 1200 --layers 3 --out docs/bench/eviction.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.slots import POLICIES as SLOT_POLICIES  # noqa: E402
from bigmoe_pager.core.slots import SlotTable, SlotTableError

POLICIES = ("lru", "lfu", "lfu-fast", "lfu:32")
"""The pager's policies (lfu halves its counts every 256 steps, lfu-fast every 16) and an lfu in between."""


@dataclass(frozen=True)
class Shape:
    """One model shape and tier sizes to simulate."""

    name: str
    experts: int
    top_k: int
    vram: int
    ram: int
    """RAM slots per layer; == experts when RAM holds them all."""


SHAPES = (
    Shape("qwen3.6-40l/32", 256, 8, 32, 256),
    Shape("qwen3.6-40l/102", 256, 8, 102, 256),
    Shape("qwen3.6-40l/32+ram128", 256, 8, 32, 128),
    Shape("flash-next-4090-64g/35+ram218", 512, 10, 35, 218),
)


def shape_row(family: str, shape: Shape) -> dict:
    """The columns that name a result row: routing family, shape and tier sizes."""
    return {
        "family": family,
        "shape": shape.name,
        "experts": shape.experts,
        "top_k": shape.top_k,
        "vram_slots": shape.vram,
        "ram_slots": shape.ram,
    }


def parse_policy(spec: str) -> tuple[str, int | None]:
    """'lfu-fast' -> ('lfu-fast', None): the policy's own decay; 'lfu:64' -> ('lfu', 64)."""
    name, _, decay = spec.partition(":")
    if name not in SLOT_POLICIES or (decay and not decay.isdigit()):
        raise SlotTableError(f"policy {spec!r}: write one of {', '.join(SLOT_POLICIES)}, or lfu:DECAY")
    return name, int(decay) if decay else None


def simulate(trace: np.ndarray, experts: int, vram: int, ram: int, policy: str) -> dict[str, float]:
    """Hit rates and misses per token of one policy over a trace [tokens, layers, k], one table pair per layer."""
    name, decay = parse_policy(policy)
    tokens, layers, _ = trace.shape
    ids = torch.from_numpy(np.ascontiguousarray(trace, dtype=np.int64))
    lookups = vram_hits = ram_hits = 0
    for layer in range(layers):
        top = SlotTable(experts, vram, policy=name, decay=decay, use_kernel=False)
        below = SlotTable(experts, ram, policy=name, decay=decay, use_kernel=False) if ram < experts else None
        for t in range(tokens):
            got = top.acquire(ids[t, layer])
            lookups += int(got.lookups)
            vram_hits += int(got.hits)
            if below is None:
                ram_hits += int(got.misses)
            else:
                ram_hits += int(below.acquire(got.miss_experts).hits)
    misses = lookups - vram_hits
    return {
        "vram_hit": round(vram_hits / lookups, 4),
        "ram_hit": round((vram_hits + ram_hits) / lookups, 4),
        "vram_misses_per_token": round(misses / tokens, 3),
        "ssd_reads_per_token": round((misses - ram_hits) / tokens, 3),
    }


def family_traces(tokens: int, layers: int, seed: int) -> dict[tuple[str, str], np.ndarray]:
    """(family, shape name) -> trace; the recorded trace serves every shape at its own size."""
    out = {}
    for family in traces.FAMILIES:
        for experts, k in sorted({(s.experts, s.top_k) for s in SHAPES}):
            trace = traces.named_trace(family, tokens, layers, experts, k, seed)
            for shape in SHAPES:
                if (shape.experts, shape.top_k) == (experts, k):
                    out[(family, shape.name)] = trace
    return out


def scaled(shape: Shape, experts: int, k: int) -> Shape:
    """The shape's tier shares applied to another expert count (the recorded trace's), with at least 2k VRAM slots."""
    vram = max(2 * k, round(shape.vram / shape.experts * experts))  # at k slots every policy is the same
    ram = max(vram, round(shape.ram / shape.experts * experts))
    return Shape(shape.name, experts, k, vram, ram)


def cases(tokens: int, layers: int, seed: int, families: tuple[str, ...]) -> list[tuple[str, Shape, np.ndarray]]:
    """(family, shape, trace) for every family of `families` and shape; the recorded trace at its own size."""
    found = [
        (fam, shape, trace)
        for (fam, name), trace in family_traces(tokens, layers, seed).items()
        for shape in SHAPES
        if shape.name == name and fam in families
    ]
    if "recorded" in families:
        recorded = traces.load_trace(traces.RECORDED)[:tokens, :layers]
        r_experts, r_k = int(recorded.max()) + 1, recorded.shape[2]
        found += [("recorded", scaled(shape, r_experts, r_k), recorded) for shape in SHAPES]
    return found


def run(
    tokens: int, layers: int, seed: int, policies: tuple[str, ...], workers: int, families: tuple[str, ...]
) -> list:
    cases_ = cases(tokens, layers, seed, families)
    jobs = [(trace, shape.experts, shape.vram, shape.ram, p) for _, shape, trace in cases_ for p in policies]
    with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        rates = iter(pool.starmap(simulate, jobs, chunksize=1))
    results = []
    for family, shape, trace in cases_:
        row = shape_row(family, shape) | {"tokens": trace.shape[0], "layers": trace.shape[1]}
        row.update({policy: next(rates) for policy in policies})
        results.append(row)
        print(
            json.dumps({k: row[k] for k in ("family", "shape")} | {p: row[p]["vram_hit"] for p in policies}), flush=True
        )
    return results


CURVE_SLOTS_PER_K = (0.5, 1, 2, 4, 8, 12.75, 19, 25.5)
"""Slots / top-k at which `curves` measures hit rates (256 experts, top-8: 4 .. 204 slots)."""
CURVE_POLICIES = ("lru", "lfu-fast", "lfu-duel")
"""--curve-policies' default: lru, the old default lfu-fast, and the default lfu-duel."""


def curves(tokens: int, layers: int, seed: int, workers: int, policies: tuple[str, ...] = CURVE_POLICIES) -> dict:
    """Per family and policy, VRAM hit rate against slots / top-k on the 256-expert top-8 shape: the
    curves bigmoe plan's speed estimate reads (app/bigmoe/plan/speed.py HIT_CURVES)."""
    experts, k = 256, 8
    cases = [(f, traces.named_trace(f, tokens, layers, experts, k, seed)) for f in traces.FAMILIES]
    jobs = [
        (trace, experts, max(1, round(x * k)), experts, p)
        for _, trace in cases
        for p in policies
        for x in CURVE_SLOTS_PER_K
    ]
    with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        rates = iter(pool.starmap(simulate, jobs, chunksize=1))
    return {f: {p: [[x, next(rates)["vram_hit"]] for x in CURVE_SLOTS_PER_K] for p in policies} for f, _ in cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1200, help="tokens per trace")
    ap.add_argument("--layers", type=int, default=3, help="layers per trace (each layer is its own table)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (one simulation each)")
    ap.add_argument("--families", default=",".join([*traces.FAMILIES, "recorded"]), help="comma list of families")
    ap.add_argument(
        "--curves",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the hit-rate curves of the synthetic families (plan/speed.py's HIT_CURVES)",
    )
    ap.add_argument(
        "--curve-policies", default=",".join(CURVE_POLICIES), help="comma list of the policies the curves measure"
    )
    ap.add_argument("--merge", type=Path, help="start from this result file, replacing the families run now")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--markdown", type=Path, help="also write the results as a Markdown table")
    args = ap.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    families = tuple(f for f in args.families.split(",") if f)
    try:
        for p in policies:
            parse_policy(p)
        unknown = set(families) - {*traces.FAMILIES, "recorded"}
        if unknown:
            raise traces.TraceError(
                f"unknown families {sorted(unknown)}; choose from {', '.join([*traces.FAMILIES, 'recorded'])}"
            )
        started = time.perf_counter()
        result = _previous(args.merge) if args.merge else {}
        kept = [r for r in result.get("results", []) if r["family"] not in families]
        result.update(
            policies=list(policies),
            families={**{f: vars(p) for f, p in traces.FAMILIES.items()}, "recorded": traces.RECORDED.name},
        )
        result["results"] = kept + run(args.tokens, args.layers, args.seed, policies, max(1, args.workers), families)
        if args.curves:
            chosen = tuple(p for p in args.curve_policies.split(",") if p)
            for p in chosen:
                parse_policy(p)
            measured = curves(args.tokens, args.layers, args.seed, max(1, args.workers), chosen)
            old = result.get("curves_256x8", {})
            result["curves_256x8"] = {f: {**old.get(f, {}), **by_policy} for f, by_policy in measured.items()}
    except (SlotTableError, traces.TraceError) as e:
        print(f"sim_eviction: {e}", file=sys.stderr)
        return 2
    command = "python scripts/sim_eviction.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["commands"] = result.get("commands", []) + [command]
    result["seconds"] = round(result.get("seconds", 0) + time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    return 0


def markdown(result: dict) -> str:
    """The results as a Markdown table: VRAM hit (and VRAM-or-RAM hit where RAM is partial) per policy."""
    policies = result["policies"]
    lines = [
        "| family | shape | slots (VRAM / RAM of experts, top-k) | " + " | ".join(policies) + " |",
        "|---|---|---|" + "---|" * len(policies),
    ]
    for r in result["results"]:
        cells = []
        for p in policies:
            hit = r[p]
            cells.append(
                f"{hit['vram_hit']:.4f}" + (f" / {hit['ram_hit']:.4f}" if r["ram_slots"] < r["experts"] else "")
            )
        best = max(r[p]["vram_hit"] for p in policies)
        cells = [f"**{c}**" if r[p]["vram_hit"] == best else c for c, p in zip(cells, policies)]
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['vram_slots']} / {r['ram_slots']} of {r['experts']}, "
            f"top-{r['top_k']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def _previous(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise traces.TraceError(f"--merge {path}: not a readable result ({e})") from None


if __name__ == "__main__":
    sys.exit(main())
