"""Score a trace's predictions: recall and precision per layer and overall, against chance, at each depth it holds.

    PYTHONPATH=pager:bench python scripts/score_predictor.py TRACE.npz [--experts E] [--json]

TRACE holds topk_ids int32 [tokens, layers, k] and predicted_ids int32 [tokens, layers, P]
(docs/routing.md): row [t, l] of predicted_ids proposes layer l + 1's experts of token t; a trace
may also hold predicted_ids_ahead int32 [depths, tokens, layers, P], whose [d - 2, t, l] proposes
layer l + d's. A vLLM run records them with BIGMOE_TRACE_PATH and BIGMOE_PREDICT=router (the live
predictor; BIGMOE_SSD_READ_AHEAD_LAYERS=D for depths 2..D); `scripts/traces.py --recall` makes
synthetic ones. Per row: recall = share of the target layer's distinct ids the proposal holds,
precision = share of the distinct proposed ids that the target layer used; both summed over rows
before dividing. Chance: a proposal of the same size drawn at random has recall (proposed per row) / E
and precision (used per row) / E. Columns with no proposal at all (the last layers, a layer whose
router ahead was not usable) are left out. The JSON's top level is the next layer's score; its
`further_ahead` lists depths 2.. in the same form, each with its `ahead`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

for part in ("pager", "bench"):  # runs from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / part))

import numpy as np  # noqa: E402
from bigmoe_bench.traces import TraceError, load_predictions, load_predictions_ahead, load_trace  # noqa: E402
from bigmoe_pager.core.prediction import hits  # noqa: E402


def score(topk_ids: np.ndarray, predicted_ids: np.ndarray, experts: int, ahead: int = 1) -> dict:
    """Recall and precision of predicted_ids[:, l] against topk_ids[:, l + ahead], per layer and overall."""
    per_layer = []
    total = np.zeros(3, dtype=np.int64)  # hits, true, proposed
    for layer in range(topk_ids.shape[1] - ahead):
        proposal = predicted_ids[:, layer]
        if not (proposal >= 0).any():
            continue
        counts = np.array(hits(proposal, topk_ids[:, layer + ahead]))
        total += counts
        per_layer.append({"layer": layer, **_ratios(counts)})
    rows = topk_ids.shape[0] * len(per_layer)
    hit, true, proposed = (int(c) for c in total)
    return {
        "tokens": int(topk_ids.shape[0]),
        "layers": int(topk_ids.shape[1]),
        "k": int(topk_ids.shape[2]),
        "P": int(predicted_ids.shape[2]),
        "experts": experts,
        "per_layer": per_layer,
        "overall": _ratios(total),
        "chance": {
            "recall": round(proposed / rows / experts, 4) if rows else None,
            "precision": round(true / rows / experts, 4) if rows else None,
        },
        "counts": {"hits": hit, "true": true, "proposed": proposed},
    }


def _ratios(counts) -> dict:
    hit, true, proposed = (int(c) for c in counts)
    return {
        "recall": round(hit / true, 4) if true else None,
        "precision": round(hit / proposed, 4) if proposed else None,
    }


def score_depths(topk_ids: np.ndarray, predicted_ids: np.ndarray, deeper: np.ndarray | None, experts: int) -> dict:
    """The next layer's score (score()) with `further_ahead`: each depth of `deeper` ([depths, tokens, layers, P],
    entry d - 2 proposing layer l + d's experts) that proposes anything, scored alike, with its `ahead`."""
    further = []
    for ahead, rows in enumerate(deeper if deeper is not None else (), start=2):
        result = score(topk_ids, rows, experts, ahead)
        if result["per_layer"]:
            further.append({"ahead": ahead, **result})
    return {**score(topk_ids, predicted_ids, experts), "further_ahead": further}


def read(path: Path, experts: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(topk_ids, predicted_ids, predicted_ids_ahead or None, experts) of a trace; TraceError with one line when it
    cannot be scored."""
    topk = load_trace(path, experts)
    predicted = load_predictions(path, experts)
    if predicted is None:
        raise TraceError(
            f"trace {path} carries no predicted_ids; record one with BIGMOE_PREDICT=router and BIGMOE_TRACE_PATH "
            "(--enforce-eager), or make one with scripts/traces.py --recall"
        )
    if predicted.shape[:2] != topk.shape[:2]:
        raise TraceError(f"trace {path}: predicted_ids {predicted.shape} and topk_ids {topk.shape} differ in rows")
    deeper = load_predictions_ahead(path, experts)
    if deeper is not None and deeper.shape[1:3] != topk.shape[:2]:
        raise TraceError(f"trace {path}: predicted_ids_ahead {deeper.shape} and topk_ids {topk.shape} differ in rows")
    if experts is None:  # the largest id seen: a lower bound of E
        experts = int(max(topk.max(), predicted.max(), deeper.max() if deeper is not None and deeper.size else -1)) + 1
    return topk, predicted, deeper, experts


def table(path: Path, result: dict, inferred: bool) -> str:
    """The next layer's rows, overall and chance, then each depth further ahead's in a block of its own."""
    e = f"{result['experts']} experts" + (" (largest id + 1; pass --experts)" if inferred else "")
    shape = f"{result['tokens']} tokens x {result['layers']} layers, top-{result['k']}, P = {result['P']}"
    lines = [f"{path}: {shape}, {e}"]
    for depth in [{"ahead": 1, **result}, *result["further_ahead"]]:
        if depth["ahead"] > 1:
            lines.append(f"proposals made {depth['ahead']} layers ahead (P = {depth['P']})")
        lines.append(f"{'proposal for layer':<20}{'recall':>8}{'precision':>11}")
        for row in depth["per_layer"]:
            lines.append(f"{row['layer'] + depth['ahead']:<20}{_fmt(row['recall']):>8}{_fmt(row['precision']):>11}")
        for name in ("overall", "chance"):
            lines.append(f"{name:<20}{_fmt(depth[name]['recall']):>8}{_fmt(depth[name]['precision']):>11}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="a .npz with topk_ids and predicted_ids (and predicted_ids_ahead)")
    ap.add_argument("--experts", type=int, help="experts per layer (default: the trace's largest id + 1)")
    ap.add_argument("--json", action="store_true", help="print the scores as JSON")
    args = ap.parse_args(argv)
    if args.experts is not None and args.experts < 1:
        print("score_predictor: --experts must be a positive integer", file=sys.stderr)
        return 2
    try:
        topk, predicted, deeper, experts = read(args.trace, args.experts)
    except TraceError as e:
        print(f"score_predictor: {e}", file=sys.stderr)
        return 2
    result = score_depths(topk, predicted, deeper, experts)
    if not result["per_layer"]:
        print(f"score_predictor: trace {args.trace} proposes nothing (predicted_ids is all -1)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": str(args.trace), **result}, indent=1))
    else:
        print(table(args.trace, result, args.experts is None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
