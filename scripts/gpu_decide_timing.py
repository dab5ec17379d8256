"""How long one prefetch round's decision (the admit kernel, admit_kernel.decide_round) holds a stream, by warps.

A decision placed on vLLM's own stream (inside the layer's step, or as a kernel after it) adds its duration to
every token, 39-47 times; one placed beside the stream costs what a resident CTA costs there
(scripts/gpu_launch_gap_probe.py). This times it without the profiler: 40 layers' tables (experts x slots, one
policy), warmed by steps of Zipf routing, and one captured graph a token that, per layer, takes the token's routed
ids (acquire: the step's decision) and, in the second graph only, decides a round for a proposal of the same width
(recall about 0.8 of the next token's ids, the rest wrong). The difference of the two graphs' replay times, per
layer, is what a round's decision adds to a stream it runs on.

    python3 scripts/gpu_decide_timing.py --out /tmp/decide.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pager"))
from bigmoe_pager.atomic_file import write_atomic  # noqa: E402
from bigmoe_pager.core.admit_kernel import launch_admit  # noqa: E402
from bigmoe_pager.core.slots import SlotTable  # noqa: E402

LAYERS = 40
TOP_K = 8


def routed(tokens: int, experts: int, seed: int) -> np.ndarray:
    """int64 [tokens, LAYERS, TOP_K]: distinct ids a token, Zipf(1.2)-popular, a popularity order per layer."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** 1.2
    weights /= weights.sum()
    order = np.stack([rng.permutation(experts) for _ in range(LAYERS)])
    out = np.empty((tokens, LAYERS, TOP_K), dtype=np.int64)
    for t in range(tokens):
        for layer in range(LAYERS):
            out[t, layer] = order[layer][rng.choice(experts, TOP_K, replace=False, p=weights)]
    return out


def proposals(ids: np.ndarray, experts: int, recall: float, seed: int) -> np.ndarray:
    """The next token's ids with each kept at `recall` and the rest replaced by a random other expert."""
    rng = np.random.default_rng(seed)
    nxt = np.roll(ids, -1, axis=0)
    wrong = rng.integers(0, experts, nxt.shape)
    return np.where(rng.random(nxt.shape) < recall, nxt, wrong)


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def measure(
    experts: int, slots: int, policy: str, warps: int, tokens: int, replays: int, recall: float = 0.8, gate: int = 0
) -> dict:
    """One configuration's two graphs, timed; recall: the proposals' (0: every id wrong); gate: the rounds' prefetch
    gate in percent (0: held open, every round decides and installs; 25 with recall 0: closed after the first rounds,
    as an idle prefetch path runs)."""
    ids = torch.from_numpy(routed(tokens, experts, seed=slots)).cuda()
    guess = torch.from_numpy(proposals(routed(tokens, experts, seed=slots), experts, recall, seed=1)).cuda()
    tables = [SlotTable(experts, slots, "cuda", use_kernel=True, policy=policy) for _ in range(LAYERS)]
    for t in range(min(tokens, 64)):  # filled slots and counts, as after a prompt
        for layer, table in enumerate(tables):
            table.acquire(ids[t, layer])
    cursor = torch.zeros(1, dtype=torch.int64, device="cuda")

    def token(decide: bool) -> None:
        row = cursor % tokens
        for layer, table in enumerate(tables):
            table.acquire(ids[row, layer].reshape(-1))
            if decide:
                state = table.admit_state()
                launch_admit(
                    state,
                    guess[row, layer].reshape(-1),
                    experts,
                    slots,
                    table.miss_capacity(TOP_K),
                    lfu=table.lfu,
                    min_used_percent=gate,
                    budget=table.prefetch_budget,
                    num_warps=warps,
                )
        cursor.add_(1)

    graphs = {}
    for decide in (False, True):
        token(decide)  # compiles outside the capture
        torch.cuda.synchronize()
        graphs[decide] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[decide]):
            token(decide)
    times = {False: [], True: []}
    for _ in range(3):  # interleaved, so a drift of the clock reaches both
        for decide in (False, True):
            graphs[decide].replay()
            torch.cuda.synchronize()
            times[decide].append(replay_us(graphs[decide], replays))
    base, with_round = min(times[False]), min(times[True])
    return {
        "experts": experts,
        "slots": slots,
        "policy": policy,
        "warps": warps,
        "recall": recall,
        "gate": gate,
        "token_us_steps_only": round(base, 2),
        "token_us_with_rounds": round(with_round, 2),
        "round_us_per_layer": round((with_round - base) / LAYERS, 3),
        "replays_us": {
            "steps_only": [round(t, 2) for t in times[False]],
            "with_rounds": [round(t, 2) for t in times[True]],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--slots", default="102,32", help="slots a layer, comma-separated")
    parser.add_argument("--policies", default="lfu-duel,lru")
    parser.add_argument("--warps", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=256, help="routed tokens the graphs cycle through")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--recall", type=float, default=0.8, help="the proposals' recall (0: every id wrong)")
    parser.add_argument(
        "--gate",
        type=int,
        default=0,
        help="the rounds' prefetch gate, percent (0: held open; 25 with --recall 0: closed)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decide_timing: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        for policy in args.policies.split(","):
            for warps in (int(w) for w in args.warps.split(",")):
                row = measure(args.experts, slots, policy, warps, args.tokens, args.replays, args.recall, args.gate)
                rows.append(row)
                print(
                    f"S={slots:4d} {policy:9s} warps={warps}: steps {row['token_us_steps_only']:8.1f} us a token, "
                    f"+rounds {row['token_us_with_rounds']:8.1f}: {row['round_us_per_layer']:6.2f} us a round",
                    flush=True,
                )
                report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
                # after every row, whole: a run cut short (a call's time limit) keeps the rows it finished
                write_atomic(Path(args.out), (json.dumps(report, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
