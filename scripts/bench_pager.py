"""Paging benchmark: decode tokens through MoE layers with real expert shapes, per configuration.

The protocol of DESIGN.md "Performance protocol": one MoE compute for every
configuration (resident, static offload, bigmoe at 12.5% and 40% VRAM, bigmoe
with the SSD tier at RAM 50%), routing from a family of scripts/traces.py (--family,
default standard) or a recorded one (--trace FILE.npz, topk_ids int32 [tokens, layers, k]).
bigmoe-prefetch runs next-layer prefetch on a side stream inside the token's graph, fed
with predictions made from the trace at each --recalls (precision --precision; default a top-k
predictor's: k ids per token, precision = recall). On a GPU
each token (all layers) is one CUDA graph, replayed per token, timed with CUDA
events after a warm-up (tiers warmed from a hot profile of the warm-up tokens).

    H200:  PYTHONPATH=pager:app:bench python scripts/bench_pager.py --out $OUT/pager.json
    CPU:   PYTHONPATH=pager:bench python scripts/bench_pager.py --device cpu --smoke --out /tmp/pager.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import bench_runners as br  # noqa: E402
from bigmoe_bench import traces  # noqa: E402
from bigmoe_pager.core.copy_kernel import copy_records  # noqa: E402
from bigmoe_pager.core.hot_profile import HotProfile  # noqa: E402

VRAM_FRACS = (0.125, 0.4)
SSD_VRAM_FRAC, SSD_RAM_FRAC = 0.4, 0.5


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_pager: --device cuda but no CUDA GPU is visible; use --device cpu --smoke", file=sys.stderr)
        return 2
    report = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "device": _device_name(device),
        "runs": [],
        "models": {},
        "notes": [],
    }
    report.update(_bandwidths(device))
    shapes = [br.SMOKE] if args.smoke else [br.MODELS[m] for m in args.models.split(",")]
    for done, shape in enumerate(shapes, 1):
        _bench_model(shape, args, device, report)
        report["complete"] = done == len(shapes)  # a run cut short keeps the models it finished, marked incomplete
        for path, text in (
            (args.out, lambda: json.dumps(report, indent=1) + "\n"),
            (args.markdown, lambda: _markdown(report)),
        ):
            if path:
                _write_atomic(path, text())
    _print_table(report)
    for path in (args.out, args.markdown):
        if path:
            print(f"wrote {path}")
    return 0


def _write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` whole (temp file + rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens: checks the code path (CPU)")
    ap.add_argument("--models", default=",".join(br.MODELS), help="comma list of presets")
    ap.add_argument("--layers", type=int, default=0, help="MoE layers to run (default: the preset's bench subset)")
    ap.add_argument("--tokens", type=int, default=0, help="timed tokens (default 256, smoke 12)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up tokens before timing (default 64, smoke 6)")
    ap.add_argument("--trace", type=Path, help="recorded routing .npz (topk_ids int32 [tokens, layers, k])")
    ap.add_argument(
        "--configs",
        default="resident,static,bigmoe,bigmoe-lfu,bigmoe+ssd",
        help="comma list (also bigmoe-unfused: acquire and copy as two launches; bigmoe-lfu-fast; "
        "bigmoe-prefetch: next-layer prefetch at each --recalls); resident always runs",
    )
    ap.add_argument("--family", default="standard", help="routing family of scripts/traces.py (when no --trace)")
    ap.add_argument("--recalls", default="0,0.6,0.8,0.95,1.0", help="prediction recalls of bigmoe-prefetch")
    ap.add_argument(
        "--precision",
        type=float,
        default=None,
        help="prediction precision of bigmoe-prefetch (default: a top-k predictor's, k ids per token, = recall)",
    )
    ap.add_argument("--policy", default="lfu-fast", help="eviction policy of bigmoe-prefetch")
    ap.add_argument(
        "--prefetch-budget",
        type=int,
        default=None,
        help="experts a bigmoe-prefetch layer's round copies at most (0: no limit; default: the pager's)",
    )
    ap.add_argument("--ssd-layers", type=int, default=4, help="layers the SSD-tier run uses (disk and time)")
    ap.add_argument("--ssd-dir", type=Path, default=None, help="where the SSD run writes its paging file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--markdown", type=Path, help="also write the table as Markdown (for docs/benchmarks.md)")
    args = ap.parse_args(argv)
    try:
        args.recalls = [float(r) for r in args.recalls.split(",") if r]
    except ValueError:
        ap.error(f"--recalls takes a comma list of numbers in [0, 1], got {args.recalls!r}")
    if args.family not in (*traces.FAMILIES, "recorded"):
        ap.error(f"--family {args.family!r} is unknown; choose {', '.join([*traces.FAMILIES, 'recorded'])}")
    if args.prefetch_budget is not None and args.prefetch_budget < 0:
        ap.error(f"--prefetch-budget takes a number of experts >= 0 (0: no limit), got {args.prefetch_budget}")
    args.tokens = args.tokens or (12 if args.smoke else 256)
    args.warmup = args.warmup or (6 if args.smoke else 64)
    return args


# ---- one model -------------------------------------------------------------------------


def _bench_model(shape: br.ModelShape, args, device: torch.device, report: dict) -> None:
    layers = min(args.layers or shape.bench_layers, shape.layers)
    if layers < shape.layers:
        report["notes"].append(
            f"{shape.name}: {layers} of {shape.layers} MoE layers run (machine RAM/VRAM/time); per-layer numbers scale"
        )
    trace = _trace(shape, layers, args)
    window = trace[args.warmup : args.warmup + args.tokens]
    profile = HotProfile.from_trace(trace[: args.warmup], shape.experts)
    layout = br.make_layout(shape)
    t0 = time.perf_counter()
    rams = br.make_ram_tiers(shape, layout, layers, device, args.seed)
    print(
        f"[{shape.name}] {layers} layers x {shape.experts} experts of {layout.record_bytes / 2**20:.2f} MiB "
        f"in RAM ({time.perf_counter() - t0:.1f} s); {args.tokens} timed tokens after {args.warmup}"
    )
    trace_dev = torch.from_numpy(trace).to(device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn((1, shape.hidden), generator=gen).to(torch.bfloat16).to(device)
    w = torch.softmax(torch.randn((1, shape.top_k), generator=gen), dim=-1).to(device)
    runs = []
    wanted = set(args.configs.split(","))

    def measure(runner, rams_used, trace_used):
        ms = _time_runner(runner, trace_used, x, w, args.warmup, args.tokens, device)
        run = _record(
            shape, runner, ms, len(rams_used), trace_used[args.warmup : args.warmup + args.tokens], layout, args.tokens
        )
        runs.append(run)
        print(f"  {run['config']:<15} vram {run['vram_frac']:.3f}  {ms:8.3f} ms/token")
        return run

    resident = measure(br.Resident(rams, layout, device), rams, trace_dev)  # always: every floor needs it
    _free(device)
    for frac in VRAM_FRACS:
        if "static" in wanted:
            measure(br.StaticOffload(rams, layout, device, frac), rams, trace_dev)
            _free(device)
        if "bigmoe" in wanted:
            measure(br.Bigmoe(rams, layout, device, frac, profile, shape.top_k), rams, trace_dev)
            _free(device)
        for policy in ("lfu", "lfu-fast"):
            if f"bigmoe-{policy}" in wanted:
                measure(br.Bigmoe(rams, layout, device, frac, profile, shape.top_k, policy=policy), rams, trace_dev)
                _free(device)
        if "bigmoe-prefetch" in wanted:
            for recall in args.recalls:
                predicted = torch.from_numpy(
                    traces.predictions(trace, recall, args.precision, shape.experts, args.seed)
                )
                measure(
                    br.PrefetchBigmoe(
                        rams,
                        layout,
                        device,
                        frac,
                        profile,
                        shape.top_k,
                        policy=args.policy,
                        prefetch_budget=args.prefetch_budget,
                        predicted=predicted.to(device),
                        recall=recall,
                    ),
                    rams,
                    trace_dev,
                )
                _free(device)
        if "bigmoe-unfused" in wanted:
            measure(br.Bigmoe(rams, layout, device, frac, profile, shape.top_k, fused=False), rams, trace_dev)
            _free(device)
    if "bigmoe+ssd" in wanted:
        _ssd_run(shape, args, device, layout, rams, profile, trace_dev, measure, report)
    del rams
    _free(device)
    _finish(shape, runs, resident, report, window)


def _trace(shape: br.ModelShape, layers: int, args) -> np.ndarray:
    need = args.warmup + args.tokens
    if args.trace is None and args.family != "recorded":
        return traces.named_trace(args.family, need, layers, shape.experts, shape.top_k, seed=args.seed)
    args.trace = args.trace or traces.RECORDED
    ids = traces.load_trace(args.trace, shape.experts)
    if ids.shape[1] < layers or ids.shape[2] != shape.top_k or ids.shape[0] < need:
        raise SystemExit(
            f"bench_pager: trace {args.trace} is {ids.shape}; {shape.name} needs >= {need} tokens, "
            f">= {layers} layers and k = {shape.top_k}"
        )
    return np.ascontiguousarray(ids[:need, :layers])


def _ssd_run(shape, args, device, layout, rams, profile, trace_dev, measure, report) -> None:
    try:
        from bigmoe_pager.core.paging_file import PagingFileStore
        from bigmoe_pager.core.ssd_service import SsdService
    except ImportError as e:
        report["notes"].append(f"bigmoe+ssd skipped: SSD tier not importable ({e})")
        print(f"  bigmoe+ssd skipped: SSD tier not importable ({e})")
        return
    n = min(args.ssd_layers, len(rams))
    with tempfile.TemporaryDirectory(prefix="bench-ssd-", dir=args.ssd_dir) as tmp:
        path = Path(tmp) / "experts.bmpf"
        try:
            meta = br.write_paging_file(path, layout, rams[:n])
            store = PagingFileStore(path, layout, meta)
        except Exception as e:  # a filesystem without O_DIRECT, a full disk: say why and go on
            report["notes"].append(f"bigmoe+ssd skipped: {type(e).__name__}: {e}")
            print(f"  bigmoe+ssd skipped: {type(e).__name__}: {e}")
            return
        partial = br.partial_ram_tiers(layout, shape.experts, n, SSD_RAM_FRAC, device)
        with store, SsdService(store, [r.records for r in partial]) as service:
            runner = br.Bigmoe(
                partial, layout, device, SSD_VRAM_FRAC, profile, shape.top_k, SSD_RAM_FRAC, service, store
            )
            runner.name = "bigmoe+ssd"
            runner.check = service.check
            measure(runner, partial, trace_dev[:, :n].contiguous())
        report["notes"].append(f"bigmoe+ssd: {n} layers, paging file on {path.parent} (O_DIRECT reads)")
        del partial, runner
        _free(device)


# ---- timing ----------------------------------------------------------------------------


def _time_runner(runner, trace_dev: torch.Tensor, x, w, warmup: int, tokens: int, device: torch.device) -> float:
    """ms per token over `tokens` tokens after `warmup` (the trace position advances on the device)."""
    layers = trace_dev.shape[1]
    pos = torch.zeros(1, dtype=torch.int64, device=device)

    predicted = getattr(runner, "predicted", None)

    def token() -> None:
        ids = trace_dev.index_select(0, pos)[0]
        if predicted is None:
            for layer in range(layers):
                runner.step(layer, ids[layer : layer + 1], x, w)
        else:
            guess = predicted.index_select(0, pos)[0]  # [layers, P]: row l proposes layer l + 1
            for layer in range(layers):
                runner.step(layer, ids[layer : layer + 1], x, w, guess[layer])
        pos.add_(1)

    check = getattr(runner, "check", lambda: None)
    if device.type != "cuda":
        for _ in range(warmup):
            token()
        _reset(runner)
        start = time.perf_counter()
        for _ in range(tokens):
            token()
        check()
        return (time.perf_counter() - start) * 1e3 / tokens
    for _ in range(2):  # compiles the kernels outside the capture
        token()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token()
    for _ in range(warmup - 2):
        graph.replay()
    torch.cuda.synchronize()
    check()
    _reset(runner)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(tokens):
        graph.replay()
    end.record()
    end.synchronize()
    check()
    return begin.elapsed_time(end) / tokens


def _reset(runner) -> None:
    if runner.stats is not None:
        runner.stats.reset()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- bandwidth -------------------------------------------------------------------------


def _bandwidths(device: torch.device) -> dict:
    """Pinned host -> GPU: the copy engine (copy_) and the UVA copy kernel (the pager's path), GB/s."""
    if device.type != "cuda":
        return {"h2d_gbps": None, "uva_copy_gbps": None}
    h2d, uva = _copy_gbps(device)
    _free(device)  # _copy_gbps's 1 GiB buffers died with its frame
    return {"h2d_gbps": round(h2d, 2), "uva_copy_gbps": round(uva, 2)}


def _copy_gbps(device: torch.device) -> tuple[float, float]:
    """Best GB/s of copy_ and of the UVA copy kernel, pinned host -> GPU, over 1 GiB buffers local to this call."""
    from bigmoe_pager.core.layout import ExpertLayout
    from bigmoe_pager.core.pinned import pinned_empty

    nbytes = 1 << 30
    host = pinned_empty((nbytes,))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _best_gbps(lambda: dev.copy_(host, non_blocking=True), nbytes)
    layout = ExpertLayout.for_moe(2048, 512, torch.float8_e4m3fn, block=br.BLOCK)
    rows = nbytes // layout.pitch
    records = host[: rows * layout.pitch].view(rows, layout.pitch)
    slots = layout.slot_buffers(rows, device)
    src = torch.arange(rows, device=device)
    uva = _best_gbps(lambda: copy_records(records, src, src, layout, slots), rows * layout.record_bytes)
    return h2d, uva


def _best_gbps(fn, nbytes: int, repeats: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return nbytes / (best * 1e-3) / 1e9


# ---- results ---------------------------------------------------------------------------


def _record(shape, runner, ms: float, layers: int, window: torch.Tensor, layout, tokens: int) -> dict:
    hit = {"vram": None, "ram": None, "ssd": None}
    pcie = 0.0
    if runner.stats is not None:
        snap = runner.stats.snapshot()
        hit = {t: (None if s.hit_rate is None else round(s.hit_rate, 4)) for t, s in snap.items()}
        pcie = snap["vram"].bytes / tokens
    elif isinstance(runner, br.StaticOffload):
        pcie = runner.pcie_bytes_per_token(window.cpu().numpy())
    else:
        hit["vram"] = 1.0
    return {
        "model": shape.name,
        "config": runner.name,
        "vram_budget": runner.vram_frac,
        "vram_frac": getattr(runner, "vram_used_frac", runner.vram_frac),
        "ram_frac": runner.ram_frac,
        "layers": layers,
        "layers_total": shape.layers,
        "tokens": tokens,
        "ms_per_token": round(ms, 4),
        "ms_per_token_per_layer": round(ms / layers, 5),
        "hit_rate": hit,
        "pcie_gb_per_token": round(pcie / 1e9, 5),
        **_prefetch_record(runner, tokens),
    }


def _prefetch_record(runner, tokens: int) -> dict:
    """Prefetch counters of a prefetching run: accuracy = needed experts that were prefetched / all VRAM needs
    not already resident before the prefetch (prefetched-and-used + misses)."""
    if getattr(runner, "predicted", None) is None:
        return {}
    vram = runner.stats.snapshot()["vram"]
    needs = vram.prefetch_used + vram.misses
    return {
        "recall": runner.recall,
        "prefetched_per_token": round(vram.prefetched / tokens, 3),
        "prediction_accuracy": round(vram.prefetch_used / needs, 4) if needs else None,
        "prefetch_wasted_gb_per_token": round(vram.prefetch_wasted_bytes / tokens / 1e9, 5),
    }


def _finish(shape, runs: list[dict], resident: dict, report: dict, window: np.ndarray) -> None:
    h2d = report.get("h2d_gbps")
    for run in runs:
        per_layer_resident = resident["ms_per_token_per_layer"] * run["layers"]
        run["floor_ms_per_token"] = (
            None if not h2d else round(run["pcie_gb_per_token"] / h2d * 1e3 + per_layer_resident, 4)
        )
        if run["floor_ms_per_token"] is not None:  # time over the floor per layer per token, microseconds
            run["over_floor_us_per_layer"] = round(
                (run["ms_per_token"] - run["floor_ms_per_token"]) * 1e3 / run["layers"], 2
            )
        run["ratio_vs_resident"] = round(run["ms_per_token"] / per_layer_resident, 3)
    report["runs"].extend(runs)

    def pick(config: str, frac: float) -> dict | None:
        return next((r for r in runs if r["config"] == config and abs(r["vram_frac"] - frac) < 0.05), None)

    summary = {
        "lru_hit_rate_at_12.5pct": round(traces.lru_hit_rate(window, round(0.125 * shape.experts)), 4),
        "lru_hit_rate_at_40pct": round(traces.lru_hit_rate(window, round(0.4 * shape.experts)), 4),
    }
    static = pick("static", 0.4)
    for config, suffix in (("bigmoe", ""), ("bigmoe-lfu", "_lfu"), ("bigmoe-unfused", "_unfused")):
        big = pick(config, 0.4)
        if not (big and static):
            continue
        summary["speedup_vs_static_at_40pct" + suffix] = round(static["ms_per_token"] / big["ms_per_token"], 3)
        if big["floor_ms_per_token"]:
            summary["speedup_vs_static_floor_at_40pct" + suffix] = round(
                static["floor_ms_per_token"] / big["ms_per_token"], 3
            )
            summary["floor_ratio_at_40pct" + suffix] = round(big["ms_per_token"] / big["floor_ms_per_token"], 3)
    report["models"][shape.name] = summary


def _print_table(report: dict) -> None:
    print(f"\n{report['device']}: pinned H2D {report['h2d_gbps']} GB/s, UVA copy kernel {report['uva_copy_gbps']} GB/s")
    print(
        f"{'model':<20}{'config':<16}{'vram':>6}{'ram':>6}{'L':>4}{'ms/tok':>9}{'floor':>9}"
        f"{'hit vram':>9}{'hit ram':>8}{'GB/tok':>8}"
    )
    for r in report["runs"]:
        h = r["hit_rate"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(
            f"{r['model']:<20}{r['config']:<16}{r['vram_frac']:>6.3f}{r['ram_frac']:>6.2f}{r['layers']:>4}"
            f"{r['ms_per_token']:>9.3f}{fmt(r.get('floor_ms_per_token')):>9}{fmt(h['vram']):>9}{fmt(h['ram']):>8}{r['pcie_gb_per_token']:>8.4f}"
        )
    for name, m in report["models"].items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in m.items()))
    for note in report["notes"]:
        print(f"note: {note}")


def _markdown(report: dict) -> str:
    fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [
        *(
            []
            if report.get("complete", True)
            else ["**Incomplete run: the models below finished, the rest did not.**", ""]
        ),
        f"Device: {report['device']}; pinned H2D {fmt(report['h2d_gbps'], 1)} GB/s, "
        f"UVA copy kernel {fmt(report['uva_copy_gbps'], 1)} GB/s.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| model | config | VRAM | RAM | layers | ms/token | floor ms/token | vs resident "
        "| hit VRAM | hit RAM | GB PCIe/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        h = r["hit_rate"]
        lines.append(
            f"| {r['model']} | {r['config']} | {r['vram_frac']:.3f} | {r['ram_frac']:.2f} "
            f"| {r['layers']}/{r['layers_total']} "
            f"| {r['ms_per_token']:.3f} | {fmt(r.get('floor_ms_per_token'))} | {fmt(r.get('ratio_vs_resident'), 2)} "
            f"| {fmt(h['vram'])} | {fmt(h['ram'])} | {r['pcie_gb_per_token']:.4f} |"
        )
    lines.append("")
    for name, m in report["models"].items():
        lines.append(f"- {name}: " + ", ".join(f"{k} = {v}" for k, v in m.items()))
    lines += [f"- note: {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    sys.exit(main())
