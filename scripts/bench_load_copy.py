"""How fast experts are copied into the RAM tier while a model loads: torch's CPU copy on its threads or on one.

    PYTHONPATH=pager python scripts/bench_load_copy.py --out docs/bench/load-copy.json

vLLM's weight loader copies each checkpoint tensor of an expert (Qwen3.6-35B-A3B's shapes: gate and
up halves of w13, 1 MiB each in FP8, w2 1 MiB, and small scales) into the layer's parameter; the
paged layer points it at the pinned RAM tier's records, so the copy runs on the CPU. This times
those copies, the expert's parts into strided record views as the loader writes them, with torch's
default intra-op threads and on one thread, first on an idle machine, then beside busy processes
(one per core, spinning: what other engines and vLLM's own threads are while a model loads). Plain
pageable host memory stands in for pinned (the copy is the same CPU copy; pinning needs a GPU).
The question it answers (docs/benchmarks.md, run 6): is this copy why bigmoe engines loaded the
40-layer checkpoint at about 100 MB/s on the H200?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTER = 2048, 512  # Qwen3.6-35B-A3B's expert: w13 [2 * 512, 2048], w2 [2048, 512], FP8


def parts() -> list[tuple[int, int]]:
    """(rows, columns) of each tensor the loader copies per expert: the w1 and w3 halves of w13, then w2."""
    return [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]


def copy_experts(experts: int, source: list[torch.Tensor], records: torch.Tensor) -> float:
    """Seconds to copy every part of `experts` experts into their records (views at each part's offset)."""
    started = time.perf_counter()
    for e in range(experts):
        offset = 0
        for (rows, cols), src in zip(parts(), source):
            n = rows * cols
            records[e % records.shape[0], offset : offset + n].view(rows, cols).copy_(src)
            offset += n
    return time.perf_counter() - started


@contextlib.contextmanager
def one_copy_thread():
    """torch's CPU copies on this thread alone (its intra-op thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def measure(experts: int, one_thread: bool, busy: int) -> dict:
    source = [torch.randint(0, 255, shape, dtype=torch.uint8).view(torch.float8_e4m3fn) for shape in parts()]
    source = [s.view(torch.uint8) for s in source]  # the loader's copies are byte-for-byte; uint8 keeps it portable
    record_bytes = sum(r * c for r, c in parts())
    records = torch.zeros((16, record_bytes + 4096), dtype=torch.uint8)  # 16 records reused, pages touched
    stop = mp.Event()
    spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        time.sleep(0.2 if busy else 0)
        if one_thread:
            with one_copy_thread():
                seconds = copy_experts(experts, source, records)
        else:
            seconds = copy_experts(experts, source, records)
    finally:
        stop.set()
        for p in spinners:
            p.join()
    return {
        "threads": 1 if one_thread else torch.get_num_threads(),
        "busy_processes": busy,
        "experts": experts,
        "gb_per_s": round(experts * record_bytes / seconds / 1e9, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=256, help="experts copied per measurement (3 MiB each)")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.experts < 1:
        print("bench_load_copy: --experts must be at least 1", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    rows = [measure(args.experts, one, busy) for busy in (0, cores) for one in (False, True)]
    for r in rows:
        print(f"{r['threads']:>2} thread(s), {r['busy_processes']} busy processes: {r['gb_per_s']:.2f} GB/s")
    if args.out:
        report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "cores": cores, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
