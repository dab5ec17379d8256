"""What a step still waits for when prefetch rounds are made D layers ahead: a timeline over the pager's own decisions.

A forecast to check against the H200, not an H200 figure. The decisions are the pager's (`SlotTable.acquire` for each
layer's ids, `SlotTable.admit` of the trace's proposals for the next layer, as scripts/sim_prefetch.py plays them);
a distance changes when a round runs, never what it decides (tests/unit/test_prefetch_distance.py), so one play of
the decisions serves every distance. The time is a model with five stated constants and three knobs:

- each layer computes for compute_us after its step (vLLM's own kernels; resident TPOT / layers);
- a step decides for step_us, then copies its misses over the link, demand_us each (SM copies);
- prefetch copies take copy_us each (copy engines), issued when the round's source step ends: layer l's round is
  made after layer l-D's step (the first layer's step makes rounds 1 .. D);
- one link, first come first served: a step's misses queue behind the prefetch copies issued before them;
- with prefetch on, each layer pays side_us more (the side branch's nodes, run 13's idle cost / layers);
- three knobs off by default, to test readings of run 28 against: a token's end that waits for the link (drain),
  compute slowed while a prefetch copy runs beside it (busy_slow), and a copier that drops the copies of a round
  not begun when its layer's step starts (pace: the step then copies the used ones itself, as misses).

A step waits for the prefetched experts it uses (the joinless protocol: only those). TPOT = elapsed / tokens.
The constants are `Timing`'s (rows named "measured"); `--timing NAME:KEY=US,...` adds rows on changed ones over the
same decisions, to see which cost a target hangs on.

    PYTHONPATH=pager:bench python scripts/sim_window.py --families standard,topic-shift --recalls 0,0.8,1 \\
        --distances 1,2 --tokens 200 --warmup 100 --out docs/bench/sim-window.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
from bigmoe_bench import traces
from bigmoe_pager.core.slots import PREFETCH_BUDGET
from sim_prefetch import SHAPES, as_tensors, layer_tables  # scripts/ beside this one


@dataclass(frozen=True)
class Timing:
    """The model's constants, in microseconds (defaults: the 40-layer H200 benchmark, run 13)."""

    compute_us: float = 86.65
    """A layer's own kernels after its step: resident 3.466 ms a token / 40 layers."""
    step_us: float = 7.85
    """A step's decision when every id hits (run 13's probe, lfu-duel)."""
    demand_us: float = 72.0
    """One miss copied by the step's programs: 3.15 MB at the 42-45 GB/s they moved (run 12)."""
    copy_us: float = 57.3
    """One prefetch copy by the copy engines: 3.15 MB at 55 GB/s pinned H2D."""
    side_us: float = 9.4
    """A layer's share of the idle prefetch path (run 13: +0.37-0.38 ms a token at recall 0, 40 layers)."""
    drain: float = 0.0
    """1: a token's end waits until the link is idle (the host copier's drain, host_rounds.drain_published), so no
    copy of one token overlaps the next token's compute; 0: the link's queue carries over."""
    busy_slow: float = 0.0
    """A hypothesis, not a measurement (run 28): the share by which a layer's compute slows while prefetch copies
    hold the link beside it (0: not at all; 1: twice as long while it overlaps a copy)."""
    pace: float = 0.0
    """1: the copier issues a round one expert at a time and drops those not begun when their layer's step starts (the
    step copies the dropped ones it uses as misses; later copies move up the link's queue); 0: every copy is made.
    Not built: a question for the model (session 40)."""


MEASURED = "measured"
"""The name of the default constants' rows."""


@dataclass
class Decisions:
    """Per token and layer: the step's misses, the experts its round copied in, and those of them the step used."""

    demand: list[list[int]]
    prefetched: list[list[list[int]]]
    used: list[list[list[int]]]


def decide(
    trace: np.ndarray,
    predicted: np.ndarray | None,
    experts: int,
    vram: int,
    policy: str,
    budget: int = PREFETCH_BUDGET,
) -> Decisions:
    """The pager's decisions over the trace (next-layer rounds; the same at any distance); budget: experts a round
    copies at most (0: none; the gate's lift still applies)."""
    tokens, layers, _ = trace.shape
    ids, pred = as_tensors(trace, predicted)
    tables = layer_tables(layers, experts, vram, policy, budget=budget)
    demand = [[0] * layers for _ in range(tokens)]
    prefetched = [[[] for _ in range(layers)] for _ in range(tokens)]
    used = [[[] for _ in range(layers)] for _ in range(tokens)]
    for t in range(tokens):
        for layer in range(layers):
            got = tables[layer].acquire(ids[t, layer])
            demand[t][layer] = int(got.loaded)
            need = set(ids[t, layer].tolist())
            used[t][layer] = [e for e in prefetched[t][layer] if e in need]
            if pred is not None and layer + 1 < layers:
                admitted = tables[layer + 1].admit(pred[t, layer])
                prefetched[t][layer + 1] = [e for e in admitted.experts.tolist() if e >= 0]
    return Decisions(demand, prefetched, used)


def timeline(decisions: Decisions, distance: int, timing: Timing, prefetch: bool, warmup: int = 0) -> dict:
    """Play the decisions on the model's clock; returns TPOT (ms) and the steps' mean wait for prefetch (us a token),
    over the tokens after the first `warmup` (the tables start empty)."""
    tokens, layers = len(decisions.demand), len(decisions.demand[0])
    now = link_free = 0.0
    waited = 0.0
    for t in range(tokens):
        if t == warmup:
            began, waited = now, 0.0
        ready: dict[tuple[int, int], float] = {}  # (layer, expert) -> when its prefetch copy lands, this token
        queue: list[list] = []  # [layer, expert, lands] of the copies on the link, in issue order
        for layer in range(layers):
            dropped_used = 0
            if timing.pace:
                dropped, link_free = _drop_unbegun(queue, ready, layer, now, link_free, timing.copy_us)
                dropped_used = len(set(dropped) & set(decisions.used[t][layer]))
            lands = [ready[(layer, e)] for e in decisions.used[t][layer] if (layer, e) in ready] if layer else []
            start = max([now, *lands])
            waited += start - now
            decided = start + timing.step_us
            n = decisions.demand[t][layer] + dropped_used
            end = decided
            if n:
                end = max(decided, link_free) + n * timing.demand_us
                link_free = end
            targets = range(1, distance + 1) if layer == 0 else [layer + distance]
            for target in targets if prefetch else ():
                if target < layers:
                    for e in decisions.prefetched[t][target]:
                        link_free = max(end, link_free) + timing.copy_us
                        ready[(target, e)] = link_free
                        queue.append([target, e, link_free])
            overlap = min(timing.compute_us, max(0.0, link_free - end)) if prefetch else 0.0
            now = end + timing.compute_us + timing.busy_slow * overlap + (timing.side_us if prefetch else 0.0)
        if prefetch and timing.drain:
            now = max(now, link_free)
    timed = tokens - warmup
    return {"tpot_ms": round((now - began) / timed / 1000, 3), "prefetch_wait_us_per_token": round(waited / timed, 1)}


def _drop_unbegun(queue: list, ready: dict, layer: int, now: float, link_free: float, copy_us: float):
    """Pacing at `layer`'s step start (`now`): its copies not begun are dropped and the copies behind them move up.
    Returns (the dropped experts, when the link is free after the kept copies)."""
    queue[:] = [entry for entry in queue if entry[2] > now]  # landed: off the link
    # first come first served: the copies not begun yet are the queue's tail
    first = next((i for i, entry in enumerate(queue) if entry[2] - copy_us >= now), len(queue))
    begun, waiting = queue[:first], queue[first:]
    dropped = [e for target, e, _ in waiting if target == layer]
    if not dropped:
        return [], link_free
    for e in dropped:
        ready.pop((layer, e), None)
    free = max([now, *(entry[2] for entry in begun)])
    for entry in (entry for entry in waiting if entry[0] != layer):
        free += copy_us
        entry[2] = ready[(entry[0], entry[1])] = free
        begun.append(entry)
    queue[:] = begun
    return dropped, free


def family_trace(family: str, tokens: int, layers: int, vram: int) -> tuple[np.ndarray, int, int]:
    """(trace [tokens, layers, k], experts, VRAM slots) of a family: the synthetic ones at 256 experts, top-8, `vram`
    slots; `recorded` at its own 64 experts and 8 layers with the same share of them as slots (26 at 102 of 256)."""
    if family != "recorded":
        return traces.named_trace(family, tokens, layers, 256, 8), 256, vram
    whole = traces.named_trace(family, tokens, layers, 256, 8)
    if whole.shape[0] < tokens:
        raise traces.TraceError(f"the recorded trace holds {whole.shape[0]} tokens; --warmup + --tokens is {tokens}")
    experts = SHAPES["qwen3.6"][1][0]  # the recorded trace's experts
    return whole[:tokens, :layers], experts, max(whole.shape[2], round(vram * experts / 256))


def run(
    families,
    recalls,
    distances,
    tokens,
    warmup,
    layers,
    vram,
    policy,
    timings: dict[str, Timing],
    budgets=(PREFETCH_BUDGET,),
    wrong: str = "uniform",
) -> list:
    """One row per family and timing without prefetch, and per recall, budget, distance and timing with it (top-k
    proposals); timings: name -> the clock's constants (the decisions do not depend on them)."""
    rows = []
    for family in families:
        trace, experts, slots = family_trace(family, warmup + tokens, layers, vram)
        plain = decide(trace, None, experts, slots, policy)
        misses = round(sum(sum(per) for per in plain.demand[warmup:]) / tokens, 2)
        shape = {"experts": experts, "vram": slots, "layers": trace.shape[1]}
        for name, timing in timings.items():
            got = timeline(plain, 1, timing, False, warmup)
            rows.append({"family": family, **shape, "timing": name, "recall": None, "misses_per_token": misses, **got})
        for recall in recalls:
            predicted = traces.predictions(trace, recall, None, experts, wrong=wrong)
            for budget in budgets:
                made = decide(trace, predicted, experts, slots, policy, budget)
                copies = round(sum(len(p) for per in made.prefetched[warmup:] for p in per) / tokens, 2)
                misses = round(sum(sum(per) for per in made.demand[warmup:]) / tokens, 2)
                for distance in distances:
                    for name, timing in timings.items():
                        got = timeline(made, distance, timing, True, warmup)
                        rows.append(
                            {
                                "family": family,
                                **shape,
                                "timing": name,
                                "recall": recall,
                                "budget": budget,
                                "distance": distance,
                                "prefetch_per_token": copies,
                                "misses_per_token": misses,
                                **got,
                            }
                        )
    return rows


def parse_timing(text: str) -> tuple[str, Timing]:
    """NAME:KEY=US[,KEY=US...] (e.g. `noside:side_us=0`) -> (NAME, the measured constants with those changed)."""
    name, sep, changes = text.partition(":")
    keys = {f.name for f in fields(Timing)}
    try:
        pairs = dict(change.split("=", 1) for change in changes.split(","))
        values = {key: float(value) for key, value in pairs.items()}
    except ValueError:
        values = None
    if not name or name == MEASURED or not sep or values is None or not set(values) <= keys:
        raise ValueError(
            f"--timing takes NAME:KEY=US[,KEY=US...] with a NAME other than {MEASURED!r} and keys among "
            f"{', '.join(sorted(keys))}; got {text!r}"
        )
    if any(v < 0 for v in values.values()):
        raise ValueError(f"--timing's microseconds are >= 0; got {text!r}")
    return name, replace(Timing(), **values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="standard,topic-shift")
    p.add_argument("--recalls", default="0,0.8,1")
    p.add_argument("--distances", default="1,2")
    p.add_argument("--budgets", default=str(PREFETCH_BUDGET), help="experts a round copies at most (0: none)")
    p.add_argument("--tokens", type=int, default=200, help="tokens timed")
    p.add_argument("--warmup", type=int, default=100, help="tokens played first, not timed (the tables start empty)")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument(
        "--vram", type=int, default=102, help="VRAM slots per layer of 256 experts (recorded: the same share of its 64)"
    )
    p.add_argument("--policy", default="lfu-duel")
    p.add_argument(
        "--timing",
        action="append",
        default=[],
        help="NAME:KEY=US[,KEY=US...]: rows on changed constants too, beside the measured ones (e.g. noside:side_us=0)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        recalls = [float(x) for x in args.recalls.split(",")]
        distances = [int(x) for x in args.distances.split(",")]
        budgets = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        print(
            "sim_window: --recalls takes numbers, --distances and --budgets integers, comma separated", file=sys.stderr
        )
        return 2
    if (
        any(d < 1 for d in distances)
        or any(b < 0 for b in budgets)
        or not 1 <= args.vram <= 256
        or args.tokens < 1
        or args.layers < 2
    ):
        print(
            "sim_window: distances >= 1, budgets >= 0, 1 <= --vram <= 256, --tokens >= 1, --layers >= 2",
            file=sys.stderr,
        )
        return 2
    if args.warmup < 0:
        print("sim_window: --warmup >= 0", file=sys.stderr)
        return 2
    try:
        timings = {MEASURED: Timing(), **dict(parse_timing(text) for text in args.timing)}
    except ValueError as err:
        print(f"sim_window: {err}", file=sys.stderr)
        return 2
    families = args.families.split(",")
    try:
        rows = run(
            families,
            recalls,
            distances,
            args.tokens,
            args.warmup,
            args.layers,
            args.vram,
            args.policy,
            timings,
            budgets,
        )
    except traces.TraceError as err:
        print(f"sim_window: {err}", file=sys.stderr)
        return 2
    result = {
        "command": "sim_window.py " + " ".join(argv or sys.argv[1:]),
        "timing_us": {name: asdict(timing) for name, timing in timings.items()},
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
