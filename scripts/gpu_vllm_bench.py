"""TPOT and TTFT of real vLLM on the H200, side by side: resident, vLLM's --cpu-offload-gb, and the pager.

    PYTHONPATH=/tmp/site:pager:app:bench VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 scripts/gpu_vllm_bench.py --out $OUT/vllm-gpu.json [--configs resident,offload17,...] \\
        [--families standard,topic-shift] [--recalls 0,0.6,0.8,0.95,1] [--parallel 3]
    python3 scripts/gpu_vllm_bench.py --combine A.json B.json --out docs/bench/prefetch.json

(vLLM and the project wheel staged into /tmp/site as shared/gpu-vllm/README.md says.)
Makes (once; reused while the machine lives) a 40-layer FP8 synthetic Qwen3-MoE with
Qwen3.6-35B-A3B's shapes (256 experts of 2048 -> 512, top-8, 128x128 block scales,
about 30 GiB of experts) and the routing traces. Each configuration runs in its own
process (one vLLM engine) with vLLM's default CUDA-graph mode, batch 1 (max_num_seqs=1),
prefix caching off. Routing of every configuration, resident and offload included, is
replaced by a trace through BIGMOE_ROUTE_REPLAY, a benchmark-only switch (random routers
route almost uniformly; dummy weights route every token to experts 0-7).

    resident             every expert in VRAM
    offload17            --cpu-offload-gb 17 --cpu-offload-params w13_weight w2_weight
    bigmoe-102           102 VRAM slots per layer (40%), every expert in pinned RAM; prefill in token ranges
    bigmoe-32            32 VRAM slots per layer (12.5%), every expert in pinned RAM; prefill in token ranges
    bigmoe-32-ram128-ssd 32 VRAM slots, 128 RAM slots, the rest read from the checkpoint on SSD; token ranges
    bigmoe-102-layerbuf  bigmoe-102 with prefill over one whole-layer VRAM buffer (BIGMOE_PREFILL_BUFFER=1,
                         the plugin's default since session 4)
    bigmoe-32-layerbuf   bigmoe-32 with that buffer
    bigmoe-32-ram128-ssd-layerbuf  bigmoe-32-ram128-ssd with that buffer (experts gathered through the slots)

Suffixes: `@rX` replays traces that also carry next-layer predictions at recall X, so the pager prefetches on a side
stream (docs/routing.md); a bare `@r` measures every recall of --recalls; `~POLICY` sets BIGMOE_EVICTION (lru, lfu,
lfu-fast, lfu-duel); a last `+ahead` (with @r) lets the predictions post SSD reads ahead of need
(BIGMOE_SSD_READ_AHEAD=1), `+ahead4` four layers ahead (BIGMOE_SSD_READ_AHEAD_LAYERS=4; a replayed trace's rows for
further layers are as right as its next-layer rows, which a real predictor is not), and `+hi` (with @r) runs the
prefetch side stream at high priority (BIGMOE_PREFETCH_HIGH_PRIORITY=1), `+one-node` runs a joinless forward's rounds
as one kernel (BIGMOE_PREFETCH_ONE_NODE=1), `+host` has a host thread copy the rounds through the copy engines
(BIGMOE_PREFETCH_HOST_COPIER=1), `+chain` forks the rounds once a forward and orders them by device flags
(BIGMOE_PREFETCH_CHAIN=1), `+joinless` chains them and joins the side stream once a forward, each step settling its
round on the device (BIGMOE_PREFETCH_JOINLESS=1), `+gateN` the VRAM prefetch gate at N%
(BIGMOE_PREFETCH_MIN_USED_PERCENT; `+gate0` none), `+bN` a prefetch budget of N experts a layer's round
(BIGMOE_PREFETCH_BUDGET; `+b0` none), `+distN` a joinless forward's rounds N layers ahead
(BIGMOE_PREFETCH_DISTANCE=N, which implies +joinless); an @r engine's env names
the gate and budget it ran even where they are the plugin's defaults. A last `#N` (`bigmoe-102-layerbuf#2`) starts
another engine of the same configuration whose rows keep the tag: how far two engines of one build land apart (run
12: 0.04 ms); a point --recalls names twice is measured twice in turn (its second row ends in /2): the drift within
one engine. Predictions are a top-k predictor's proposal (k ids per row at every recall, so precision = recall)
unless --precision is given. The names' parser and suffix table: scripts/bench_names.py; the rows an engine's
result becomes: scripts/bench_rows.py.

One engine per configuration measures every family of --families (scripts/traces.py:
standard, topic-shift, near-uniform) and, for @r, every recall, in turn: before each it
swaps the replayed trace in place (Routing.load_replay: same shape, so the captured CUDA
graphs read it; cursors back to row 0), then runs a warm-up request (1,024-token prompt,
256 tokens), a counters request (one-token prompt: decode-shaped steps, the per-token
hit rates and bytes) and the timed request (another 1,024-token prompt, 256 tokens).
Replayed traces are the first 4,096 rows of each family's 16,384-token trace (standard:
the earlier runs' file). The pager's state (slots, eviction counts) carries over from one
measurement to the next; the warm-up request is there to settle it.

--parallel N starts up to N engines at once. Each takes the turn file's exclusive flock
once it is up and holds it to the end, so no two engines measure at once, and each timed
request also waits until no engine of the call is starting (weight loading and graph
capture share the GPU, PCIe and CPUs); rows record turn_wait_s and quiet_wait_s. With
N > 1 each engine gets a fixed 2 GiB KV cache (vLLM's memory profile would count the
other engines' memory). Host RAM: bigmoe-102/-32 pin every expert (about 30 GiB each),
offload17 17 GiB, bigmoe-32-ram128-ssd about 16 GiB; the H200 machine has 128 GiB. An
engine starts only when its estimate (engine_host_bytes) fits beside the running engines'
in the host's available memory less 8 GB, and says so when it waits (run 28: five engines
at once ran the host out of memory, one was killed and none measured); a call whose
engines wait in turn still spends their waits from --budget-s. Example (issue 15, about
63 and 60 GiB pinned):

    --configs resident,offload17,bigmoe-102,bigmoe-32-ram128-ssd@r0.8+ahead --families standard,topic-shift \\
        --parallel 4
    --configs bigmoe-102@r,bigmoe-32@r0.8 --families standard,topic-shift --parallel 2

Where a configuration reads from SSD, the parent first measures the disk's O_DIRECT read
bandwidth for expert-record reads of the checkpoint (no engine running) and each SSD row
gets its TPOT and TTFT disk floors. Result rows: one per (configuration@rX, family).
--combine (scripts/bench_combine.py) merges result files of several calls and computes issue 15's ratios per family
(families.<name>: speedup_vs_offload17_at_102, tpot_vs_resident_at_102,
speedup_vs_offload17_at_32 at recall 0.8; _no_prefetch and _recall_0 variants), the
top-level ssd_tpot_vs_disk_floor / ssd_ttft_vs_disk_floor (one row over its own bytes' floor), the family's rows over
the floor of the fewest bytes any of them read (ssd_needed_floor, whose best the SSD targets judge), and
issue15_targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import bench_combine  # noqa: E402  (scripts/ is not a package)
import bench_rows  # noqa: E402
import gpu_vllm_e2e as e2e  # noqa: E402
import numpy as np
import psutil
import traces  # noqa: E402
from bench_names import (  # noqa: E402
    AHEAD,
    EVICTIONS,
    HIGH,
    HOST_COPIER,
    RECALLS,
    Point,
    parse_name,
    parse_points,
    prefetch_defaults,
    recalls_of,
    split_suffixes,
    suffix_env,
    untagged,
)
from bigmoe_bench.host_budget import HostMemoryBudget
from bigmoe_bench.host_monitor import HostMonitor
from bigmoe_pager.settings import PagerSettings

SHAPE = dict(
    experts=256,
    top_k=8,
    hidden=2048,
    moe_intermediate=512,
    vocab=151936,
    heads=32,
    kv_heads=4,
    head_dim=128,
    dtype="fp8",
    device="cuda",
)
LAYERS = 40
PROMPT_TOKENS = 1024
GEN_TOKENS = 256
GPU_MEMORY_UTILIZATION = 0.45  # the shared baseline's setting (resident needs ~31 GiB of weights)
REPLAY_TOKENS = 4096
"""Rows of every replayed trace (the first rows of the family's 16,384-token trace): each measurement replays from
row 0 and uses about 2.8k (warm-up 1,280, counters 256, timed 1,280); all must have one shape to be swapped in."""
PARALLEL_KV_BYTES = 2 << 30
"""--parallel > 1: each engine's fixed KV cache (vLLM's memory profile would count the other engines' memory)."""
PARALLEL_GPU_MEMORY_UTILIZATION = 0.1
"""--parallel > 1: the share vLLM checks against the free memory at start (the KV cache is fixed above)."""
ENGINE_HOST_BYTES = 4e9
"""Host memory of one vLLM engine beside its pinned tiers, in bytes: run 28's three bigmoe engines took 102.5 GB of
the host, 34.2 GB each, of which 32.2 GB was the RAM tier; doubled for the compile workers' peaks at start."""
OFFLOAD_BYTES = 17 * 2**30
"""The offload17 engine's pinned weights (--cpu-offload-gb 17)."""
HOST_MARGIN_BYTES = 8e9
"""Host memory the admission leaves unreserved: the page cache that engines' checkpoint reads and traces go through."""


def engine_host_bytes(config: e2e.Config) -> float:
    """Host memory an engine of `config` holds while it runs, in bytes: a vLLM process, plus the pager's pinned RAM
    tier (BIGMOE_RAM_SLOTS experts a layer; unset: every expert) or offload17's pinned weights."""
    env, extra = config.env, 0.0
    if env.get("BIGMOE_PAGER") == "1":
        width = 1 if SHAPE["dtype"] == "fp8" else 2  # bytes a weight
        expert = 3 * SHAPE["hidden"] * SHAPE["moe_intermediate"] * width  # gate, up and down projections
        extra = int(env.get("BIGMOE_RAM_SLOTS", SHAPE["experts"])) * LAYERS * expert
    elif config.name == "offload17":
        extra = OFFLOAD_BYTES
    return ENGINE_HOST_BYTES + extra


def measurements(name: str, families: list[str], points: list[Point], traces_of: dict, wrong: str = "uniform"):
    """One engine's measurements, family by family, each point in turn: {"family", "recall", "wrong", "trace"}."""
    return [
        {"family": f, "recall": p and p.recall, "wrong": p and p.wrong, "trace": str(traces_of[f, p])}
        for f in families
        for p in recalls_of(name, points, wrong)
    ]


def config_for(name: str, first_trace: Path, experts: int) -> e2e.Config:
    """A named configuration starting on `first_trace` (its first measurement's), its suffixes applied (~POLICY:
    eviction; PREDICTION_SUFFIXES: SSD reads ahead, side stream priority; SETTING_SUFFIXES: the prefetch's gate and
    budget, which an @r engine names even at their defaults)."""
    base, recall, policy = parse_name(name)
    env = {**configs(first_trace, experts)[base].env}
    if base.startswith("bigmoe"):  # named even when it is the default, so the row says which policy ran
        env["BIGMOE_EVICTION"] = policy or PagerSettings().eviction
    if base.startswith("bigmoe") and recall is not None:  # and the prefetch's gate and budget, likewise
        env.update(prefetch_defaults())
    stem, _ = untagged(name)  # the engine's #N tag sets nothing
    for suffix in split_suffixes(stem)[1]:
        env.update(suffix_env(suffix))
    return e2e.Config(name, env)


def family_trace(work: Path, family: str) -> Path:
    """The family's replayed trace: the first REPLAY_TOKENS rows of its 16,384-token trace for LAYERS layers (the
    earlier runs' file for standard), made once per machine."""
    full, path = work / f"{family}-trace.npz", work / f"{family}-{REPLAY_TOKENS}-trace.npz"
    if not full.exists():
        traces.save_trace(full, traces.named_trace(family, 16384, LAYERS, SHAPE["experts"], SHAPE["top_k"], seed=0))
    if not path.exists():
        traces.save_trace(path, traces.load_trace(full)[:REPLAY_TOKENS])
    return path


def predicted_trace(work: Path, family: str, recall: float, precision: float | None, wrong: str = "uniform") -> Path:
    """The family's replayed trace with predicted_ids at (recall, precision; None: a top-k proposal of k ids per row,
    one shape at every recall), wrong ids drawn the `wrong` way (traces.WRONG_MODELS), made once per machine."""
    tag = ("topk" if precision is None else f"p{precision:g}") + ("" if wrong == "uniform" else f"-{wrong}")
    path = work / f"{family}-{REPLAY_TOKENS}-r{recall:g}-{tag}-trace.npz"
    if not path.exists():
        ids = traces.load_trace(family_trace(work, family))
        traces.save_trace(path, ids, traces.predictions(ids, recall, precision, SHAPE["experts"], 0, wrong))
    return path


def make_traces(
    work: Path, names: list[str], families: list[str], points: list[Point], precision, wrong: str = "uniform"
) -> dict:
    """{(family, Point or None): path} of every trace the configurations replay, made in parallel processes
    (a prediction trace of REPLAY_TOKENS rows takes tens of seconds of one core)."""
    wanted = sorted({(f, p) for n in names for f in families for p in recalls_of(n, points, wrong) if p is not None})
    workers = max(1, min(len(families) + len(wanted), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, initializer=_shape, initargs=(SHAPE, LAYERS)) as pool:
        plain = list(pool.map(family_trace, [work] * len(families), families))
        made = [pool.submit(predicted_trace, work, f, p.recall, precision, p.wrong) for f, p in wanted]
        predicted = [m.result() for m in made]
    return {**{(f, None): p for f, p in zip(families, plain)}, **dict(zip(wanted, predicted))}


def _shape(shape: dict, layers: int) -> None:
    """A trace worker takes the parent's shape (--smoke changes it)."""
    global SHAPE, LAYERS
    SHAPE, LAYERS = shape, layers


def configs(trace: Path, experts: int) -> dict[str, e2e.Config]:
    """Named for the 256-expert model (102 = 40%, 32 = 1/8, 128 = 1/2 of the experts); the same shares otherwise.
    One per bench_names.BASES, in its order (the names parse_name knows)."""
    replay = {"BIGMOE_ROUTE_REPLAY": str(trace)}
    paged = {**replay, "BIGMOE_PAGER": "1", "BIGMOE_CUDA_GRAPHS": "1"}
    ranges, layerbuf = {"BIGMOE_PREFILL_BUFFER": "0"}, {"BIGMOE_PREFILL_BUFFER": "1"}
    s40, s12, s50 = str(round(0.4 * experts)), str(experts // 8), str(experts // 2)
    return {
        c.name: c
        for c in [
            e2e.Config("resident", replay),
            e2e.Config("offload17", replay),
            e2e.Config("bigmoe-102", {**paged, "BIGMOE_VRAM_SLOTS": s40, **ranges}),
            e2e.Config("bigmoe-32", {**paged, "BIGMOE_VRAM_SLOTS": s12, **ranges}),
            e2e.Config("bigmoe-32-ram128-ssd", {**paged, "BIGMOE_VRAM_SLOTS": s12, "BIGMOE_RAM_SLOTS": s50, **ranges}),
            e2e.Config("bigmoe-102-layerbuf", {**paged, "BIGMOE_VRAM_SLOTS": s40, **layerbuf}),
            e2e.Config("bigmoe-32-layerbuf", {**paged, "BIGMOE_VRAM_SLOTS": s12, **layerbuf}),
            e2e.Config(
                "bigmoe-32-ram128-ssd-layerbuf",
                {**paged, "BIGMOE_VRAM_SLOTS": s12, "BIGMOE_RAM_SLOTS": s50, **layerbuf},
            ),
        ]
    }


def use_smoke_shape() -> None:
    """--smoke: a 2-layer bf16 model on vLLM's CPU build, to check this script's plumbing (not a result)."""
    global SHAPE, LAYERS, PROMPT_TOKENS, GEN_TOKENS
    SHAPE = {**e2e.SHAPES["smoke"]}
    LAYERS, PROMPT_TOKENS, GEN_TOKENS = 2, 200, 9


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return bench_combine.combine(args.combine, args.out, args.path, args.recall_0_calls)
    if args.smoke:
        use_smoke_shape()
    deadline = time.monotonic() + args.budget_s
    out = args.out.resolve()
    logs = (args.logs or out.with_name(out.stem + "_logs")).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    report: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "configs": []}
    report["gpu"] = gpu_name()
    started = time.monotonic()
    try:
        model, made_s = checkpoint(work, logs)
    except e2e.CheckpointFailed as e:
        print(f"gpu_vllm_bench: {e}", file=sys.stderr)
        return 1
    traces_of = make_traces(work, names, args.families, args.recalls, args.precision, args.wrong)
    report["checkpoint"] = {"path": str(model), "layers": LAYERS, **SHAPE, "seconds": made_s}
    report["routing_families"], report["precision"] = args.families, args.precision or "top-k"
    report["wrong_ids"] = args.wrong
    report["prepare_s"] = round(time.monotonic() - started, 1)
    if args.prepare_only:  # checkpoint and traces made (e.g. while vLLM is still being staged); no engine
        e2e.write_json(out, report)
        return 0
    if any("BIGMOE_RAM_SLOTS" in config_for(n, Path("t"), 256).env for n in names):
        report["disk"] = disk_bandwidth(model, seconds=2.0 if args.smoke else 4.0)  # before any engine starts
    plans = [(n, measurements(n, args.families, args.recalls, traces_of, args.wrong)) for n in names]
    spec = {**bench_spec(model), "turn_file": str(work / "turn.lock"), "quiet_file": str(work / "starting.lock")}
    spec["stacks_dir"] = str(logs)  # each engine's start sampled every 10 s: where a slow load spends its time
    if args.profile_tokens:  # a kernel timeline of a few decode tokens per measurement (traces stay in the logs dir)
        spec.update(profile_tokens=args.profile_tokens, profile_dir=str(logs / "profiles"))
    if args.parallel > 1 and SHAPE["device"] == "cuda":
        spec.update(kv_cache_memory_bytes=PARALLEL_KV_BYTES, gpu_memory_utilization=PARALLEL_GPU_MEMORY_UTILIZATION)
    rows: dict[str, list[dict]] = {}
    host = HostMemoryBudget(psutil.virtual_memory().available - HOST_MARGIN_BYTES)
    written = threading.Lock()  # engines finish on several threads; the report is rewritten whole by one at a time

    def one(plan: tuple[str, list[dict]]) -> None:
        name, todo = plan
        config = config_for(name, Path(todo[0]["trace"]), SHAPE["experts"])
        run_spec = {**spec, "measurements": todo}
        if name == "offload17":
            run_spec.update(cpu_offload_gb=17, cpu_offload_params=["w13_weight", "w2_weight"])
        with host.reserve(engine_host_bytes(config), name, say=lambda line: print(line, flush=True)):
            if time.monotonic() >= deadline:
                row = e2e.skipped(config, "time budget spent")
            else:
                row = e2e.run_config(config, run_spec, work, logs, deadline)
        with written:
            rows[name] = bench_rows.engine_rows(row, todo, report.get("disk"), args.wrong)
            report["configs"] = [r for n, _ in plans if n in rows for r in rows[n]]
            e2e.write_json(out, report)
            for r in rows[name]:
                brief = {k: v for k, v in r.items() if k not in ("pager_totals", "timed_counters", "tokens", "env")}
                print(json.dumps(brief), flush=True)

    report["host_samples"] = str(logs / "host.jsonl")  # memory, page cache, disk reads, CPU every 5 s (engine loads)
    with HostMonitor(logs / "host.jsonl", period_s=5.0), ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        list(pool.map(one, plans))
    report["total_s"] = round(time.monotonic() - started, 1)
    e2e.write_json(out, report)
    return 0 if all("error" not in r for r in report["configs"]) else 1


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument(
        "--configs",
        default="resident,offload17,bigmoe-102,bigmoe-32,bigmoe-32-ram128-ssd",
        help="comma list of configurations to run, in order",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/bigmoe-vllm-bench"),
        help="checkpoint and trace (a local disk where O_DIRECT works; about 31 GiB)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="directory of the per-run logs (default: <out stem>_logs beside --out; the device tool returns 8 files)",
    )
    p.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs after this many seconds")
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="make the checkpoint and the traces the configurations need, then stop",
    )
    p.add_argument("--smoke", action="store_true", help="a 2-layer bf16 model on vLLM's CPU build (plumbing check)")
    p.add_argument("--combine", type=Path, nargs="+", help="merge these result files into --out, with the ratios")
    p.add_argument(
        "--path",
        default="",
        help="with --combine: the prefetching rows the ratios come from are those whose name ends in these "
        "suffixes (e.g. +one-node+host+chained-only), where measured; named as the families' `path`",
    )
    p.add_argument(
        "--recall-0-calls",
        type=int,
        default=1,
        help="with --combine: recall 0 against no prefetch is the mean of the ratios of the latest N calls that ran "
        "both rows side by side (name the calls of one build: one call's engines differ by up to 0.2 ms, run 40)",
    )
    p.add_argument(
        "--families",
        default=None,
        help="comma list of routing families (scripts/traces.py) each engine measures in turn: "
        + ", ".join(traces.FAMILIES)
        + " (default standard)",
    )
    p.add_argument("--family", default=None, help="one routing family (the same as a one-item --families)")
    p.add_argument(
        "--recalls",
        default=",".join(f"{r:g}" for r in RECALLS),
        help="comma list of the prediction recalls a bare @r configuration is measured at; RECALL:WRONG draws that "
        "point's wrong ids another way than --wrong (e.g. 0,0:none,0.8,0.8:popular)",
    )
    p.add_argument(
        "--precision",
        type=float,
        default=None,
        help="precision of the predictions (default: a top-k proposal, k ids per row, so precision = recall)",
    )
    p.add_argument(
        "--wrong",
        default="uniform",
        choices=traces.WRONG_MODELS,
        help="a proposal's wrong ids: uniform (pessimistic), popular (recently used ones) or none (only right ones)",
    )
    p.add_argument("--parallel", type=int, default=1, help="engines started at once (their timings still take turns)")
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=0,
        help="after each measurement, this many decode tokens under torch.profiler: per-stream kernel time, the "
        "main stream's wait for the prefetch stream (decode_profile in each row; 0: none)",
    )
    args = p.parse_args(argv)
    if args.families and args.family:
        p.error("give --families or --family, not both")
    args.families = (args.families or args.family or "standard").split(",")
    unknown = [f for f in args.families if f not in traces.FAMILIES]
    if unknown:
        p.error(f"routing family {unknown[0]!r} is unknown; choose {', '.join(traces.FAMILIES)}")
    try:
        args.recalls = parse_points(args.recalls, args.wrong)
    except ValueError:
        p.error(
            f"--recalls {args.recalls!r}: a comma list of numbers in [0, 1], each maybe with :WRONG "
            f"({', '.join(traces.WRONG_MODELS)})"
        )
    if args.precision is not None and not 0 < args.precision <= 1:
        p.error("--precision takes a number in (0, 1]")
    if args.parallel < 1:
        p.error("--parallel takes a count of at least 1")
    if args.recall_0_calls < 1:
        p.error("--recall-0-calls takes a count of at least 1")
    if not args.combine:
        for name in args.configs.split(","):
            try:
                parse_name(name)
            except KeyError:
                p.error(
                    f"configuration {name!r} is unknown: a name of the module's list, then @r[RECALL] "
                    f"and/or ~POLICY ({', '.join(EVICTIONS)})"
                )
            except ValueError:
                p.error(f"configuration {name!r}: @r takes a recall in [0, 1], and {AHEAD} or {HIGH} needs one")
        copying = [n for n in args.configs.split(",") if HOST_COPIER in n and prefetches(n, args)]
        if args.profile_tokens and copying and not args.smoke:
            p.error(
                f"--profile-tokens with {copying[0]!r} at a recall above 0: in the overlap probe, host-copied rounds "
                "crawled once torch.profiler had run in the process (runs 36-37), and an engine's later measurements "
                "follow each profile; profile a configuration without +host"
            )
    return args


def prefetches(name: str, args) -> bool:
    """Whether an engine of this configuration measures a point that prefetches (a recall above 0)."""
    return any(point is not None and point.recall > 0 for point in recalls_of(name, args.recalls, args.wrong))


def checkpoint(work: Path, logs: Path) -> tuple[Path, float]:
    """The 40-layer checkpoint (no tokenizer: prompts are token ids), made once per machine."""
    out = work / f"{SHAPE['dtype']}-{SHAPE['experts']}x{SHAPE['hidden']}-{LAYERS}l"
    started = time.monotonic()
    maker = e2e.MAKERS["qwen3moe"]
    cmd = [sys.executable, str(maker), str(out), "--layers", str(LAYERS), "--seed", "0", "--no-tokenizer"]
    for key, value in SHAPE.items():
        if key == "maker":  # the smoke shape names its generator
            continue
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(cmd, env=e2e.child_env({}), capture_output=True, text=True)
    (logs / "prepare.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise e2e.CheckpointFailed(f"making the checkpoint failed (see prepare.log): {last}")
    return out, round(time.monotonic() - started, 1)


def bench_spec(model: Path) -> dict:
    ids = np.random.default_rng(0).integers(3, min(SHAPE["vocab"], 150000) - 3, 2 * PROMPT_TOKENS).tolist()
    return {
        "task": "bench",
        "model": str(model),
        "max_model_len": 2048,
        "max_num_seqs": 1,
        "kv_cache_memory_bytes": None if SHAPE["device"] == "cuda" else 256 << 20,
        "enforce_eager": False,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "skip_tokenizer_init": True,
        "timing_ids": ids[:PROMPT_TOKENS],
        "warmup_ids": ids[PROMPT_TOKENS:],
        "timing_tokens": GEN_TOKENS,
    }


def disk_bandwidth(model: Path, seconds: float, workers: int | None = None, layout=None) -> dict:
    """The disk's O_DIRECT read bandwidth for reads of one expert record, read as the SSD tier reads the checkpoint
    (CheckpointStore, random (layer, expert), the pager's I/O worker count), for about `seconds`. Run by the parent
    with no engine timing; {"error": ...} where the checkpoint cannot be read so. layout: the checkpoint's expert
    layout (default: this benchmark's SHAPE)."""
    from bigmoe_bench import synth_experts
    from bigmoe_bench.disk_reads import read_records
    from bigmoe_pager.core.expert_store import CheckpointError, CheckpointStore
    from bigmoe_pager.core.odirect import ODirectError, ReadError

    workers = workers or PagerSettings().io_workers
    layout = layout or synth_experts.make_layout(SHAPE["hidden"], SHAPE["moe_intermediate"], SHAPE["dtype"] == "fp8")
    try:
        store = CheckpointStore(model, layout)
    except (CheckpointError, ODirectError, OSError) as e:
        return {"error": f"cannot open the checkpoint for O_DIRECT reads: {e}"}
    keys = [tuple(k) for k in np.random.default_rng(0).integers(0, [store.num_layers, store.num_experts], (1 << 16, 2))]
    started = time.monotonic()
    try:
        with store:
            reads = read_records(store, keys, workers, deadline=started + seconds)
    except (ODirectError, ReadError, OSError) as e:
        return {"error": f"O_DIRECT reads of the checkpoint failed: {e}"}
    elapsed = time.monotonic() - started
    return {
        "gb_per_s": round(reads * layout.record_bytes / elapsed / 1e9, 3),
        "record_bytes": layout.record_bytes,
        "reads": reads,
        "workers": workers,
        "seconds": round(elapsed, 2),
    }


def gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi gives it (None where there is none): combine pairs rows of one card."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names else None


if __name__ == "__main__":
    sys.exit(main())
