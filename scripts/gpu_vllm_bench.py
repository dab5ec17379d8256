"""TPOT and TTFT of real vLLM on the H200, side by side: resident, vLLM's --cpu-offload-gb, and the pager.

    PYTHONPATH=/tmp/site:pager:app VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 scripts/gpu_vllm_bench.py --out $OUT/vllm-gpu.json [--configs resident,offload17,...]
    python3 scripts/gpu_vllm_bench.py --combine A.json B.json --out docs/bench/vllm-gpu.json

(vLLM 0.25.1 and the project wheel staged into /tmp/site as shared/gpu-vllm/README.md says.)
Makes (once; reused while the machine lives) a 40-layer FP8 synthetic Qwen3-MoE with
Qwen3.6-35B-A3B's shapes (256 experts of 2048 -> 512, top-8, 128x128 block scales,
about 30 GiB of experts) and the standard routing trace (Zipf 1.4, reuse 0.3; 40 layers).
Each configuration runs in its own process with vLLM's default CUDA-graph mode, batch 1
(max_num_seqs=1), prefix caching off, a 1,024-token prompt and 256 generated tokens
after a warm-up request of the same shape. Routing of every configuration, resident and
offload included, is replaced by the trace through BIGMOE_ROUTE_REPLAY, a benchmark-only
switch (random routers route almost uniformly; dummy weights route every token to
experts 0-7).

    resident             every expert in VRAM
    offload17            --cpu-offload-gb 17 --cpu-offload-params w13_weight w2_weight
    bigmoe-102           102 VRAM slots per layer (40%), every expert in pinned RAM; prefill in token ranges
    bigmoe-32            32 VRAM slots per layer (12.5%), every expert in pinned RAM; prefill in token ranges
    bigmoe-32-ram128-ssd 32 VRAM slots, 128 RAM slots, the rest read from the checkpoint on SSD; token ranges
    bigmoe-102-layerbuf  bigmoe-102 with prefill over one whole-layer VRAM buffer (BIGMOE_PREFILL_BUFFER=1,
                         the plugin's default since session 4)
    bigmoe-32-layerbuf   bigmoe-32 with that buffer
    bigmoe-32-ram128-ssd-layerbuf  bigmoe-32-ram128-ssd with that buffer (experts gathered through the slots)

A configuration name may carry suffixes: `@rX` replays a trace that also carries next-layer
predictions at recall X (precision --precision), so the pager prefetches on a side stream
(docs/routing.md); `~POLICY` sets BIGMOE_EVICTION (lru, lfu, lfu-fast); a last `+ahead` (with @rX) lets the
same predictions post SSD reads ahead of need (BIGMOE_SSD_READ_AHEAD=1). --family picks the
routing family of scripts/traces.py (standard, topic-shift, near-uniform; default standard,
bit for bit the trace of the earlier runs). Example (issue 15):

    --family topic-shift --configs resident,offload17,bigmoe-102,bigmoe-102@r0.8,bigmoe-32@r0.8

--combine merges result files of several calls (one configuration set each) and computes
the ratios the issue asks for, per family.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import gpu_vllm_e2e as e2e  # noqa: E402  (scripts/ is not a package)
import numpy as np
import traces  # noqa: E402

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


AHEAD = "+ahead"
"""Name suffix: the predictions also post SSD reads ahead of need (BIGMOE_SSD_READ_AHEAD=1); needs @rRECALL."""


def parse_name(name: str) -> tuple[str, float | None, str | None]:
    """'bigmoe-102@r0.8~lru' -> ('bigmoe-102', 0.8, 'lru') (a trailing +ahead is checked, not returned); KeyError
    for an unknown base or policy, ValueError for a recall outside [0, 1] or +ahead without a recall."""
    ahead = name.endswith(AHEAD)
    base, _, policy = name.removesuffix(AHEAD).partition("~")
    base, at, recall = base.partition("@r")
    if base not in configs(Path("trace"), 256) or (policy and policy not in EVICTIONS):
        raise KeyError(name)
    value = float(recall) if at else None
    if (value is not None and not 0.0 <= value <= 1.0) or (ahead and value is None):
        raise ValueError(name)
    return base, value, policy or None


def config_for(name: str, trace: Path, experts: int, family: str, precision: float, work: Path) -> e2e.Config:
    """A named configuration, its suffixes applied (@rX: a trace with predictions at recall X; ~POLICY: eviction)."""
    base, recall, policy = parse_name(name)
    env = dict(configs(trace, experts)[base].env)
    if recall is not None:
        env["BIGMOE_ROUTE_REPLAY"] = str(predicted_trace(work, trace, family, recall, precision, experts))
    if policy:
        env["BIGMOE_EVICTION"] = policy
    if name.endswith(AHEAD):
        env["BIGMOE_SSD_READ_AHEAD"] = "1"
    return e2e.Config(name, env)


EVICTIONS = ("lru", "lfu", "lfu-fast")


def family_trace(work: Path, family: str) -> Path:
    """The family's 16,384-token trace for LAYERS layers, made once per machine (standard: the earlier runs' file)."""
    path = work / f"{family}-trace.npz"
    if not path.exists():
        traces.save_trace(path, traces.named_trace(family, 16384, LAYERS, SHAPE["experts"], SHAPE["top_k"], seed=0))
    return path


def predicted_trace(work: Path, trace: Path, family: str, recall: float, precision: float, experts: int) -> Path:
    """The family's trace with predicted_ids at (recall, precision), made once per machine."""
    path = work / f"{family}-r{recall:g}-p{precision:g}-trace.npz"
    if not path.exists():
        ids = traces.load_trace(trace)
        traces.save_trace(path, ids, traces.predictions(ids, recall, precision, experts, seed=0))
    return path


def configs(trace: Path, experts: int) -> dict[str, e2e.Config]:
    """Named for the 256-expert model (102 = 40%, 32 = 1/8, 128 = 1/2 of the experts); the same shares otherwise."""
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
        return combine(args.combine, args.out)
    if args.smoke:
        use_smoke_shape()
    deadline = time.monotonic() + args.budget_s
    out = args.out.resolve()
    logs = (args.logs or out.with_name(out.stem + "_logs")).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "configs": []}
    try:
        model, made_s = checkpoint(work, logs)
    except e2e.CheckpointFailed as e:
        print(f"gpu_vllm_bench: {e}", file=sys.stderr)
        return 1
    trace = family_trace(work, args.family)
    report["checkpoint"] = {"path": str(model), "layers": LAYERS, **SHAPE, "seconds": made_s}
    report["family"] = args.family
    spec = bench_spec(model)
    for name in args.configs.split(","):
        config = config_for(name, trace, SHAPE["experts"], args.family, args.precision, work)
        run_spec = (
            {**spec, "cpu_offload_gb": 17, "cpu_offload_params": ["w13_weight", "w2_weight"]}
            if name == "offload17"
            else spec
        )
        if time.monotonic() >= deadline:
            row = e2e.skipped(config, "time budget spent")
        else:
            row = e2e.run_config(config, run_spec, work, logs, deadline)
        report["configs"].append({**summarize(row), "family": args.family, "recall": parse_name(name)[1]})
        e2e.write_json(out, report)
        print(json.dumps(report["configs"][-1]), flush=True)
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
    p.add_argument("--smoke", action="store_true", help="a 2-layer bf16 model on vLLM's CPU build (plumbing check)")
    p.add_argument("--combine", type=Path, nargs="+", help="merge these result files into --out, with the ratios")
    p.add_argument(
        "--family", default="standard", help="routing family (scripts/traces.py): " + ", ".join(traces.FAMILIES)
    )
    p.add_argument("--precision", type=float, default=0.5, help="precision of the predictions of @rX configurations")
    args = p.parse_args(argv)
    if args.family not in traces.FAMILIES:
        p.error(f"--family {args.family!r} is unknown; choose {', '.join(traces.FAMILIES)}")
    if not args.combine:
        for name in args.configs.split(","):
            try:
                parse_name(name)
            except KeyError:
                p.error(
                    f"configuration {name!r} is unknown: a name of the module's list, then @rRECALL "
                    f"and/or ~POLICY ({', '.join(EVICTIONS)})"
                )
            except ValueError:
                p.error(f"configuration {name!r}: @r takes a recall in [0, 1], and {AHEAD} needs one")
    return args


def checkpoint(work: Path, logs: Path) -> tuple[Path, float]:
    """The 40-layer checkpoint (no tokenizer: prompts are token ids), made once per machine."""
    out = work / f"{SHAPE['dtype']}-{SHAPE['experts']}x{SHAPE['hidden']}-{LAYERS}l"
    started = time.monotonic()
    cmd = [sys.executable, str(e2e.MAKER), str(out), "--layers", str(LAYERS), "--seed", "0", "--no-tokenizer"]
    for key, value in SHAPE.items():
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


def summarize(row: dict) -> dict:
    """One record per configuration: times, hit rates, bytes per decoded token."""
    result = row.pop("result", None)
    if result is None:
        return row
    decode = result.get("decode_counters") or {}
    rate = lambda c: round(c["hits"] / c["lookups"], 4) if c.get("lookups") else None  # noqa: E731
    return {
        **row,
        "tpot_ms": result["tpot_ms"],
        "ttft_ms": result["ttft_ms"],
        "startup_s": result["startup_s"],
        "cudagraph_mode": result.get("cudagraph_mode"),
        "experts_kernel": result.get("experts_kernel"),
        "decode_hit_rate": {tier: rate(c) for tier, c in decode.items()},
        "pcie_gb_per_token": result.get("pcie_gb_per_token"),
        "ssd_gb_per_token": result.get("ssd_gb_per_token"),
        **prefetch_summary(decode, result.get("decode_tokens")),
        "pager_totals": result.get("pager"),
        "tokens": result.get("tokens"),
        "inductor_deterministic": result.get("inductor_deterministic"),
    }


def prefetch_summary(decode: dict, tokens: int | None) -> dict:
    """Issue 15's prefetch figures of the decode counters: per tier that was prefetched into, the share of the
    step's non-resident needs a prefetch had brought in (used / (used + misses)), and prefetched GB never used
    per token. Empty when nothing was prefetched."""
    out = {}
    for tier, c in decode.items():
        if not c.get("prefetched") or not tokens:
            continue
        used, misses = c.get("prefetch_used", 0), c["lookups"] - c["hits"]
        out[f"prefetch_accuracy_{tier}"] = round(used / (used + misses), 4) if used + misses else None
        out[f"prefetch_wasted_gb_per_token_{tier}"] = round(c.get("prefetch_wasted_bytes", 0) / tokens / 1e9, 5)
        out[f"prefetched_per_token_{tier}"] = round(c["prefetched"] / tokens, 3)
    return out


def family_ratios(rows: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """Per family, issue 15's ratios at prediction recall 0.8 (and without prefetch, for comparison)."""
    out = {}
    for family in sorted({f for f, _ in rows}):
        t = {name: r.get("tpot_ms") for (f, name), r in rows.items() if f == family}
        ratios = {}
        for suffix, key in (("@r0.8", ""), ("", "_no_prefetch")):
            at102, at32 = t.get("bigmoe-102" + suffix), t.get("bigmoe-32" + suffix)
            if at102 and t.get("offload17"):
                ratios["speedup_vs_offload17_at_102" + key] = round(t["offload17"] / at102, 3)
            if at102 and t.get("resident"):
                ratios["tpot_vs_resident_at_102" + key] = round(at102 / t["resident"], 3)
            if at32 and t.get("offload17"):
                ratios["speedup_vs_offload17_at_32" + key] = round(t["offload17"] / at32, 3)
        out[family] = ratios
    return out


def combine(files: list[Path], out: Path) -> int:
    rows = {}
    meta = {}
    for f in files:
        part = json.loads(f.read_text())
        meta.setdefault("checkpoint", part.get("checkpoint"))
        meta.setdefault("commands", []).append(part.get("command"))
        rows.update({(r.get("family", "standard"), r["name"]): r for r in part["configs"]})
    tpot = {name: r.get("tpot_ms") for (family, name), r in rows.items() if family == "standard"}
    for r in rows.values():
        # Greedy tokens of the timed request: which other configurations produced exactly the same.
        if r.get("tokens") is not None:
            r["same_tokens_as"] = [o["name"] for o in rows.values() if o is not r and o.get("tokens") == r["tokens"]]
    report = {**meta, "configs": list(rows.values()), "families": family_ratios(rows)}
    if tpot.get("bigmoe-102") and tpot.get("offload17") and tpot.get("resident"):
        report["speedup_vs_offload17_at_102"] = round(tpot["offload17"] / tpot["bigmoe-102"], 3)
        report["tpot_vs_resident_at_102"] = round(tpot["bigmoe-102"] / tpot["resident"], 3)
        report["targets"] = {
            "102 slots <= 1.6x resident": report["tpot_vs_resident_at_102"] <= 1.6,
            "102 slots >= 2.5x faster than offload17": report["speedup_vs_offload17_at_102"] >= 2.5,
            "32 slots faster than offload17": bool(tpot.get("bigmoe-32")) and tpot["bigmoe-32"] < tpot["offload17"],
        }
    e2e.write_json(out, report)
    for r in report["configs"]:
        print(
            f"{r['name']:24s} TPOT {r.get('tpot_ms')} ms  TTFT {r.get('ttft_ms')} ms  hit {r.get('decode_hit_rate')}"
            f"  PCIe GB/token {r.get('pcie_gb_per_token')}  SSD GB/token {r.get('ssd_gb_per_token')}"
            f"  same tokens as: {r.get('same_tokens_as', '-')}  {r.get('error', '')}"
        )
    print({k: v for k, v in report.items() if k not in ("configs", "checkpoint", "commands")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
