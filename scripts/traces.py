"""Routing traces for the paging benchmark: the standard synthetic trace, file I/O, an LRU check.

Standard trace (seeded): per layer, expert popularity is Zipf(alpha) over a
per-layer random permutation of the experts; each of a token's k experts is
kept from the previous token's set with probability `keep`, otherwise drawn
from the popularity, all k distinct. A trace is int32 [tokens, layers, k] and
is stored in an .npz under `topk_ids` (the format the vLLM plugin records).

    python scripts/traces.py --layers 40 --experts 256 --k 8 --tokens 4000 --check 32,102
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

ALPHA = 1.4
KEEP = 0.3


class TraceError(ValueError):
    """A trace file is missing, damaged or has the wrong shape."""


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
    if not 1 <= k <= experts:
        raise TraceError(f"top-k must be in [1, {experts}], got {k}")
    rng = np.random.default_rng(seed)
    log_p = np.log(popularity(experts, layers, alpha, rng))
    out = np.empty((tokens, layers, k), dtype=np.int32)
    rows = np.arange(layers)[:, None]
    prev = None
    for t in range(tokens):
        # Gumbel top-k draws k distinct experts with successive-sampling probabilities.
        keys = log_p + rng.gumbel(size=log_p.shape)
        if prev is None:
            out[t] = np.argsort(-keys, axis=1)[:, :k]
        else:
            # Kept experts sort first; a dropped one may be drawn again like any other.
            kept = rng.random((layers, k)) < keep
            keys[rows, prev] = np.where(kept, np.inf, keys[rows, prev])
            out[t] = np.argsort(-keys, axis=1)[:, :k]
        prev = out[t]
    return out


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


def save_trace(path: str | Path, topk_ids: np.ndarray) -> None:
    """Write atomically (temp file then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, topk_ids=np.asarray(topk_ids, dtype=np.int32))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_trace(path: str | Path, experts: int | None = None) -> np.ndarray:
    """int32 [tokens, layers, k] from an .npz with `topk_ids`; checked."""
    try:
        with np.load(path, allow_pickle=False) as data:
            ids = np.array(data["topk_ids"])
    except FileNotFoundError:
        raise TraceError(f"trace {path} does not exist") from None
    except Exception as e:  # zip, pickle and key errors all mean "not a trace"
        raise TraceError(f"trace {path} is not a readable .npz with topk_ids ({type(e).__name__})") from None
    if ids.ndim != 3 or ids.dtype != np.int32:
        raise TraceError(f"trace {path}: topk_ids must be int32 [tokens, layers, k], got {ids.dtype} {ids.shape}")
    if experts is not None and ids.size and (ids.max() >= experts or ids.min() < -1):
        raise TraceError(f"trace {path}: ids must lie in [-1, {experts}), got {ids.min()}..{ids.max()}")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=ALPHA)
    ap.add_argument("--keep", type=float, default=KEEP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the trace (.npz, topk_ids)")
    ap.add_argument("--check", default="", help="comma list of slot counts: print LRU hit rates")
    args = ap.parse_args(argv)
    trace = standard_trace(args.tokens, args.layers, args.experts, args.k, args.alpha, args.keep, args.seed)
    if args.out:
        save_trace(args.out, trace)
    for slots in [int(s) for s in args.check.split(",") if s]:
        print(f"LRU {slots}/{args.experts} slots: hit rate {lru_hit_rate(trace, slots):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
