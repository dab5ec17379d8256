"""Routing traces for the paging benchmark: the routing families, predictions, file I/O, an LRU check.

Every synthetic family is one generator with stated parameters (`Family`), seeded:
- per layer, expert popularity is Zipf(`alpha`) over a per-layer random permutation;
- temporal locality: each of a token's k experts is kept from the previous token's set
  with probability `keep`, otherwise drawn from the popularity, all k distinct
  (Gumbel top-k: successive sampling without replacement);
- topic shifts: every `shift_every` tokens (0 = never), each layer re-ranks `shift_share`
  of its experts (a random subset of them swaps popularity values among themselves);
- cross-layer correlation: each of a token's k experts in layer l pulls its partner
  (a fixed random bijection per layer pair) into the token's layer-(l+1) set with
  probability `corr` (after the kept experts, before the drawn ones), so layer l's
  choice carries information about layer l+1's: what a next-layer predictor reads. This
  also mixes each layer's popularity with its predecessor's, seen through the partner map.

Families (FAMILIES): `standard` (alpha 1.4, keep 0.3; the committed H200 benchmarks' trace,
bit for bit), `topic-shift` (alpha 1.2, keep 0.45, half of each layer's experts re-ranked
every 48 tokens, corr 0.3; LRU hits 0.71 / 0.85 at 32 / 102 of 256 slots, close to the
topic-shift trace of issue 15's H200 table), `near-uniform` (alpha 0.2, keep 0.05, corr 0.3: the worst
case; a random-weights router routes about like this), and `recorded` (a file written by
the vLLM plugin with BIGMOE_TRACE_PATH; docs/routing.md says how ours was made).

A trace is int32 [tokens, layers, k] stored in an .npz under `topk_ids` (the format the
vLLM plugin records). It may also carry `predicted_ids` int32 [tokens, layers, P], -1
padded: row [t, l] is what a next-layer predictor proposes for layer l+1 while layer l
computes (`predictions`: made at a stated recall and precision from the true ids).

    PYTHONPATH=pager:bench python scripts/traces.py --family topic-shift --layers 40 --experts 256 --k 8 --check 32,102
    PYTHONPATH=pager:bench python scripts/traces.py --family standard --layers 40 --recall 0.8 \
        --precision 0.5 --out t.npz
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ALPHA = 1.4
KEEP = 0.3


class TraceError(ValueError):
    """A trace file is missing, damaged or has the wrong shape."""


@dataclass(frozen=True)
class Family:
    """The parameters of one synthetic routing family."""

    alpha: float
    """Zipf exponent of each layer's expert popularity (0 = uniform)."""
    keep: float
    """Probability that each of a token's experts is kept from the previous token's set."""
    shift_every: int = 0
    """Tokens between topic shifts (0 = stationary popularity)."""
    shift_share: float = 0.0
    """Share of each layer's experts whose popularity ranks are permuted at a shift."""
    corr: float = 0.0
    """Probability that each layer-l expert pulls its partner into the token's layer-(l+1) set."""


FAMILIES = {
    "standard": Family(alpha=ALPHA, keep=KEEP),
    "topic-shift": Family(alpha=1.2, keep=0.45, shift_every=48, shift_share=0.5, corr=0.3),
    "near-uniform": Family(alpha=0.2, keep=0.05, corr=0.3),
}
"""The synthetic families; `recorded` is a file (docs/routing.md)."""
PULLED_KEY = 1e6  # sort key of a partner a token pulls in: above every drawn key, below a kept expert's inf
RECORDED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "recorded-tiny64.npz"
"""The trace recorded from real vLLM (CPU build) on the tiny model: 64 experts, top-8, 8 layers."""


def popularity(experts: int, layers: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """float64 [layers, experts]: Zipf(alpha) probabilities, ranks shuffled per layer."""
    ranked = 1.0 / np.arange(1, experts + 1) ** alpha
    ranked /= ranked.sum()
    probs = np.empty((layers, experts))
    for layer in range(layers):
        probs[layer, rng.permutation(experts)] = ranked
    return probs


def standard_trace(
    tokens: int, layers: int, experts: int, k: int, alpha: float = ALPHA, keep: float = KEEP, seed: int = 0
) -> np.ndarray:
    """int32 [tokens, layers, k] with the standard locality model."""
    return family_trace(Family(alpha=alpha, keep=keep), tokens, layers, experts, k, seed)


def family_trace(family: Family, tokens: int, layers: int, experts: int, k: int, seed: int = 0) -> np.ndarray:
    """int32 [tokens, layers, k] of a synthetic family (random draws in a fixed order: seeded)."""
    if not 1 <= k <= experts:
        raise TraceError(f"top-k must be in [1, {experts}], got {k}")
    rng = np.random.default_rng(seed)
    log_p = np.log(popularity(experts, layers, family.alpha, rng))
    # Drawn only when the family uses them, so the standard trace keeps its historical draws.
    partner = np.stack([rng.permutation(experts) for _ in range(layers)]) if family.corr else None
    out = np.empty((tokens, layers, k), dtype=np.int32)
    rows = np.arange(layers)[:, None]
    prev = None
    for t in range(tokens):
        if family.shift_every and t and t % family.shift_every == 0:
            _shift(log_p, family.shift_share, rng)
        keys = log_p + rng.gumbel(size=log_p.shape)
        if prev is not None:
            # Kept experts sort first; a dropped one may be drawn again like any other.
            kept = rng.random((layers, k)) < family.keep
            keys[rows, prev] = np.where(kept, np.inf, keys[rows, prev])
        if partner is None:
            out[t] = np.argsort(-keys, axis=1)[:, :k]
        else:
            _choose_correlated(keys, partner, rng.random((layers, k)) < family.corr, out[t])
        prev = out[t]
    return out


def _choose_correlated(keys: np.ndarray, partner: np.ndarray, pulled: np.ndarray, out: np.ndarray) -> None:
    """Layer by layer: the partners of the pulled of layer l-1's experts sort right after the kept ones."""
    k = out.shape[1]
    out[0] = np.argsort(-keys[0])[:k]
    for layer in range(1, keys.shape[0]):
        chosen = partner[layer - 1, out[layer - 1][pulled[layer]]]
        keys[layer, chosen] = np.maximum(keys[layer, chosen], PULLED_KEY)
        out[layer] = np.argsort(-keys[layer])[:k]


def _shift(log_p: np.ndarray, share: float, rng: np.random.Generator) -> None:
    """A topic shift, in place: in each layer a random `share` of the experts permute their popularities."""
    layers, experts = log_p.shape
    n = int(round(share * experts))
    for layer in range(layers):
        moved = rng.choice(experts, size=n, replace=False)
        log_p[layer, moved] = log_p[layer, rng.permutation(moved)]


def named_trace(name: str, tokens: int, layers: int, experts: int, k: int, seed: int = 0) -> np.ndarray:
    """A family's trace by name; `recorded` loads RECORDED (its own shape: the arguments do not apply)."""
    if name == "recorded":
        return load_trace(RECORDED)
    if name not in FAMILIES:
        raise TraceError(f"routing family {name!r} is unknown; choose {', '.join([*FAMILIES, 'recorded'])}")
    return family_trace(FAMILIES[name], tokens, layers, experts, k, seed)


WRONG_MODELS = ("uniform", "popular", "none")
"""How predictions() draws a proposal's wrong ids (see there)."""
POPULAR_WINDOW = 64
"""Tokens before a row whose uses weigh predictions()' popular wrong ids (topic-shift re-ranks every 48)."""


def predictions(
    topk_ids: np.ndarray,
    recall: float,
    precision: float | None,
    experts: int,
    seed: int = 0,
    wrong: str = "uniform",
    ahead: int = 1,
) -> np.ndarray:
    """int32 [tokens, layers, P], -1 padded: row [t, l] proposes layer l+1's experts of token t (layer l+ahead's
    with `ahead` > 1, as a predictor looking that far ahead would; the last `ahead` layers' rows are all -1).

    Per row, with T = layer l+1's distinct true ids: recall * |T| of them (rounded up or down at
    random so the mean is exact), chosen at random, plus wrong ids (not in T) so that the right
    share of the proposal is `precision` (likewise rounded);
    P = k + ceil(k * recall * (1 / precision - 1)). The last layer has no next one: all -1.
    The ids below are layer l+1's; with `ahead` > 1, layer l+ahead's.
    precision None: a top-k predictor's proposal, k ids per row whatever the recall (P = k): the
    right ones, then wrong ones up to k, so precision = recall (a router's top-k proposes so).
    wrong: "uniform" draws the wrong ids evenly from the experts not in T (the pessimistic model: most
    are cold); "popular" draws them in proportion to 1 + how often layer l+1 used each in the
    POPULAR_WINDOW tokens before t, as a router's near misses tend to be the experts its current
    context favours; "none" proposes no wrong ids at all (a row holds only its right ones, so at recall 0 it
    is empty: what the prefetch path costs when there is nothing to copy).
    """
    if wrong not in WRONG_MODELS:
        raise TraceError(f"the wrong-id model is one of {', '.join(WRONG_MODELS)}, not {wrong!r}")
    if precision is None:
        precision_ok, topk = True, True
    else:
        precision_ok, topk = 0.0 < precision <= 1.0, False
    if not 0.0 <= recall <= 1.0 or not precision_ok:
        raise TraceError(f"recall must be in [0, 1] and precision in (0, 1], got {recall}, {precision}")
    if ahead < 1:
        raise TraceError(f"a prediction looks at least one layer ahead, got {ahead}")
    tokens, layers, k = topk_ids.shape
    wrong_max = 0 if topk else int(np.ceil(k * recall * (1.0 / precision - 1.0)))
    out = np.full((tokens, layers, k + wrong_max), -1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    recent = None if wrong == "uniform" else _cumulative_uses(topk_ids, experts)
    for t in range(tokens):
        for layer in range(layers - ahead):
            target = topk_ids[t, layer + ahead]
            true = np.unique(target[target >= 0])
            right = rng.permutation(true)[: _stochastic_round(recall * true.size, rng)]
            if wrong == "none":
                n_wrong = 0
            elif topk:
                n_wrong = min(k - right.size, experts - true.size)
            else:
                wanted = _stochastic_round(right.size * (1.0 / precision - 1.0), rng)
                n_wrong = min(wanted, wrong_max, experts - true.size)
            others = np.setdiff1d(np.arange(experts), true, assume_unique=True)
            weight = None
            if recent is not None:
                uses = 1.0 + recent[layer + ahead][t] - recent[layer + ahead][max(0, t - POPULAR_WINDOW)]
                weight = uses[others] / uses[others].sum()
            row = np.concatenate([right, rng.choice(others, size=n_wrong, replace=False, p=weight)])
            out[t, layer, : row.size] = row
    return out


def deeper_predictions(
    topk_ids: np.ndarray,
    recalls: list[float],
    precision: float | None,
    experts: int,
    seed: int = 0,
    wrong: str = "uniform",
) -> np.ndarray:
    """int32 [len(recalls), tokens, layers, P], -1 padded: entry [d - 2, t, l] proposes layer l+d's experts of token
    t at recall recalls[d - 2] (d = 2, 3, ...), made as `predictions` makes the next layer's. A trace carries them as
    `predicted_ids_ahead`, so reads ahead and prefetch rounds aimed d layers on replay proposals that are right as
    often as a real predictor's that far ahead are said to be, where without them they replay the next-layer rows
    of layer l+d-1 (as right as the next layer's: a benchmark's upper bound)."""
    rows = [
        predictions(topk_ids, r, precision, experts, seed=seed + d, wrong=wrong, ahead=d)
        for d, r in enumerate(recalls, start=2)
    ]
    width = max((r.shape[2] for r in rows), default=topk_ids.shape[2])
    out = np.full((len(rows), *topk_ids.shape[:2], width), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :, :, : r.shape[2]] = r
    return out


def _cumulative_uses(topk_ids: np.ndarray, experts: int) -> np.ndarray:
    """int32 [layers, tokens + 1, experts]: row t counts each expert's uses by the tokens before t, per layer."""
    tokens, layers, _ = topk_ids.shape
    out = np.zeros((layers, tokens + 1, experts), dtype=np.int32)
    for layer in range(layers):
        ids = topk_ids[:, layer]
        hits = np.zeros((tokens, experts + 1), dtype=np.int32)
        np.add.at(hits, (np.repeat(np.arange(tokens), ids.shape[1]), np.where(ids >= 0, ids, experts).ravel()), 1)
        out[layer, 1:] = np.cumsum(hits[:, :experts], axis=0)
    return out


def _stochastic_round(x: float, rng: np.random.Generator) -> int:
    """floor(x) or floor(x) + 1, the latter with probability frac(x): the mean is x."""
    base = int(np.floor(x))
    return base + int(rng.random() < x - base)


def lru_hit_rate(trace: np.ndarray, slots: int) -> float:
    """Hits / lookups of a per-layer LRU with `slots` slots (a step needs its token's distinct experts)."""
    hits = lookups = 0
    for layer in range(trace.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for row in trace[:, layer, :]:
            need = {int(e) for e in row if e >= 0}
            for e in need:
                if e in cache:
                    hits += 1
                    cache.move_to_end(e)
            for e in sorted(need - set(cache)):
                cache[e] = None
            while len(cache) > slots:
                victim = next(e for e in cache if e not in need)
                del cache[victim]
            lookups += len(need)
    return hits / max(1, lookups)


def save_trace(
    path: str | Path,
    topk_ids: np.ndarray,
    predicted_ids: np.ndarray | None = None,
    predicted_ahead: np.ndarray | None = None,
) -> None:
    """Write atomically (temp file then rename); predicted_ids and predicted_ahead (deeper_predictions'; optional,
    with predicted_ids only) as int32."""
    path = Path(path)
    if predicted_ahead is not None and predicted_ids is None:
        raise TraceError("predictions further ahead need the next layer's (predicted_ids) beside them")
    arrays = {"topk_ids": np.asarray(topk_ids, dtype=np.int32)}
    if predicted_ids is not None:
        arrays["predicted_ids"] = np.asarray(predicted_ids, dtype=np.int32)
    if predicted_ahead is not None:
        arrays["predicted_ids_ahead"] = np.asarray(predicted_ahead, dtype=np.int32)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_trace(path: str | Path, experts: int | None = None) -> np.ndarray:
    """int32 [tokens, layers, k] from an .npz with `topk_ids`; checked."""
    return _load(path, "topk_ids", experts)


def load_predictions(path: str | Path, experts: int | None = None) -> np.ndarray | None:
    """int32 [tokens, layers, P] `predicted_ids` of a trace file, or None when it carries none."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "predicted_ids" not in data.files:
                return None
    except FileNotFoundError:
        raise TraceError(f"trace {path} does not exist") from None
    except Exception as e:
        raise TraceError(f"trace {path} is not a readable .npz ({type(e).__name__})") from None
    return _load(path, "predicted_ids", experts)


def load_predictions_ahead(path: str | Path, experts: int | None = None) -> np.ndarray | None:
    """int32 [depths, tokens, layers, P] `predicted_ids_ahead` of a trace file (deeper_predictions'), or None."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "predicted_ids_ahead" not in data.files:
                return None
            deeper = np.array(data["predicted_ids_ahead"])
    except FileNotFoundError:
        raise TraceError(f"trace {path} does not exist") from None
    except Exception as e:
        raise TraceError(f"trace {path} is not a readable .npz ({type(e).__name__})") from None
    if deeper.ndim != 4 or deeper.dtype != np.int32:
        shape = f"{deeper.dtype} {deeper.shape}"
        raise TraceError(f"trace {path}: predicted_ids_ahead must be int32 [depths, tokens, layers, P], got {shape}")
    if experts is not None and deeper.size and (deeper.max() >= experts or deeper.min() < -1):
        raise TraceError(f"trace {path}: ids must lie in [-1, {experts}), got {deeper.min()}..{deeper.max()}")
    return deeper


def _load(path: str | Path, key: str, experts: int | None) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as data:
            ids = np.array(data[key])
    except FileNotFoundError:
        raise TraceError(f"trace {path} does not exist") from None
    except Exception as e:  # zip, pickle and key errors all mean "not a trace"
        raise TraceError(f"trace {path} is not a readable .npz with {key} ({type(e).__name__})") from None
    if ids.ndim != 3 or ids.dtype != np.int32:
        raise TraceError(f"trace {path}: {key} must be int32 [tokens, layers, n], got {ids.dtype} {ids.shape}")
    if experts is not None and ids.size and (ids.max() >= experts or ids.min() < -1):
        raise TraceError(f"trace {path}: ids must lie in [-1, {experts}), got {ids.min()}..{ids.max()}")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="standard", help=f"one of {', '.join([*FAMILIES, 'recorded'])}")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--alpha", type=float, help="override the family's Zipf exponent")
    ap.add_argument("--keep", type=float, help="override the family's keep probability")
    ap.add_argument("--corr", type=float, help="override the family's cross-layer correlation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recall", type=float, help="also write predicted_ids at this recall")
    ap.add_argument(
        "--precision",
        type=float,
        default=None,
        help="precision of the predicted ids (default: k ids per row, = recall)",
    )
    ap.add_argument("--out", type=Path, help="write the trace (.npz, topk_ids [+ predicted_ids])")
    ap.add_argument("--check", default="", help="comma list of slot counts: print LRU hit rates")
    args = ap.parse_args(argv)
    try:
        trace = _trace_for(args)
        predicted = None
        if args.recall is not None:
            predicted = predictions(
                trace,
                args.recall,
                args.precision,
                int(trace.max()) + 1 if args.family == "recorded" else args.experts,
                args.seed,
            )
    except TraceError as e:
        print(f"traces: {e}", file=sys.stderr)
        return 2
    if args.out:
        save_trace(args.out, trace, predicted)
    for slots in [int(s) for s in args.check.split(",") if s]:
        print(f"LRU {slots}/{args.experts} slots: hit rate {lru_hit_rate(trace, slots):.3f}")
    return 0


def _trace_for(args: argparse.Namespace) -> np.ndarray:
    if args.family == "recorded":
        return named_trace("recorded", 0, 0, 0, 0)
    if args.family not in FAMILIES:
        raise TraceError(f"routing family {args.family!r} is unknown; choose {', '.join([*FAMILIES, 'recorded'])}")
    overrides = {f: getattr(args, f) for f in ("alpha", "keep", "corr") if getattr(args, f) is not None}
    family = replace(FAMILIES[args.family], **overrides)
    return family_trace(family, args.tokens, args.layers, args.experts, args.k, args.seed)


if __name__ == "__main__":
    sys.exit(main())
