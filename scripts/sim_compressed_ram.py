"""What a compressed RAM tier would do to the SSD tier's reads: the same RAM bytes holding records of ratio r.

A RAM tier of compressed records (DESIGN.md's codec goal, not built; docs/codec.md "Where it would cut in") holds
1/r as many experts in the same bytes, and each SSD read brings r of the raw bytes. This replays the eviction
simulation (sim_eviction.simulate: the pager's own SlotTable decisions, VRAM table over RAM table) for every shape of
sim_eviction.SHAPES with a partial RAM tier, with RAM slots floor(R / r) for each ratio r, on every routing family,
and reports SSD reads and SSD bytes per token against raw records (r = 1). Ratios: the codec's Student-t records at
16 x 128 lanes (0.848) and 128 x 16 (0.862), docs/bench/codec-geometry-cpu.json; the slot pitch would be the
layer's largest record, a little above the mean.

    PYTHONPATH=pager:bench:scripts python scripts/sim_compressed_ram.py --out docs/bench/sim-compressed-ram.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch
from bigmoe_bench import traces
from sim_eviction import Shape, cases, shape_row, simulate

RATIOS = (1.0, 0.862, 0.848)
"""Raw records, then the codec's Student-t ratio at 128 x 16 and at 16 x 128 lanes."""
POLICY = "lfu-duel"
"""The pager's default eviction."""


def run(tokens: int, layers: int, seed: int, ratios: tuple[float, ...], families: tuple[str, ...], workers: int):
    """A row per (family, shape with a partial RAM tier, ratio)."""
    found = [
        (f, shape, trace) for f, shape, trace in cases(tokens, layers, seed, families) if shape.ram < shape.experts
    ]
    grid = [(f, with_ram(shape, r), trace, r) for f, shape, trace in found for r in ratios]
    jobs = [(trace, s.experts, s.vram, s.ram, POLICY) for _, s, trace, _ in grid]
    with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        rates = pool.starmap(simulate, jobs, chunksize=1)
    rows = [shape_row(family, shape) | {"ratio": ratio, **rate} for (family, shape, _, ratio), rate in zip(grid, rates)]
    for row in rows:  # against the same family and shape with raw records
        raw = next(r for r in rows if (r["family"], r["shape"], r["ratio"]) == (row["family"], row["shape"], 1.0))
        reads = row["ssd_reads_per_token"] / raw["ssd_reads_per_token"] if raw["ssd_reads_per_token"] else 1.0
        row["ssd_reads_vs_raw"] = round(reads, 4)
        row["ssd_bytes_vs_raw"] = round(reads * row["ratio"], 4)
    return rows


def with_ram(shape: Shape, ratio: float) -> Shape:
    """The shape with RAM slots for records of `ratio` in the same bytes (at most every expert)."""
    return Shape(shape.name, shape.experts, shape.top_k, shape.vram, min(shape.experts, int(shape.ram / ratio)))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| family | shape | ratio | RAM slots | VRAM-or-RAM hit | SSD reads / token | SSD reads vs raw"
        " | SSD bytes vs raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['ratio']:g} | {r['ram_slots']} of {r['experts']} | {r['ram_hit']:.4f}"
            f" | {r['ssd_reads_per_token']:.3f} | {r['ssd_reads_vs_raw']:.3f} | {r['ssd_bytes_vs_raw']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1200, help="tokens per trace")
    ap.add_argument("--layers", type=int, default=3, help="layers per trace (each layer is its own table pair)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="compressed / raw, comma list")
    ap.add_argument("--families", default=",".join([*traces.FAMILIES, "recorded"]), help="comma list of families")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (one simulation each)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    ap.add_argument("--markdown", type=Path, help="also write them as a Markdown table")
    args = ap.parse_args(argv)
    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
        if 1.0 not in ratios or not all(0 < r <= 1 for r in ratios):
            raise ValueError
    except ValueError:
        ap.error(f"--ratios {args.ratios!r}: a comma list of ratios in (0, 1], 1 among them (raw records)")
    families = tuple(f for f in args.families.split(",") if f)
    unknown = set(families) - {*traces.FAMILIES, "recorded"}
    if unknown:
        ap.error(f"--families: unknown {sorted(unknown)}; choose from {', '.join([*traces.FAMILIES, 'recorded'])}")
    rows = run(args.tokens, args.layers, args.seed, ratios, families, max(1, args.workers))
    command = "python scripts/sim_compressed_ram.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        args.out.write_text(json.dumps({"command": command, "policy": POLICY, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
