"""Next-layer prefetch replayed over routing traces with the pager's own decision code: what it copies.

Per token, layer by layer as the device-driven pager runs: `SlotTable.acquire` for the layer's
ids (the demand copies), then `SlotTable.admit` of the predictions for the next layer (the
prefetch copies), the torch reference the Triton kernels are tested to equal bit for bit. The
predictions are the trace's own at a stated recall and precision (bigmoe_bench.traces.predictions:
with --wrong uniform (the default) the wrong ids are drawn evenly from the experts the step does not
need, which is pessimistic: a real router's near misses are popular experts, often resident already;
--wrong popular draws them in proportion to how often the layer uses each; precision `topk` is a top-k
predictor's k ids a token, precision = recall). Each prediction case runs with admit's usefulness gate
at each of --gates (min_used_percent; 0 = no gate) and each of --budgets (prefetch_budget: experts a round
copies at most, the most used first; 0 = none), a budget lifted while --lift percent of the gate's judged copies were
used (slots.LIFT_PERCENT; none: never); gate_closed is the share of rounds it closed. --shape picks the tables
(SHAPES): the 40-layer benchmark's VRAM tables, or the reference job's RAM tier, whose SSD reads ahead the same admit
and gate decide (its copies are then disk reads). --ahead-depth D also admits, after layer l's step, proposals made
there for layers l+2 .. l+D into those layers' tables, as BIGMOE_SSD_READ_AHEAD_LAYERS=D posts reads ahead: at recall
minus --ahead-drop per layer past the next (traces.deeper_predictions), or with a drop of 0 layer l+d-1's next-layer
proposals, as the pager replays a trace without its own rows that far ahead. Each depth's admits have their own gate
(SlotTable gates, as the RAM tier keeps them since session 67); --one-gate judges them all together, as before.
Time is not simulated: copies per token are what a GPU run pays for, and prefetch can only win back
the compute time it hides them behind (docs/benchmarks.md, the H200 harness run).

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
from bigmoe_pager.core.slots import LIFT_PERCENT, MIN_USED_PERCENT, PREFETCH_BUDGET, SlotTable

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
    precision: float | None
    """None: a top-k predictor's proposal (k ids per token, precision = recall)."""
    min_used_percent: int | None
    """The prefetch gate's threshold (0: no gate); None for the baseline."""
    budget: int | None = None
    """Experts one prefetch round copies at most (0: no limit); None for the baseline."""


def as_tensors(trace: np.ndarray, predicted: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trace's ids and proposals as int64 tensors, as SlotTable takes them."""
    ids = torch.from_numpy(np.ascontiguousarray(trace, dtype=np.int64))
    return ids, None if predicted is None else torch.from_numpy(np.ascontiguousarray(predicted, dtype=np.int64))


def layer_tables(
    layers: int,
    experts: int,
    vram: int,
    policy: str,
    min_used_percent: int = MIN_USED_PERCENT,
    budget: int = PREFETCH_BUDGET,
    lift: int | None = LIFT_PERCENT,
    gates: int = 1,
) -> list[SlotTable]:
    """One slot table a layer, deciding with the torch reference the Triton kernels are tested to equal; gates: the
    depths whose admits each table judges apart (SlotTable)."""
    return [
        SlotTable(
            experts,
            vram,
            policy=policy,
            use_kernel=False,
            min_used_percent=min_used_percent,
            prefetch_budget=budget,
            lift_percent=lift,
            gates=gates,
        )
        for _ in range(layers)
    ]


def simulate(
    trace: np.ndarray,
    predicted: np.ndarray | None,
    experts: int,
    vram: int,
    policy: str,
    min_used_percent: int = MIN_USED_PERCENT,
    budget: int = PREFETCH_BUDGET,
    lift: int | None = LIFT_PERCENT,
    deeper: np.ndarray | None = None,
    one_gate: bool = False,
) -> dict:
    """Per token: demand copies, prefetch copies, prefetched experts never used, and the VRAM hit rate;
    gate_closed: share of the prefetch rounds the gate closed; peak_prefetch_per_token: the most prefetch copies one
    token made after the first (whose round every gate opens: no evidence yet). deeper: [depths, tokens, layers, P]
    proposals made at layer l for l+2, l+3, ..., admitted after the next layer's (needs `predicted`), each depth
    gated apart unless one_gate."""
    tokens, layers, _ = trace.shape
    ids, pred = as_tensors(trace, predicted)
    deep = None if deeper is None or pred is None else torch.from_numpy(np.ascontiguousarray(deeper, dtype=np.int64))
    depths = 1 + (0 if deep is None else deep.shape[0])
    tables = layer_tables(layers, experts, vram, policy, min_used_percent, budget, lift, 1 if one_gate else depths)
    rows = torch.zeros(layers, len(stats.COUNTERS), dtype=torch.int64)
    lookups = hits = demand = peak = 0
    prefetched_col = rows[:, stats.COUNTERS.index("prefetched")]  # a view: it follows the admits
    for t in range(tokens):
        before = int(prefetched_col.sum())
        for layer in range(layers):
            got = tables[layer].acquire(ids[t, layer])
            lookups += int(got.lookups)
            hits += int(got.hits)
            demand += int(got.loaded)
            if pred is not None and layer + 1 < layers:
                tables[layer + 1].admit(pred[t, layer], stats_row=rows[layer + 1], record_bytes=RECORD)
            for d in range(2, 2 + (0 if deep is None else deep.shape[0])):
                if layer + d < layers:
                    row = rows[layer + d]
                    tables[layer + d].admit(deep[d - 2, t, layer], stats_row=row, record_bytes=RECORD, depth=d)
        peak = max(peak, int(prefetched_col.sum()) - before) if t else 0
    prefetched = int(rows[:, stats.COUNTERS.index("prefetched")].sum())
    wasted = int(rows[:, stats.COUNTERS.index("prefetch_wasted_bytes")].sum())
    closed = sum(int(r.gate_closed) for t in tables for r in t.rounds)
    rounds = sum(tokens * max(0, layers - d) for d in range(1, depths + 1)) if pred is not None else 0
    return {
        "vram_hit": round(hits / lookups, 4),
        "demand_copies_per_token": round(demand / tokens, 3),
        "prefetch_copies_per_token": round(prefetched / tokens, 3),
        "prefetched_unused_per_token": round(wasted / tokens, 3),
        "copies_per_token": round((demand + prefetched) / tokens, 3),
        "gate_closed": round(closed / rounds, 3) if rounds else None,
        "peak_prefetch_per_token": peak,
    }


SHAPES = {
    "qwen3.6": ((256, 8, (102, 32)), (64, 8, (26, 16))),
    "flash-next-ram": ((512, 10, (218,)), (64, 8, (27,))),
}
"""Tables simulated, as ((experts, top-k, slots...), the recorded trace's (experts, top-k, slots...)). qwen3.6: the
40-layer benchmark's VRAM tables at 102 and 32 slots (40% and 12.5%). flash-next-ram: the reference job's RAM tier a
layer (218 of 512 experts, 42.6%), whose SSD reads ahead the same admit and gate decide (ram_tier.RamTier). The
recorded trace (the tiny model, 64 experts) keeps the same shares, at least 2k slots. A row's `vram` is its table's
slots, whichever tier the table is."""


def cases(
    families: list[str],
    recalls: list[float],
    precisions: list[float | None],
    gates: list[int],
    budgets: list[int],
    shape: str = "qwen3.6",
) -> list[Case]:
    """The tables of one of SHAPES for each family, without prefetch and with each prediction and gate."""
    out = []
    for family in families:
        own, recorded = SHAPES[shape]
        experts, k, sizes = recorded if family == "recorded" else own
        for vram in sizes:
            out.append(Case(family, experts, k, vram, None, None, None))
            out += [
                Case(family, experts, k, vram, r, p, g, b)
                for r in recalls
                for p in precisions
                for g in gates
                for b in budgets
            ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--layers", type=int, default=3, help="consecutive layers simulated (each its own table)")
    p.add_argument("--families", default="standard,topic-shift,near-uniform,recorded")
    p.add_argument("--recalls", default="0,0.6,0.8,1.0")
    p.add_argument("--precisions", default="topk", help="comma list of floats in (0, 1] or topk (k ids a token)")
    # The defaults below are those the committed runs of sessions 12-14 were made with, so their commands reproduce as
    # written; the pager's own are in core.slots (MIN_USED_PERCENT, PREFETCH_BUDGET, LIFT_PERCENT) and the settings.
    p.add_argument(
        "--gates", default="60,0", help=f"prefetch gate thresholds, percent (0: none; the pager's: {MIN_USED_PERCENT})"
    )
    p.add_argument(
        "--budgets",
        default="0",
        help=f"prefetch budgets, experts a round copies at most (0: none; the pager's: {PREFETCH_BUDGET})",
    )
    p.add_argument("--shape", default="qwen3.6", help=f"tables simulated: {', '.join(SHAPES)} (SHAPES)")
    p.add_argument("--wrong", default="uniform", help="how proposals' wrong ids are drawn: uniform, popular or none")
    p.add_argument("--policy", default="lfu-fast", help="eviction policy (the pager's default is lfu-duel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lift",
        default="none",
        help=f"percent of judged copies used at which a round ignores its budget (none: never; pager: {LIFT_PERCENT})",
    )
    p.add_argument(
        "--ahead-depth", type=int, default=1, help="layers ahead each layer's proposals go (1: the next only)"
    )
    p.add_argument(
        "--ahead-drop",
        type=float,
        default=0.0,
        help="recall lost per layer past the next (0: layer l+d-1's next-layer proposals stand in)",
    )
    p.add_argument("--one-gate", action="store_true", help="one gate judges every depth's admits (before session 67)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        if args.shape not in SHAPES:
            raise ValueError(f"--shape takes one of {', '.join(SHAPES)}, got {args.shape!r}")
        if args.wrong not in traces.WRONG_MODELS:
            raise ValueError(f"--wrong takes one of {', '.join(traces.WRONG_MODELS)}, got {args.wrong!r}")
        budgets = _ints(args.budgets)
        if any(b < 0 for b in budgets):
            raise ValueError(f"--budgets are numbers of experts >= 0, got {args.budgets!r}")
        lift = None if args.lift == "none" else _ints(args.lift)
        if lift is not None and (len(lift) != 1 or not 0 <= lift[0] <= 100):
            raise ValueError(f"--lift takes one percent from 0 to 100, or none; got {args.lift!r}")
        lift = None if lift is None else lift[0]
        if args.ahead_depth < 1 or not 0.0 <= args.ahead_drop <= 1.0:
            raise ValueError(
                f"--ahead-depth is at least 1 and --ahead-drop in [0, 1], got {args.ahead_depth}, {args.ahead_drop}"
            )
        grid = cases(
            args.families.split(","),
            _floats(args.recalls),
            _precisions(args.precisions),
            _ints(args.gates),
            budgets,
            args.shape,
        )
    except ValueError as err:
        print(f"sim_prefetch: {err}", file=sys.stderr)
        return 2
    rows = []
    traces_by_family = {}
    for case in grid:
        if case.family not in traces_by_family:
            whole = traces.named_trace(case.family, args.tokens, args.layers, case.experts, case.top_k, args.seed)
            traces_by_family[case.family] = whole[: args.tokens, : args.layers]  # the recorded one has its own size
        trace = traces_by_family[case.family]
        predicted = (
            None
            if case.recall is None
            else traces.predictions(trace, case.recall, case.precision, case.experts, args.seed, args.wrong)
        )
        gate, budget = case.min_used_percent or 0, case.budget or 0
        deeper = None if predicted is None else further_ahead(trace, predicted, case, args)
        tables = (case.experts, case.vram, args.policy, gate, budget, lift)
        got = simulate(trace, predicted, *tables, deeper=deeper, one_gate=args.one_gate)
        row = {**case.__dict__, "lift": lift if case.budget else None, **got}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        report = {"command": " ".join(["sim_prefetch.py", *(argv if argv is not None else sys.argv[1:])])}
        head = {
            **report,
            "shape": args.shape,
            "policy": args.policy,
            "wrong": args.wrong,
            "ahead_depth": args.ahead_depth,
            "ahead_drop": args.ahead_drop,
            "gates": "one for every depth" if args.one_gate else "one a depth",
            "gate": "closed rounds judged from would-fetch marks (session 13)",
        }
        body = ",\n  ".join(json.dumps(r) for r in rows)  # a row a line: small, and diffs read per case
        args.out.write_text(json.dumps(head, indent=1)[:-2] + f',\n "rows": [\n  {body}\n ]\n}}\n')
    return 0


def further_ahead(trace: np.ndarray, predicted: np.ndarray, case: Case, args) -> np.ndarray | None:
    """The proposals for layers 2 .. --ahead-depth ahead of each layer ([depths, tokens, layers, P]; None at depth 1):
    with a drop, made at recall - drop per layer past the next; without, layer l+d-1's next-layer rows (shifted so
    entry [d - 2, t, l] proposes layer l+d), as the pager replays a trace that carries none of its own."""
    if args.ahead_depth < 2:
        return None
    if args.ahead_drop:
        recalls = [max(0.0, case.recall - args.ahead_drop * (d - 1)) for d in range(2, args.ahead_depth + 1)]
        return traces.deeper_predictions(trace, recalls, case.precision, case.experts, args.seed, args.wrong)
    out = np.full((args.ahead_depth - 1, *predicted.shape), -1, dtype=np.int32)
    for d in range(2, args.ahead_depth + 1):
        out[d - 2, :, : predicted.shape[1] - d + 1] = predicted[:, d - 1 :]
    return out


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    return [int(x) for x in _floats(text)]


def _precisions(text: str) -> list[float | None]:
    """Floats, with `topk` for a top-k predictor (None)."""
    return [None if x == "topk" else _floats(x)[0] for x in text.split(",") if x]


if __name__ == "__main__":
    sys.exit(main())
