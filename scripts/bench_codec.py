"""Benchmark the FP8 codec: size against the per-row exponent entropy bound, CPU encode speed, GPU decode speed.

For each preset's expert shape and each weight law (Student-t with 5 degrees of
freedom, Gaussian; 128x128 blocks scaled to 448) it reports compressed/raw, the
per-row exponent entropy bound and the gap; single-process and multi-process
encode GB/s with the projected time to prepare a 112.5 GiB model; and on a CUDA
GPU: decode GB/s of decoded output (a batch of records, several kernel shapes),
and the time to copy+expand one expert from pinned RAM against copying it raw.
GPU times are CUDA-graph replays (what the pager runs), with the eager call's
time beside them to show the host launch overhead.

On the CPU it also times the C decoder (codec/host_decode.c) that the SSD tier's
reader threads expand compressed records with: one thread, and --workers threads.

`--geometries` adds rows for chunk geometries other than the pager's (lanes x
steps per lane, e.g. 128x16; codec/format.py): the same records cut into more,
shorter lanes cost chunk-header bytes and shorten one record's expansion on
the GPU, which is what a compressed RAM tier would wait for on a miss. Their
rows are named law@geometry (no parallel encode for them).

    PYTHONPATH=pager:app:bench python scripts/bench_codec.py --out docs/bench/codec.json
    PYTHONPATH=pager:app:bench python scripts/bench_codec.py --cpu-only --out docs/bench/codec.json
    PYTHONPATH=pager:app:bench python scripts/bench_codec.py --geometries 16x128,64x32,128x16 --out ...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from bigmoe_bench import codec_samples as S
from bigmoe_pager.codec import format as F  # noqa: E402
from bigmoe_pager.codec.encode import encode_record  # noqa: E402
from bigmoe_pager.codec.host_decoder import HostDecoder
from bigmoe_pager.codec.reference import decode_record  # noqa: E402

MODEL_BYTES = 112.5 * 2**30  # FP8 experts of qwen3.8-flash-next
FORWARD_LAYERS = 40  # layers of the 40-layer vLLM benchmark: one prefetch round a layer in copy_batches' forward
DENSE_KERNELS = 16  # small bf16 products a layer in that forward
DISTS = ("student_t", "gaussian")


def sweep(geometry: F.Geometry) -> list[tuple[int, int, bool]]:
    """Kernel shapes tried: (chunks per program, warps, prefetch). One lane per thread (or two), 32 to 256 lanes
    a program; for STANDARD (16 lanes) that is (2, 1), (4, 1-2), (8, 2-4), (16, 4-8); fewer chunks per program give
    one record more programs. prefetch = stream words and nibbles loaded a step ahead."""
    shapes = []
    for chunks in (1, 2, 4, 8, 16):
        lanes = chunks * geometry.lanes
        if 32 <= lanes <= 256:
            shapes += [(chunks, w, pf) for w in sorted({max(1, lanes // 64), lanes // 32}) for pf in (True, False)]
    return shapes


def cpu_part(layout, raws: list, workers: int, geometry: F.Geometry) -> tuple[dict, list]:
    encode_record(raws[0], layout, geometry)  # warm caches
    times, records = [], []
    for raw in raws:
        t0 = time.perf_counter()
        records.append(encode_record(raw, layout, geometry))
        times.append(time.perf_counter() - t0)
    if not np.array_equal(decode_record(records[0], layout, geometry), raws[0]):
        raise SystemExit("round trip failed: the reference decoder did not give the record back")
    ratio = float(np.mean([len(r) for r in records]) / layout.record_bytes)
    bound = float(np.mean([S.exponent_entropy_bound(r, layout) for r in raws]))
    single = layout.record_bytes / float(np.median(times)) / 1e9
    out = {
        "ratio": round(ratio, 5),
        "entropy_bound_ratio": round(bound, 5),
        "gap_pct": round((ratio / bound - 1) * 100, 3),
        "max_record_ratio": round(F.max_record_bytes(layout) / layout.record_bytes, 5),
        "encode_GBps": round(single, 4),
    }
    if workers > 1:
        out["encode_GBps_parallel"] = round(_parallel_GBps(layout, raws, workers), 4)
        out["encode_workers"] = workers
    best = max(out["encode_GBps"], out.get("encode_GBps_parallel", 0.0))
    out["prepare_112GiB_min"] = round(MODEL_BYTES / (best * 1e9) / 60, 2)
    out.update(host_decode(layout, records, workers, geometry))
    return out, records


def host_decode(layout, records: list, workers: int, geometry: F.Geometry) -> dict:
    """The C decoder (what the SSD tier's threads expand records with): raw GB/s out of one thread, median of 5
    passes over the records, and of `workers` threads each expanding its own records at once (ctypes drops the GIL)."""
    decoder = HostDecoder(layout, geometry, check_crc=False)
    data = [np.frombuffer(r, np.uint8) for r in records]
    outs = [np.empty(layout.record_bytes, np.uint8) for _ in range(max(workers, 1))]
    decoder.decode_into(data[0], layout, outs[0])
    passes = []
    for _ in range(5):
        t0 = time.perf_counter()
        for d in data:
            decoder.decode_into(d, layout, outs[0])
        passes.append(time.perf_counter() - t0)
    one = len(data) * layout.record_bytes / float(np.median(passes)) / 1e9
    out = {"host_decode_GBps": round(one, 3)}
    if workers > 1:
        rounds = 4

        def expand(i: int) -> None:
            for _ in range(rounds):
                for d in data:
                    decoder.decode_into(d, layout, outs[i])

        with ThreadPoolExecutor(workers) as pool:
            t0 = time.perf_counter()
            list(pool.map(expand, range(workers)))
            seconds = time.perf_counter() - t0
        out["host_decode_GBps_threads"] = round(workers * rounds * len(data) * layout.record_bytes / seconds / 1e9, 3)
    return out


def _parallel_GBps(layout, raws: list, workers: int) -> float:
    """encode_record on a warm pool of spawned workers (what encode_many runs), start-up excluded."""
    batch = raws * max(2, (4 * workers) // len(raws))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(encode_record, raws[:1] * workers, [layout] * workers))
        t0 = time.perf_counter()
        list(pool.map(encode_record, batch, [layout] * len(batch)))
        return len(batch) * layout.record_bytes / (time.perf_counter() - t0) / 1e9


def gpu_part(
    layout, raws: list, records: list, batch: int, reps: int, dev: torch.device, geometry: F.Geometry, counts: list[int]
) -> dict:
    from bigmoe_pager.codec.triton_decode import decode_into_slots, new_errors

    picks = [records[i % len(records)] for i in range(batch)]
    offsets, blob = [], bytearray()
    for r in picks:
        offsets.append(len(blob))
        blob += r + bytes(F.align(len(r), F.STAGING_ALIGN) - len(r))
    staging = torch.frombuffer(blob, dtype=torch.uint8).to(dev)
    work = torch.tensor([[o, i] for i, o in enumerate(offsets)], dtype=torch.int64, device=dev)
    slots = layout.slot_buffers(batch, dev)
    errors = new_errors(work)
    tried = []
    for cpp, warps, pf in sweep(geometry):

        def run():
            return decode_into_slots(
                staging,
                work,
                slots,
                layout,
                errors,
                chunks_per_program=cpp,
                num_warps=warps,
                prefetch=pf,
                geometry=geometry,  # noqa: B023
            )

        ms = _graph_ms(run, reps, dev)
        tried.append(
            {
                "chunks_per_program": cpp,
                "num_warps": warps,
                "prefetch": pf,
                "ms": round(ms, 4),
                "decode_GBps": round(batch * layout.record_bytes / ms / 1e6, 1),
            }
        )
    if errors.sum().item():
        raise SystemExit(f"decode reported errors: {errors.tolist()}")
    for i in range(min(batch, len(raws))):
        got = np.zeros(layout.record_bytes, np.uint8)
        for c in layout.components:
            got[c.offset : c.offset + c.nbytes] = slots[c.name][i].reshape(-1).view(torch.uint8).cpu().numpy()
        if not np.array_equal(got, raws[i]):
            raise SystemExit("GPU decode differs from the original record")
    best = max(tried, key=lambda s: s["decode_GBps"])
    shape = _shape(best, geometry)
    eager = _time_ms(lambda: decode_into_slots(staging, work, slots, layout, errors, **shape), reps, dev)
    one = _one_expert(layout, raws[0], records[0], reps, dev, geometry)
    alone = _shape(one["expand_best"], geometry)  # a miss round's few records fill the GPU as one record does
    return {
        "decode_GBps": best["decode_GBps"],
        "decode_GBps_eager": round(batch * layout.record_bytes / eager / 1e6, 1),
        "decode_batch": batch,
        "decode_best": best,
        "decode_sweep": tried,
        **one,
        "copy_batches": copy_batches(layout, raws, records, counts, alone, reps, dev),
    }


def _shape(entry: dict, geometry: F.Geometry) -> dict:
    return {
        "chunks_per_program": entry["chunks_per_program"],
        "num_warps": entry["num_warps"],
        "prefetch": entry["prefetch"],
        "geometry": geometry,
    }


def _one_expert(layout, raw: np.ndarray, record: bytes, reps: int, dev: torch.device, geometry: F.Geometry) -> dict:
    """Copy one compressed record from pinned RAM and expand it, against copying the raw record.

    Timed as the pager runs it: captured once in a CUDA graph and replayed (no host work per call); the eager
    call of decode_into_slots is timed too (`expand_eager_us`: Python and Triton launch overhead included).
    """
    from bigmoe_pager.codec.triton_decode import decode_into_slots, new_errors

    pin = dev.type == "cuda"
    host_c = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    host_r = torch.zeros(layout.record_bytes, dtype=torch.uint8)
    if pin:
        host_c, host_r = host_c.pin_memory(), host_r.pin_memory()
    staging = torch.empty(F.max_record_bytes(layout), dtype=torch.uint8, device=dev)
    raw_dst = torch.empty(layout.record_bytes, dtype=torch.uint8, device=dev)
    work = torch.tensor([[0, 0]], dtype=torch.int64, device=dev)
    slots = layout.slot_buffers(1, dev)
    errors = new_errors(work)
    n = host_c.numel()
    staging[:n].copy_(host_c)
    tried = []
    for cpp, warps, pf in sweep(geometry):  # one record fills the GPU differently from a batch: its own best shape
        shape = {"chunks_per_program": cpp, "num_warps": warps, "prefetch": pf}
        ms = _graph_ms(
            lambda: decode_into_slots(staging, work, slots, layout, errors, geometry=geometry, **shape),  # noqa: B023
            reps,
            dev,
        )
        tried.append({**shape, "us": round(ms * 1e3, 2)})
    best = min(tried, key=lambda s: s["us"])
    shape = _shape(best, geometry)

    def copy_expand():
        staging[:n].copy_(host_c, non_blocking=True)
        decode_into_slots(staging, work, slots, layout, errors, **shape)

    ce = _graph_ms(copy_expand, reps, dev)
    eager = _time_ms(lambda: decode_into_slots(staging, work, slots, layout, errors, **shape), reps, dev)
    raw_ms = _graph_ms(lambda: raw_dst.copy_(host_r, non_blocking=True), reps, dev)
    cc = _graph_ms(lambda: staging[:n].copy_(host_c, non_blocking=True), reps, dev)
    got = np.concatenate([slots[c.name][0].reshape(-1).view(torch.uint8).cpu().numpy() for c in layout.components])
    want = np.concatenate([raw[c.offset : c.offset + c.nbytes] for c in layout.components])
    if errors.sum().item() or not np.array_equal(got, want):
        raise SystemExit("single-record GPU decode differs from the original record")
    return {
        "copy_expand_us": round(ce * 1e3, 1),
        "expand_us": best["us"],
        "expand_eager_us": round(eager * 1e3, 1),
        "expand_best": best,
        "expand_sweep": tried,
        "copy_compressed_us": round(cc * 1e3, 1),
        "copy_raw_us": round(raw_ms * 1e3, 1),
        "h2d_GBps": round(layout.record_bytes / raw_ms / 1e6, 1),
        "expand_GBps": round(layout.record_bytes / best["us"] / 1e3, 1),
    }


def copy_batches(layout, raws: list, records: list, counts: list[int], shape: dict, reps: int, dev: torch.device):
    """k experts a miss round: their compressed records copied from pinned RAM in one copy and expanded in one
    launch (kernel `shape`), against one copy of their raw records; both captured in a CUDA graph, alone and as a
    side round beside each layer of a dense forward (beside_compute)."""
    from bigmoe_pager.codec.triton_decode import decode_into_slots, new_errors

    pin = dev.type == "cuda"
    rows = []
    dense = DenseLayer(layout["w13_weight"].shape[-1], dev)  # the hidden size (S.moe_layout)
    for k in counts:
        picks = [i % len(records) for i in range(k)]
        offsets, blob = [], bytearray()
        for i in picks:
            offsets.append(len(blob))
            blob += records[i] + bytes(F.align(len(records[i]), F.STAGING_ALIGN) - len(records[i]))
        host_c = torch.frombuffer(blob, dtype=torch.uint8)
        host_r = torch.from_numpy(np.concatenate([raws[i] for i in picks]))
        if pin:
            host_c, host_r = host_c.pin_memory(), host_r.pin_memory()
        staging = torch.empty(len(blob), dtype=torch.uint8, device=dev)
        raw_dst = torch.empty(host_r.numel(), dtype=torch.uint8, device=dev)
        work = torch.tensor([[o, j] for j, o in enumerate(offsets)], dtype=torch.int64, device=dev)
        slots = layout.slot_buffers(k, dev)
        errors = new_errors(work)

        def copy_expand():
            staging.copy_(host_c, non_blocking=True)  # noqa: B023
            decode_into_slots(staging, work, slots, layout, errors, **shape)  # noqa: B023

        def copy_raw():
            raw_dst.copy_(host_r, non_blocking=True)  # noqa: B023

        ce = _graph_ms(copy_expand, reps, dev)
        raw_ms = _graph_ms(copy_raw, reps, dev)
        beside = {name: beside_compute(dense, side, reps, dev) for name, side in (("none", None), ("raw", copy_raw))}
        beside["expand"] = beside_compute(dense, copy_expand, reps, dev)
        for j, i in enumerate(picks):
            got = np.concatenate(
                [slots[c.name][j].reshape(-1).view(torch.uint8).cpu().numpy() for c in layout.components]
            )
            want = np.concatenate([raws[i][c.offset : c.offset + c.nbytes] for c in layout.components])
            if errors.sum().item() or not np.array_equal(got, want):
                raise SystemExit(f"copy+expand of {k} records differs from the original records")
        rows.append(
            {
                "experts": k,
                "copy_expand_us": round(ce * 1e3, 1),
                "copy_raw_us": round(raw_ms * 1e3, 1),
                "copy_expand_vs_raw": round(ce / raw_ms, 3),
                # a prefetch round a layer beside the layer's compute: the forward's ms, and what each side adds
                "forward_ms": round(beside["none"], 3),
                "forward_with_raw_rounds_ms": round(beside["raw"], 3),
                "forward_with_expand_rounds_ms": round(beside["expand"], 3),
            }
        )
    return rows


class DenseLayer:
    """A decode layer's compute stand-in: DENSE_KERNELS bf16 [1, H] x [H, H] products and tanh (about vLLM's
    per-layer kernel time on the 40-layer benchmark, roughly)."""

    def __init__(self, hidden: int, dev: torch.device):
        gen = torch.Generator().manual_seed(1)
        self.weights = [
            (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(dev, torch.bfloat16)
            for _ in range(DENSE_KERNELS)
        ]
        self.x = torch.randn(1, hidden, generator=gen).to(dev, torch.bfloat16)

    def __call__(self) -> None:
        x = self.x
        for w in self.weights:
            x = torch.tanh(x @ w)
        self.x.copy_(x)


def beside_compute(dense: DenseLayer, side, reps: int, dev: torch.device) -> float:
    """ms of a forward of FORWARD_LAYERS layers, each forking `side` (None: nothing) onto a second stream beside its
    dense compute and joining it at the layer's end, as a prefetch round for the next layer would; one CUDA graph
    (on CPU: the same calls in turn, wall time)."""
    if dev.type != "cuda":

        def serial():
            for _ in range(FORWARD_LAYERS):
                if side is not None:
                    side()
                dense()

        return _time_ms(serial, reps, dev)
    stream = torch.cuda.Stream(dev)

    def forward():
        main = torch.cuda.current_stream(dev)
        for _ in range(FORWARD_LAYERS):
            if side is not None:
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    side()
            dense()
            if side is not None:
                main.wait_stream(stream)

    return _graph_ms(forward, reps, dev)


def _graph_ms(fn, reps: int, dev: torch.device) -> float:
    """Median milliseconds of one replay of a CUDA graph that captured fn() (how the pager runs it);
    wall time on CPU."""
    if dev.type != "cuda":
        return _time_ms(fn, reps, dev)
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_ms(graph.replay, reps, dev)


def _time_ms(fn, reps: int, dev: torch.device) -> float:
    """Median milliseconds of fn(): CUDA events on the current stream after a warm-up (wall time on CPU)."""
    if dev.type != "cuda":  # the interpreter smoke run: correctness of the path, not speed
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    p.add_argument("--md", type=Path, help="write a markdown table of the results here")
    p.add_argument("--note", default="", help="free text stored with the results (machine load, ...)")
    p.add_argument("--experts", type=int, default=4, help="distinct experts encoded per shape and law")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for the parallel encode")
    p.add_argument("--batch", type=int, default=64, help="records decoded per GPU launch")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU part even when CUDA is there")
    p.add_argument(
        "--shape",
        action="append",
        metavar="HIDDENxINTER",
        help="benchmark this expert shape instead of the presets' (repeatable), e.g. 256x128",
    )
    p.add_argument(
        "--interpret",
        action="store_true",
        help="smoke test: run the decode part on CPU tensors (needs TRITON_INTERPRET=1; tiny shapes)",
    )
    p.add_argument(
        "--copy-batches",
        default="1,2,4,8",
        help="GPU: experts copied and expanded together (a miss round), against their raw copy (comma separated)",
    )
    p.add_argument(
        "--geometries",
        default=str(F.STANDARD),
        help=f"chunk geometries (lanes x steps, comma separated); {F.STANDARD} is the pager's",
    )
    a = p.parse_args(argv)
    try:
        geometries = [F.Geometry.parse(g) for g in a.geometries.split(",")]
    except F.CodecError as e:
        p.error(str(e))
    try:
        counts = [int(k) for k in a.copy_batches.split(",")]
    except ValueError:
        p.error("--copy-batches takes integers, comma separated")
    if any(k < 1 for k in counts):
        p.error("--copy-batches are >= 1")
    gpu = (torch.cuda.is_available() or a.interpret) and not a.cpu_only
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.interpret else "cpu")
    shapes = S.SHAPES if not a.shape else {s: tuple(int(x) for x in s.split("x")) for s in a.shape}
    result = {
        "codec": F.CODEC_NAME,
        "codec_version": F.CODEC_VERSION,
        "command": "PYTHONPATH=pager:app:bench python scripts/bench_codec.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "scope": "CPU and GPU" if gpu else "CPU only (ratio, encode and CPU decode speed; no GPU decode numbers)",
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs",
        "gpu": torch.cuda.get_device_name() if gpu and dev.type == "cuda" else None,
        "model_bytes_for_projection": MODEL_BYTES,
        "note": a.note,
        "shapes": {},
    }
    rng = np.random.default_rng(0)
    print(
        f"{'shape':20s} {'law':10s} {'ratio':>7s} {'bound':>7s} {'gap%':>6s} {'enc GB/s':>9s} {'par GB/s':>9s} "
        f"{'112GiB min':>10s} {'cpu dec':>8s} {'dec GB/s':>9s} {'exp us':>8s} {'cp+exp us':>9s} {'raw cp us':>9s}"
    )
    for name, (hidden, inter) in shapes.items():
        layout = S.moe_layout(hidden, inter)
        entry = {"hidden": hidden, "moe_intermediate": inter, "record_bytes": layout.record_bytes, "laws": {}}
        for dist in DISTS:
            raws = [S.expert_record(layout, dist, rng) for _ in range(a.experts)]
            for geometry in geometries:
                standard = geometry == F.STANDARD
                cpu, records = cpu_part(layout, raws, a.workers if standard else 1, geometry)
                law = dict(cpu, geometry=str(geometry))
                if gpu:
                    law.update(gpu_part(layout, raws, records, a.batch, a.reps, dev, geometry, counts))
                row = dist if standard else f"{dist}@{geometry}"
                entry["laws"][row] = law
                print(
                    f"{name:20s} {row:10s} {law['ratio']:7.4f} {law['entropy_bound_ratio']:7.4f} {law['gap_pct']:6.2f} "
                    f"{law['encode_GBps']:9.3f} {law.get('encode_GBps_parallel', float('nan')):9.3f} "
                    f"{law['prepare_112GiB_min']:10.1f} {law['host_decode_GBps']:8.2f} "
                    f"{law.get('decode_GBps', float('nan')):9.1f} {law.get('expand_us', float('nan')):8.1f} "
                    f"{law.get('copy_expand_us', float('nan')):9.1f} {law.get('copy_raw_us', float('nan')):9.1f}"
                )
        head = entry["laws"].get("student_t", {})  # the headline numbers: Student-t(5) weights, the pager's geometry
        for key in ("ratio", "entropy_bound_ratio", "gap_pct", "encode_GBps", "host_decode_GBps", "decode_GBps"):
            if key in head:
                entry[key] = head[key]
        result["shapes"][name] = entry
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(markdown(result))
        print(f"wrote {a.md}")
    return 0


def markdown(result: dict) -> str:
    """A table of every shape and law, then how it was measured."""
    cols = [
        ("ratio", "ratio", "{:.4f}"),
        ("entropy_bound_ratio", "per-row bound", "{:.4f}"),
        ("gap_pct", "gap %", "{:.2f}"),
        ("encode_GBps", "encode GB/s (1 proc)", "{:.3f}"),
        ("encode_GBps_parallel", "encode GB/s (pool)", "{:.3f}"),
        ("prepare_112GiB_min", "112.5 GiB prepare min", "{:.1f}"),
        ("host_decode_GBps", "CPU decode GB/s (1 thread)", "{:.2f}"),
        ("host_decode_GBps_threads", "CPU decode GB/s (threads)", "{:.2f}"),
        ("decode_GBps", "decode GB/s", "{:.0f}"),
        ("expand_us", "expand 1 expert us", "{:.1f}"),
        ("expand_eager_us", "expand eager us", "{:.1f}"),
        ("copy_expand_us", "copy+expand 1 expert us", "{:.1f}"),
        ("copy_raw_us", "raw copy 1 expert us", "{:.1f}"),
    ]
    lines = ["| shape | law | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, entry in result["shapes"].items():
        for law, v in entry["laws"].items():
            cells = [fmt.format(v[key]) if key in v else "-" for key, _, fmt in cols]
            lines.append(f"| {name} | {law} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Scope: {result['scope']}. CPU: {result['cpu']}. GPU: {result['gpu'] or 'none'}.",
        f"Command: `{result['command']}`.",
    ]
    if result.get("note"):
        lines.append(f"Note: {result['note']}")
    lines += [
        "",
        "ratio = compressed record / raw record (headers, tables and raw block scales included); per-row bound = "
        "sign+mantissa raw plus each row's empirical exponent entropy; CPU decode = the C decoder the SSD tier's "
        "threads expand records with, raw bytes out per second, one thread and one thread per --workers at once; "
        "decode GB/s = decoded output bytes per second "
        "for a batch of records, best kernel shape, CUDA-graph replay; expand = one record alone in a CUDA graph "
        "(eager: one Python call of decode_into_slots, launch overhead included); copy+expand = pinned RAM -> VRAM "
        "copy of one compressed record and its expansion in one graph, against the raw copy.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
