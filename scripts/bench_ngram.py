#!/usr/bin/env python3
"""Benchmark the n-gram pager's gathers on a synthetic table with the real 160-byte rows.

Writes an N GiB table in the checkpoint's layout (128 shard files), then times
per-token decode gathers (16 random rows) and a 2,048-token prefill gather
(32,768 rows) from three places:

  page_cache    the whole table resident in the OS page cache (mmap reader)
  ssd           the device through O_DIRECT + kernel AIO (no page cache); rows
                planned into sorted, deduplicated, coalesced reads of 512 B
                where the device allows
  ssd_buffered  the mmap reader with the table evicted from the page cache first

For the SSD prefill it also records the read requests one prefill needs, the
device's achieved random reads/s during it (the ceiling that bounds it), and
the prefill time at queue depths 64-512. Every gathered row is checked
against the id stamped in it. With CUDA it also
times the host-to-device copy + FP8 dequant and the full prefetch path. The
table is deleted afterwards unless --keep.

  PYTHONPATH=pager:bench python scripts/bench_ngram.py --size-gib 8 --out docs/bench/ngram.json
  python scripts/bench_ngram.py --merge h200.json --out docs/bench/ngram.json --md docs/bench/ngram.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bigmoe_bench.ngram_synthetic import write_table  # noqa: E402
from bigmoe_pager.ngram import NgramTable  # noqa: E402

ROW_BYTES, HEADS, PREFILL_TOKENS = 160, 16, 2048
SWEEP_DEPTHS = (64, 128, 256, 512)  # AIO reads in flight tried for the SSD prefill
TARGETS = {"decode_ms_per_token_ssd": 0.5, "prefill_2048_ms_ssd": 150.0}


def main() -> None:
    args = parse_args()
    if args.merge:
        merge(args.out, args.merge)
    else:
        result = run(args)
        merge(args.out, None, {args.machine: result})
    print(table_md(json.loads(Path(args.out).read_text())))
    if args.md:
        Path(args.md).write_text(table_md(json.loads(Path(args.out).read_text())) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=8.0, help="synthetic table size (GiB)")
    p.add_argument("--shards", type=int, default=128, help="shard files the table is split into")
    p.add_argument("--dir", default=None, help="parent directory for the table (default: the system temp dir)")
    p.add_argument("--decode-tokens", type=int, default=300, help="decode steps timed per source")
    p.add_argument("--prefill-reps", type=int, default=3, help="prefill gathers timed per source")
    p.add_argument("--machine", default=platform.node() or "this-machine", help="label of this machine in the JSON")
    p.add_argument("--out", required=True, help="results JSON (machines already in it are kept)")
    p.add_argument("--md", default=None, help="also write the markdown table here")
    p.add_argument("--merge", default=None, help="merge the machines of this JSON into --out; no benchmark")
    p.add_argument("--keep", action="store_true", help="keep the table afterwards")
    p.add_argument("--note", default="", help="a remark stored with this machine's results (e.g. other load)")
    return p.parse_args()


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bigmoe-ngram-bench-", dir=args.dir))
    rows = int(args.size_gib * 2**30) // ROW_BYTES
    try:
        t0 = time.perf_counter()
        files = write_table(root, rows=rows, row_elems=ROW_BYTES, parts=args.shards, scale=0.5)
        write_s = time.perf_counter() - t0
        print(
            f"wrote {rows * ROW_BYTES / 2**30:.1f} GiB in {args.shards} files under {root} in {write_s:.1f} s",
            flush=True,
        )
        result = {
            "machine": describe_machine(root),
            "table": {
                "gib": round(rows * ROW_BYTES / 2**30, 2),
                "rows": rows,
                "shards": args.shards,
                "write_gb_per_s": round(rows * ROW_BYTES / write_s / 1e9, 2),
            },
            "command": "PYTHONPATH=pager:bench python " + " ".join(sys.argv),
            "note": args.note,
        }
        result.update(measure(files, rows, args))
        return result
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def measure(files: list[Path], rows: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    decode, decode_p90, prefill, device = {}, {}, {}, None
    with NgramTable.open(files) as table:
        resident = make_resident(files, rows * ROW_BYTES)
        decode["page_cache"], decode_p90["page_cache"] = time_decode(table, rows, args.decode_tokens, rng)
        prefill["page_cache"] = time_prefill(table, rows, args.prefill_reps, rng)
        table.drop_page_cache()
        decode["ssd_buffered"], decode_p90["ssd_buffered"] = time_decode(table, rows, args.decode_tokens, rng)
        prefill["ssd_buffered"] = time_prefill(table, rows, args.prefill_reps, rng, before=table.drop_page_cache)
    with NgramTable.open(files, direct=True) as table:
        decode["ssd"], decode_p90["ssd"] = time_decode(table, rows, args.decode_tokens, rng)
        before = table.stats()
        prefill["ssd"] = time_prefill(table, rows, args.prefill_reps, rng)
        ssd_reads = read_rates(before, table.stats(), args.prefill_reps)
        ssd_reads["align_bytes"] = table.reader.align
        device = measure_device(table, files, rows, rng)
    ssd_reads["prefill_ms_by_depth"] = sweep_depths(files, rows, args.prefill_reps, rng)
    return {
        "page_cache_resident_fraction": resident,
        "decode_ms_per_token": decode,
        "decode_ms_per_token_p90": decode_p90,
        "prefill_2048_ms": prefill,
        "ssd_prefill_reads": ssd_reads,
        "device": device,
        "meets_targets": {
            "decode_ssd": decode["ssd"] <= TARGETS["decode_ms_per_token_ssd"],
            "prefill_ssd": prefill["ssd"] <= TARGETS["prefill_2048_ms_ssd"],
        },
    }


def read_rates(before: dict, after: dict, reps: int) -> dict:
    """Read requests per SSD prefill and the random reads/s the device gave while serving them."""
    reads = after["reads"] - before["reads"]
    seconds = (after["read_ns"] - before["read_ns"]) / 1e9
    return {
        "rows_per_prefill": (after["rows_read"] - before["rows_read"]) // reps,
        "reads_per_prefill": reads // reps,
        "kib_per_prefill": (after["bytes_read"] - before["bytes_read"]) // reps // 1024,
        "reads_per_s": round(reads / seconds) if seconds else None,
    }


def sweep_depths(files: list[Path], rows: int, reps: int, rng: np.random.Generator) -> dict[str, float]:
    """Median SSD prefill ms at each AIO queue depth: shows whether the device, not the queue, is the limit."""
    out = {}
    for depth in SWEEP_DEPTHS:
        with NgramTable.open(files, direct=True, depth=depth) as table:
            out[str(depth)] = time_prefill(table, rows, reps, rng)
    return out


def make_resident(files: list[Path], nbytes: int) -> float:
    """Read every file once so the table sits in the page cache; the fraction of it RAM can hold."""
    available = mem_available()
    buf = bytearray(64 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return round(min(1.0, available / nbytes), 3)


def time_decode(table: NgramTable, rows: int, tokens: int, rng: np.random.Generator) -> tuple[float, float]:
    """Median and p90 ms of one decode step's gather (16 random rows)."""
    times = []
    for _ in range(tokens):
        ids = rng.integers(0, rows, HEADS)
        t0 = time.perf_counter()
        got = table.gather(ids)
        times.append(time.perf_counter() - t0)
        check(got, ids)
    return round(float(np.median(times)) * 1e3, 4), round(float(np.percentile(times, 90)) * 1e3, 4)


def time_prefill(table: NgramTable, rows: int, reps: int, rng: np.random.Generator, before=None) -> float:
    """Median ms of one 2,048-token prefill gather (32,768 random rows)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        ids = rng.integers(0, rows, (PREFILL_TOKENS, HEADS))
        t0 = time.perf_counter()
        got = table.gather(ids)
        times.append(time.perf_counter() - t0)
        check(got, ids)
    return round(float(np.median(times)) * 1e3, 3)


def measure_device(table: NgramTable, files: list[Path], rows: int, rng: np.random.Generator) -> dict | None:
    """With CUDA: H2D copy + FP8 dequant, and the prefetcher's start/finish from SSD (O_DIRECT)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from bigmoe_pager.ngram.dequant import dequantize_rows
    from bigmoe_pager.ngram.prefetch import RowPrefetcher

    out: dict = {"gpu": torch.cuda.get_device_name()}
    for name, n in (("decode", HEADS), ("prefill_2048", PREFILL_TOKENS * HEADS)):
        host = torch.from_numpy(table.gather(rng.integers(0, rows, n))).pin_memory()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            dequantize_rows(host.to("cuda", non_blocking=True), "F8_E4M3", table.scale)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[f"h2d_dequant_{name}_ms"] = round(float(np.median(times)), 4)
    pf = RowPrefetcher(table, PREFILL_TOKENS * HEADS, "cuda")
    try:
        for name, tokens, reps in (("decode", 1, 100), ("prefill_2048", PREFILL_TOKENS, 3)):
            out_buf = torch.empty(tokens, HEADS * ROW_BYTES, dtype=torch.uint8, device="cuda")
            times = []
            for _ in range(reps):
                ids = torch.from_numpy(rng.integers(0, rows, (tokens, HEADS))).cuda()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pf.start(ids)
                pf.finish(out_buf)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                check(out_buf.cpu().numpy().reshape(tokens, HEADS, ROW_BYTES), ids.cpu().numpy())
            out[f"prefetch_ssd_{name}_ms"] = round(float(np.median(times)) * 1e3, 4)
    finally:
        pf.close()
    return out


def check(got: np.ndarray, ids: np.ndarray) -> None:
    stamped = np.ascontiguousarray(got.reshape(-1, ROW_BYTES)[:, :8]).view("<u8").reshape(-1)
    if not np.array_equal(stamped, ids.reshape(-1).astype(np.uint64)):
        raise SystemExit("bench_ngram: a gather returned the wrong rows; results discarded")


def describe_machine(root: Path) -> dict:
    dev = os.stat(root).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    disk = block.resolve().name if block.exists() else "unknown"
    parent = block.resolve().parent if block.exists() and (block / "partition").exists() else block.resolve()
    rotational = _read(parent / "queue" / "rotational")
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "ram_gib": round(mem_total() / 2**30, 1),
        "disk": disk,
        "disk_model": _read(parent / "device" / "model"),
        "rotational": rotational == "1" if rotational else None,
        "kernel": platform.release(),
    }


def mem_available() -> int:
    return _meminfo("MemAvailable")


def mem_total() -> int:
    return _meminfo("MemTotal")


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def merge(out: str, other: str | None, machines: dict | None = None) -> None:
    path = Path(out)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("benchmark", "n-gram pager gathers (scripts/bench_ngram.py)")
    doc["row_bytes"], doc["rows_per_token"], doc["targets"] = ROW_BYTES, HEADS, TARGETS
    doc.setdefault("machines", {})
    if other is not None:
        machines = json.loads(Path(other).read_text()).get("machines", {})
    doc["machines"].update(machines or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def table_md(doc: dict) -> str:
    lines = [
        "| machine | disk | table | source | decode ms/token (median / p90) | prefill 2,048 tokens ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, m in doc.get("machines", {}).items():
        for source in ("page_cache", "ssd", "ssd_buffered"):
            d, p90 = m["decode_ms_per_token"][source], m["decode_ms_per_token_p90"][source]
            lines.append(
                f"| {label} | {m['machine']['disk']} | {m['table']['gib']} GiB | {source} | "
                f"{d:.3f} / {p90:.3f} | {m['prefill_2048_ms'][source]:.1f} |"
            )
    lines.append(
        f"\nTargets from SSD: decode <= {TARGETS['decode_ms_per_token_ssd']} ms/token, "
        f"prefill <= {TARGETS['prefill_2048_ms_ssd']:.0f} ms. page_cache = table resident in the OS page cache; "
        "ssd = O_DIRECT through kernel AIO (no page cache); ssd_buffered = mmap reader after evicting the table.\n"
    )
    for label, m in doc.get("machines", {}).items():
        r = m.get("ssd_prefill_reads")
        if r:
            lines.append(
                f"- {label} SSD prefill: {r['rows_per_prefill']} distinct rows in {r['reads_per_prefill']} reads "
                f"of {r['align_bytes']} B blocks ({r['kib_per_prefill']} KiB), {r['reads_per_s']} reads/s; "
                f"ms by queue depth {r['prefill_ms_by_depth']}"
            )
    for label, m in doc.get("machines", {}).items():
        mach = m["machine"]
        lines.append(
            f"- {label}: {mach['cpus']} CPUs, {mach['ram_gib']} GiB RAM, disk {mach['disk']} "
            f"({mach.get('disk_model') or 'model unknown'}), kernel {mach['kernel']}; "
            f"device: {json.dumps(m['device']) if m['device'] else 'no CUDA'}; command: `{m['command']}`"
            + (f"; note: {m['note']}" if m.get("note") else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
