"""Replay whole-forward captures of paged layers and report any slot that does not hold its expert's bytes, and
what it holds instead (GPU only; no vLLM).

The setup is tests/gpu/test_round_sync_gpu.py's (live router rounds, steps back to back: compute 0), built afresh
`--reps` times per case, 30 replays each. A case is policy:mode:step_programs, mode one of joinless, chained
(rounds waited for by device flags, joined as usual) or forked (a fork and join a layer); step_programs 0 is the
pager's default (2 a streaming multiprocessor). For a torn slot the JSON gives, per KiB of its first wrong
component, which experts' records hold those bytes ([]: none, the KiB is mixed), the step's ids and remapped
slots, and the table's copy words.

    python3 scripts/gpu_slot_tear_probe.py --cases lfu-duel:joinless:0,lfu-duel:joinless:1 --reps 20 --out tear.json

Run 26 in docs/benchmarks.md used it to find that the joinless step's programs parted ways (fixed since: the
round's claim is read once per program, core.memory_order.load_uniform).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "gpu"), str(ROOT / "pager"), str(ROOT / "app"), str(ROOT / "bench")]

import torch  # noqa: E402
from test_prefetch_chain_gpu import model_inputs, paged_model, routed_inputs  # noqa: E402

REPLAYS = 30
KIB = 1024


def owners(records: torch.Tensor, got: torch.Tensor, offset: int) -> list:
    """For each KiB of `got` (a component's bytes at `offset` in the record), the one expert whose record holds it,
    or the list of those that do (empty: mixed bytes)."""
    found = []
    for start in range(0, got.numel(), KIB):
        piece = got[start : start + KIB]
        width = piece.numel()
        who = [
            e
            for e in range(records.shape[0])
            if torch.equal(records[e, offset + start : offset + start + width], piece)
        ]
        found.append(who[0] if len(who) == 1 else who)
    return found


def first_tear(layers, layout, records, chosen, out) -> dict | None:
    for i, layer in enumerate(layers):
        for expert, slot in zip(chosen[i].flatten().tolist(), out[i].flatten().cpu().tolist()):
            for c in layout.components:
                got = layer.pager.buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu()
                if torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]):
                    continue
                state = layer.pager.pager_started().vram.kernel_state()
                return {
                    "layer": i,
                    "expert": expert,
                    "slot": slot,
                    "component": c.name,
                    "owners_per_kib": owners(records, got, c.offset),
                    "ids": chosen[i].flatten().tolist(),
                    "remapped": out[i].flatten().cpu().tolist(),
                    "slot_expert": state["slot_expert"].cpu().tolist(),
                    "claim": int(state["claim"]),
                    "copied": state["copied"].cpu().tolist(),
                    "target": state["target"].cpu().tolist(),
                }
    return None


def run_case(policy: str, mode: str, step_programs: int, reps: int, experts=128, vram=24, k=8, layers_n=6) -> dict:
    tears = []
    for rep in range(reps):
        layout, g, records, weights, x, ids = model_inputs(experts, k, 1, layers_n)
        layers, predictor, _ = paged_model(
            layout, records, layers_n, vram, k, mode != "forked", weights, policy, joinless=mode == "joinless"
        )
        if step_programs:
            for layer in layers:
                layer.pager.pager_started().step_programs = step_programs
        out = [torch.empty_like(i) for i in ids]

        def forward() -> None:
            for i, layer in enumerate(layers):
                with predictor.ahead(layer, x, ids[i].numel()) as turn:
                    out[i].copy_(layer.pager.step(ids[i], turn.chain))
                    turn()

        rng = random.Random(experts + rep)
        routed_inputs(x, ids, weights, experts, k, g, rng)
        forward()  # eager: compiles, makes the chain's flags
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        for replay in range(REPLAYS):
            chosen = routed_inputs(x, ids, weights, experts, k, g, rng)
            graph.replay()
            torch.cuda.synchronize()
            tear = first_tear(layers, layout, records, chosen, out)
            if tear is not None:
                tears.append({"rep": rep, "replay": replay, **tear})
                break
        del graph
    return {
        "policy": policy,
        "mode": mode,
        "step_programs": step_programs,
        "reps": reps,
        "torn": len(tears),
        "first": tears[:2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="policy:mode:step_programs, comma separated")
    parser.add_argument("--reps", type=int, default=20, help="fresh models per case (30 replays each)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_slot_tear_probe: needs a CUDA GPU")
    results = []
    for case in args.cases.split(","):
        policy, mode, programs = case.split(":")
        result = run_case(policy, mode, int(programs), args.reps)
        print(json.dumps({key: value for key, value in result.items() if key != "first"}), flush=True)
        results.append(result)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
