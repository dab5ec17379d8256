"""A recorded trace's own live proposals, replayed through the RAM tier's admit and gates at each read-ahead depth.

    PYTHONPATH=pager:bench python scripts/sim_live_depths.py TRACE.npz [--experts E] [--slots 27] [--depths 1,2,4]

TRACE is one that an eager vLLM run wrote with BIGMOE_PREDICT=router, BIGMOE_TRACE_PATH and
BIGMOE_SSD_READ_AHEAD_LAYERS=D (docs/routing.md, "Further ahead"): its predicted_ids and predicted_ids_ahead are what
the live predictor proposed one to D layers ahead. scripts/sim_prefetch.py's `simulate` replays them, layer by layer,
through one SlotTable a layer (the torch reference of the pager's kernels), as the RAM tier admits reads ahead:
per depth, with a gate a depth (the pager's since session 67) and with one gate for all (before), against no reads
ahead. Copies are disk reads here: demand ones are those a step waits for, the rest are reads ahead. Time is not
simulated. --slots defaults to sim_prefetch's SHAPES["flash-next-ram"] share for the trace's expert count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from bigmoe_bench.traces import TraceError
from bigmoe_pager.core.slots import READ_AHEAD_MIN_USED_PERCENT
from score_predictor import read
from sim_prefetch import SHAPES, simulate

POLICY = "lfu-duel"  # the pager's default eviction
RAM_SHARE = SHAPES["flash-next-ram"][0][2][0] / SHAPES["flash-next-ram"][0][0]  # the reference job's RAM tier: 218/512


def rows(trace: Path, experts: int | None, slots: int | None, depths: list[int]) -> list[dict]:
    """No reads ahead, then each depth with a gate a depth and with one gate, over the trace's own proposals."""
    topk, predicted, deeper, experts = read(trace, experts)  # checked as score_predictor checks it
    held = 1 + (0 if deeper is None else deeper.shape[0])
    if max(depths) > held:
        raise TraceError(
            f"trace {trace} holds proposals up to {held} layer(s) ahead, --depths asks {max(depths)}: record it "
            f"with BIGMOE_SSD_READ_AHEAD_LAYERS={max(depths)}"
        )
    slots = slots or max(1, round(experts * RAM_SHARE))
    table = (experts, slots, POLICY, READ_AHEAD_MIN_USED_PERCENT, 0, None)  # reads ahead: no budget, no lift
    out = [{"depth": 0, "gates": None, **simulate(topk, None, *table)}]
    for depth in depths:
        further = None if depth == 1 else np.ascontiguousarray(deeper[: depth - 1])
        for one_gate in (False, True) if depth > 1 else (False,):
            got = simulate(topk, predicted, *table, deeper=further, one_gate=one_gate)
            out.append({"depth": depth, "gates": "one for all" if one_gate else "one a depth", **got})
    for row in out:
        row.update(experts=experts, slots=slots)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="a .npz with topk_ids, predicted_ids and predicted_ids_ahead")
    p.add_argument("--experts", type=int, help="experts a layer (default: the trace's largest id + 1)")
    p.add_argument("--slots", type=int, help="RAM slots a layer (default: the reference job's share, 218 of 512)")
    p.add_argument("--depths", default="1,2,4", help="read-ahead depths simulated (BIGMOE_SSD_READ_AHEAD_LAYERS)")
    p.add_argument("--out", type=Path, help="write the rows as JSON")
    args = p.parse_args(argv)
    try:
        depths = [int(d) for d in args.depths.split(",")]
        if min(depths) < 1 or (args.slots is not None and args.slots < 1) or (args.experts or 1) < 1:
            raise ValueError("--depths, --slots and --experts take positive integers")
        got = rows(args.trace, args.experts, args.slots, depths)
    except (ValueError, TraceError) as e:
        print(f"sim_live_depths: {e}", file=sys.stderr)
        return 2
    for row in got:
        print(json.dumps(row), flush=True)
    if args.out:
        report = {"command": " ".join(["sim_live_depths.py", *(argv if argv is not None else sys.argv[1:])])}
        args.out.write_text(json.dumps({**report, "policy": POLICY, "rows": got}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
