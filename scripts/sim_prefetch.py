"""Next-layer prefetch replayed over routing traces with the pager's own decision code: what it copies.

Per token, layer by layer as the device-driven pager runs: `SlotTable.acquire` for the layer's
ids (the demand copies), then `SlotTable.admit` of the predictions for the next layer (the
prefetch copies), the torch reference the Triton kernels are tested to equal bit for bit. The
predictions are the trace's own at a stated recall and precision (bigmoe_bench.traces.predictions:
the wrong ids are drawn uniformly from the experts the step does not need, which is pessimistic:
a real router's near misses are popular experts, often resident already). Time is not simulated:
copies per token are what a GPU run pays for, and prefetch can only win back the compute time it
hides them behind (docs/benchmarks.md, the H200 harness run).

    PYTHONPATH=pager:bench python scripts/sim_prefetch.py --tokens 600 --layers 3 --out /tmp/sim_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import traces
from bigmoe_pager.core import stats
from bigmoe_pager.core.slots import SlotTable

RECORD = 1  # admit counts bytes as experts x record bytes: count experts


@dataclass(frozen=True)
class Case:
    """One simulated configuration."""

    family: str
    experts: int
    top_k: int
    vram: int
    recall: float | None
    """None: no prefetch (the baseline)."""
    precision: float


def simulate(trace: np.ndarray, predicted: np.ndarray | None, experts: int, vram: int, policy: str) -> dict:
    """Per token: demand copies, prefetch copies, prefetched experts never used, and the VRAM hit rate."""
    tokens, layers, _ = trace.shape
    ids = torch.from_numpy(np.ascontiguousarray(trace, dtype=np.int64))
    pred = None if predicted is None else torch.from_numpy(np.ascontiguousarray(predicted, dtype=np.int64))
    tables = [SlotTable(experts, vram, policy=policy, use_kernel=False) for _ in range(layers)]
    rows = torch.zeros(layers, len(stats.COUNTERS), dtype=torch.int64)
    lookups = hits = demand = 0
    for t in range(tokens):
        for layer in range(layers):
            got = tables[layer].acquire(ids[t, layer])
            lookups += int(got.lookups)
            hits += int(got.hits)
            demand += int(got.loaded)
            if pred is not None and layer + 1 < layers:
                tables[layer + 1].admit(pred[t, layer], stats_row=rows[layer + 1], record_bytes=RECORD)
    prefetched = int(rows[:, stats.COUNTERS.index("prefetched")].sum())
    wasted = int(rows[:, stats.COUNTERS.index("prefetch_wasted_bytes")].sum())
    return {
        "vram_hit": round(hits / lookups, 4),
        "demand_copies_per_token": round(demand / tokens, 3),
        "prefetch_copies_per_token": round(prefetched / tokens, 3),
        "prefetched_unused_per_token": round(wasted / tokens, 3),
        "copies_per_token": round((demand + prefetched) / tokens, 3),
    }


RECORDED = (64, 8, (26, 16))
"""The recorded trace's experts, top-k and VRAM slots: the benchmark's 40% and 12.5% shares, at least 2k slots."""


def cases(families: list[str], recalls: list[float], precisions: list[float]) -> list[Case]:
    """The Qwen3.6-shaped 40-layer benchmark's tables (256 experts, top-8) at 102 and 32 VRAM slots."""
    out = []
    for family in families:
        experts, k, sizes = RECORDED if family == "recorded" else (256, 8, (102, 32))
        for vram in sizes:
            out.append(Case(family, experts, k, vram, None, 1.0))
            out += [Case(family, experts, k, vram, r, p) for r in recalls for p in precisions]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--layers", type=int, default=3, help="consecutive layers simulated (each its own table)")
    p.add_argument("--families", default="standard,topic-shift,near-uniform,recorded")
    p.add_argument("--recalls", default="0.6,0.8,1.0")
    p.add_argument("--precisions", default="0.5,0.8,1.0")
    p.add_argument("--policy", default="lfu-fast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    rows = []
    traces_by_family = {}
    for case in cases(args.families.split(","), _floats(args.recalls), _floats(args.precisions)):
        if case.family not in traces_by_family:
            whole = traces.named_trace(case.family, args.tokens, args.layers, case.experts, case.top_k, args.seed)
            traces_by_family[case.family] = whole[: args.tokens, : args.layers]  # the recorded one has its own size
        trace = traces_by_family[case.family]
        predicted = (
            None
            if case.recall is None
            else traces.predictions(trace, case.recall, case.precision, case.experts, seed=args.seed)
        )
        row = {**case.__dict__, **simulate(trace, predicted, case.experts, case.vram, args.policy)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        report = {"command": " ".join(["sim_prefetch.py", *(argv if argv is not None else sys.argv[1:])])}
        args.out.write_text(json.dumps({**report, "policy": args.policy, "rows": rows}, indent=1) + "\n")
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


if __name__ == "__main__":
    sys.exit(main())
