"""TPOT and TTFT of Qwen3.8-Flash-Next-shaped layers on vLLM 0.33, side by side in one call: resident,
vLLM's --cpu-offload-gb at the pager's VRAM, and the pager at the slots `bigmoe plan` picks for an RTX 4090
with 64 GB of RAM.

    python3 scripts/gpu_qwen4exp_bench.py --model DIR --out $OUT/qwen4exp-bench.json [--configs ...]

DIR is a Qwen4Exp checkpoint from scripts/make_qwen4exp.py (FP8, few layers). Batch 1, a 1,024-token prompt and
256 generated tokens after a warm-up request of the same shape, the preset's graph mode (PIECEWISE breakable CUDA
graphs), routing of every configuration replaced by the standard trace (BIGMOE_ROUTE_REPLAY, benchmark only:
random routers route almost uniformly). Configurations run one after another in their own processes:

    resident        every expert in VRAM (the floor)
    offload         --cpu-offload-gb G --cpu-offload-params w13_weight w2_weight, G = the expert bytes the pager
                    keeps off the GPU (every expert minus its VRAM slots and prefill buffer): equal VRAM
    bigmoe-4090     the plan's per-layer tiers for a 4090 with 64 GB (--vram-slots/--ram-slots; default 35/218 of
                    512, from `bigmoe plan qwen3.8-flash-next --vram-gib 24 --ram-gib 64 --disk nvme`), the rest read
                    from the checkpoint on SSD, whole-layer prefill buffer, n-gram pager on (as the plan runs it)
    bigmoe-4090-nongram  the same with vLLM's own n-gram table (separates the n-gram pager's cost)
    bigmoe-allram   bigmoe-4090's VRAM slots with every expert in RAM (no SSD tier): the offload run's RAM

A bigmoe name may end in @rX (the trace also carries next-layer predictions at recall X; a top-k proposal of k ids
per row, so precision = recall, as scripts/gpu_vllm_bench.py makes them, unless --precision is given:
the pager prefetches them, issue 15) and then +ahead (the same predictions post SSD reads ahead of need) or +ahead4
(four layers ahead: the replayed rows for later layers are as right as the next layer's, unless
--ahead-recall-drop X gives the traces proposals for layers 2-4 ahead at X less recall per layer past the next), as
in scripts/gpu_vllm_bench.py: bigmoe-4090@r0.8+ahead. --family picks the routing family (docs/routing.md).

Before any engine starts, --disk-s seconds of O_DIRECT expert reads of the checkpoint measure the disk (report "disk",
as scripts/gpu_vllm_bench.py does); each row that read from SSD then carries its disk floors (bench_rows.disk_floors:
TPOT floor = its SSD GB a token over that bandwidth), the line against which reads ahead are judged.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import bench_names  # noqa: E402  (scripts/ is not a package)
import bench_rows  # noqa: E402
import gpu_vllm_bench as bench  # noqa: E402
import gpu_vllm_e2e as e2e  # noqa: E402
import numpy as np
import traces  # noqa: E402

GIB = 1 << 30
AHEAD_DEPTH = int(bench_names.suffix_env(bench_names.AHEAD_DEEP)["BIGMOE_SSD_READ_AHEAD_LAYERS"])
"""Layers ahead the deepest read-ahead name reads (+ahead4): the depths --ahead-recall-drop makes proposals for."""


def model_numbers(model: Path) -> dict:
    """Experts, top-k and MoE layers from the checkpoint's config.json (text config nested or not)."""
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    return {
        "experts": int(text["num_experts"]),
        "top_k": int(text["num_experts_per_tok"]),
        "layers": int(text["num_hidden_layers"]),
        "vocab": int(text["vocab_size"]),
    }


def expert_bytes(model: Path) -> int:
    """Bytes of one routed expert (weights and block scales) from the safetensors headers."""
    from bigmoe_pager.core.safetensors_index import index_files

    index = index_files(sorted(model.glob("*.safetensors")))
    # Decoder layer 0's expert 0 only: "mtp.layers.0.mlp.experts.0." names the MTP layer's (a first run of this
    # bench on the H200 counted both, and asked --cpu-offload-gb for twice the expert bytes there are).
    one = [t for name, t in index.items() if re.match(r"model\.(language_model\.)?layers\.0\.mlp\.experts\.0\.", name)]
    if not one:
        raise SystemExit(f"gpu_qwen4exp_bench: {model} has no tensors of decoder layer 0's expert 0")
    return sum(t.nbytes for t in one)


def expert_layout(model: Path):
    """The vLLM-fused layout of the checkpoint's routed experts, as the SSD tier reads them (config.json's hidden and
    expert sizes; FP8 with block scales where its quantization_config says fp8)."""
    from bigmoe_bench import synth_experts

    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    return synth_experts.make_layout(int(text["hidden_size"]), int(text["moe_intermediate_size"]), fp8)


def configs(trace: Path, numbers: dict, vram: int, ram: int, offload_gib: float) -> list[tuple[e2e.Config, dict]]:
    replay = {**e2e.QWEN4EXP_ENV, "BIGMOE_ROUTE_REPLAY": str(trace)}
    paged = {
        **replay,
        "BIGMOE_PAGER": "1",
        "BIGMOE_CUDA_GRAPHS": "1",
        "BIGMOE_PREFILL_BUFFER": "1",
        "BIGMOE_VRAM_SLOTS": str(vram),
        "BIGMOE_RAM_SLOTS": str(ram),
    }
    offload = {"cpu_offload_gb": round(offload_gib, 2), "cpu_offload_params": ["w13_weight", "w2_weight"]}
    engine = {"engine": e2e.QWEN4EXP_ENGINE, "max_cudagraph_capture_size": max(1, vram // numbers["top_k"])}
    return [
        (e2e.Config("resident", replay), engine),
        (e2e.Config("offload", replay), {**engine, **offload}),
        (e2e.Config("bigmoe-4090", {**paged, "BIGMOE_NGRAM": "1"}), engine),
        (e2e.Config("bigmoe-4090-nongram", paged), engine),
        # The offload run keeps every offloaded expert in RAM; this is the pager at the same VRAM slots and RAM too.
        (
            e2e.Config("bigmoe-allram", {**paged, "BIGMOE_RAM_SLOTS": str(numbers["experts"]), "BIGMOE_NGRAM": "1"}),
            engine,
        ),
    ]


CONFIG_NAMES = ("resident", "offload", "bigmoe-4090", "bigmoe-4090-nongram", "bigmoe-allram")


READ_AHEAD_SUFFIXES = {bench_names.AHEAD, bench_names.AHEAD_DEEP}
"""The name suffixes this bench takes (bench_names' language): SSD reads ahead, one or four layers deep."""


def split_name(name: str) -> tuple[str, float | None]:
    """'bigmoe-4090@r0.8+ahead' -> ('bigmoe-4090', 0.8); a name without @r has recall None. A name with another
    suffix, or more than one, is returned whole (no configuration has that name)."""
    stem, suffixes = bench_names.split_suffixes(name)
    if len(suffixes) > 1 or not set(suffixes) <= READ_AHEAD_SUFFIXES:
        return name, None
    base, at, recall = stem.partition("@r")
    try:
        value = float(recall) if at else None
    except ValueError:
        return name, None
    return (base, value) if value is None or 0.0 <= value <= 1.0 else (name, None)


def predicted_trace(trace: Path, recall: float, precision: float | None, experts: int, drop: float = 0.0) -> Path:
    """`trace` with next-layer predictions at (recall, precision; None: top-k) added, written beside it. Made afresh
    on every call: the family trace itself is rewritten each run for the model at hand, so a kept file could carry
    another checkpoint's layers or experts. drop > 0: it also carries proposals for layers 2 .. AHEAD_DEPTH ahead,
    at recall - drop per layer past the next (never below 0), which reads ahead that far replay instead of the
    next-layer rows (as right as the next layer's: an upper bound)."""
    tag = "topk" if precision is None else f"p{precision:g}"
    path = trace.with_name(f"{trace.stem}-r{recall:g}-{tag}" + (f"-drop{drop:g}" if drop else "") + ".npz")
    ids = traces.load_trace(trace, experts)
    deeper = None
    if drop:
        recalls = [max(0.0, recall - drop * (d - 1)) for d in range(2, AHEAD_DEPTH + 1)]
        deeper = traces.deeper_predictions(ids, recalls, precision, experts)
    traces.save_trace(path, ids, traces.predictions(ids, recall, precision, experts), deeper)
    return path


def with_suffixes(name: str, named: dict, predicted: dict[float, Path]) -> tuple[e2e.Config, dict]:
    """The named configuration with its @rX (the trace `predicted` holds for recall X) and +ahead / +ahead4 (SSD
    read-ahead, one or four layers deep) applied."""
    base, recall = split_name(name)
    config, extra = named[base]
    env = dict(config.env)
    if recall is not None:
        env["BIGMOE_ROUTE_REPLAY"] = str(predicted[recall])
    for suffix in bench_names.split_suffixes(name)[1]:
        env.update(bench_names.suffix_env(suffix))
    return e2e.Config(name, env), extra


def report_row(row: dict, disk: dict | None = None) -> dict:
    """One configuration's report row from e2e.run_config's: its name, env and seconds, the engine's facts
    (bench_rows.ENGINE_FIELDS), the summary of its one measurement (bench_rows.summarize) and, where it read from SSD
    and `disk` (disk_bandwidth's) has a bandwidth, its disk floors (bench_rows.disk_floors); or its error."""
    head = {k: row[k] for k in ("name", "env", "seconds") if k in row}
    if "error" in row:
        return {**head, "error": row["error"]}
    result = row["result"]
    measurements = result.get("measurements") or []
    if not measurements:
        return {**head, "error": "the engine returned no measurement"}
    engine = {k: result.get(k) for k in bench_rows.ENGINE_FIELDS}
    return {**head, **engine, **bench_rows.summarize(measurements[0]), **bench_rows.disk_floors(measurements[0], disk)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Qwen4Exp checkpoint (scripts/make_qwen4exp.py)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--configs", default="resident,offload,bigmoe-4090,bigmoe-4090-nongram")
    p.add_argument("--vram-slots", type=int, default=35, help="per layer: the plan's for a 4090 with 64 GB")
    p.add_argument("--ram-slots", type=int, default=218, help="per layer: the plan's for a 4090 with 64 GB")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bigmoe-qwen4exp-bench"))
    p.add_argument("--budget-s", type=float, default=560.0)
    p.add_argument(
        "--disk-s",
        type=float,
        default=4.0,
        help="seconds of O_DIRECT reads of the checkpoint before any engine, for the rows' disk floors (0: none)",
    )
    p.add_argument(
        "--ahead-recall-drop",
        type=float,
        default=0.0,
        help="@rX traces also carry proposals 2-4 layers ahead at X minus this per layer past the next "
        "(0: reads that far ahead replay the next-layer rows, as right as the next layer's)",
    )
    p.add_argument("--family", default="standard", help="routing family of scripts/traces.py (docs/routing.md)")
    p.add_argument(
        "--precision",
        type=float,
        default=None,
        help="precision of the predictions of @rX names (default: a top-k proposal, so precision = recall)",
    )
    args = p.parse_args(argv)
    if args.precision is not None and not 0.0 < args.precision <= 1.0:
        p.error(f"--precision is the share of a proposal that is right, in (0, 1]; got {args.precision}")
    if not 0.0 <= args.ahead_recall_drop <= 1.0:
        p.error(f"--ahead-recall-drop is recall lost per layer further ahead, in [0, 1]; got {args.ahead_recall_drop}")
    for name in args.configs.split(","):
        base, recall = split_name(name)
        suffixed = recall is not None or bool(bench_names.split_suffixes(name)[1])
        if base not in CONFIG_NAMES or (suffixed and (recall is None or not base.startswith("bigmoe"))):
            p.error(
                f"configuration {name!r} is unknown: one of {', '.join(CONFIG_NAMES)}, "
                "a bigmoe one may end @rX[+ahead|+ahead4]"
            )
    deadline = time.monotonic() + args.budget_s
    out = args.out.resolve()
    logs = out.with_name(out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    numbers = model_numbers(args.model)
    record = expert_bytes(args.model)
    total = numbers["layers"] * numbers["experts"] * record
    # Equal VRAM: what the pager keeps on the GPU is its slots and one whole-layer prefill buffer.
    on_gpu = numbers["layers"] * args.vram_slots * record + numbers["experts"] * record
    offload_gib = max(0.0, (total - on_gpu) / GIB)
    trace = work / f"{args.family}-trace.npz"
    traces.save_trace(
        trace, traces.named_trace(args.family, 16384, numbers["layers"], numbers["experts"], numbers["top_k"], seed=0)
    )
    ids = np.random.default_rng(0).integers(3, numbers["vocab"] - 3, 2 * bench.PROMPT_TOKENS).tolist()
    spec = {
        **bench.bench_spec(args.model),
        "timing_ids": ids[: bench.PROMPT_TOKENS],
        "warmup_ids": ids[bench.PROMPT_TOKENS :],
    }
    report: dict = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": str(args.model),
        **numbers,
        "expert_bytes": record,
        "expert_gib": round(total / GIB, 2),
        "pager_vram_gib": round(on_gpu / GIB, 2),
        "offload_gib": round(offload_gib, 2),
        "family": args.family,
        "precision": args.precision or "top-k",  # of the @rX rows' predictions
        "ahead_recall_drop": args.ahead_recall_drop,  # per layer past the next, for reads further ahead
        "configs": [],
    }
    named = {
        config.name: (config, extra)
        for config, extra in configs(trace, numbers, args.vram_slots, args.ram_slots, offload_gib)
    }
    if args.disk_s > 0:  # before any engine starts, so nothing else reads the disk
        report["disk"] = bench.disk_bandwidth(args.model, args.disk_s, layout=expert_layout(args.model))
        print(json.dumps({"disk": report["disk"]}), flush=True)
    # One trace a recall, made before the first engine (names such as @r0.8 and @r0.8+ahead share it)
    recalls = {split_name(name)[1] for name in args.configs.split(",")} - {None}
    drop = args.ahead_recall_drop
    predicted = {r: predicted_trace(trace, r, args.precision, numbers["experts"], drop) for r in recalls}
    for name in args.configs.split(","):
        config, extra = with_suffixes(name, named, predicted)
        if time.monotonic() >= deadline:
            row = e2e.skipped(config, "time budget spent")
        else:
            row = e2e.run_config(config, {**spec, **extra}, work, logs, deadline)
        report["configs"].append(report_row(row, report.get("disk")))
        e2e.write_json(out, report)
        print(json.dumps(report["configs"][-1]), flush=True)
    tpot = {r["name"]: r.get("tpot_ms") for r in report["configs"]}
    if tpot.get("bigmoe-4090") and tpot.get("offload"):
        report["speedup_vs_offload"] = round(tpot["offload"] / tpot["bigmoe-4090"], 3)
    if tpot.get("bigmoe-4090") and tpot.get("resident"):
        report["tpot_vs_resident"] = round(tpot["bigmoe-4090"] / tpot["resident"], 3)
    e2e.write_json(out, report)
    print({k: v for k, v in report.items() if k != "configs"})
    return 0 if all("error" not in r for r in report["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
