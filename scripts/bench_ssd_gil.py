"""SSD tier reads one at a time beside a Python thread that keeps the GIL busy, at several GIL switch intervals.

The question (docs/benchmarks.md, "after session 35"): during decode the SSD tier's reads are answered by
Python threads (the service's I/O workers and poller) while vLLM's host thread runs Python; a thread that wants
the GIL waits up to the switch interval (5 ms by default). This times what that costs a read on the host alone:
one expert at a time (a decode layer's miss), from the checkpoint with O_DIRECT, with and without a busy Python
thread beside it, for each interval, by either way in (--paths):
- `load`: `SsdService.load` from the calling thread (the host-driven path, and the dev VM's only one);
- `mailbox`: the GPU's path, `SsdService.request` on a CUDA stream, then a sync: the request kernel publishes the
  read in the pinned mailbox and spins until the host's poller and workers answer (CUDA only; needs no vLLM).
and by either reader (--readers): `python`, the service's Python poller and workers, or `native`, its C threads
(ssd_reader.c; `load` then goes through the mailbox's host entries).
What it shows is whether a busy host thread adds whole milliseconds a read, how much a shorter interval takes
back, and whether the C threads leave the GIL off the read's path; not how busy vLLM's own host thread keeps the
GIL (gpu_vllm_bench.py's `+switchN` measures that).

    PYTHONPATH=pager:app:bench:scripts python scripts/bench_ssd_gil.py --dir /tmp --readers python,native \
        --out docs/bench/ssd-gil.json
    H200 (the image's torch): ... --paths load,mailbox --out $OUT/ssd-gil.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from bench_ssd import SHAPES, _open, _pick_dir, _prepare
from bigmoe_bench import synth_experts
from bigmoe_pager.core.ssd_service import SsdService

READERS = ("python", "native")
"""Who answers: the service's Python threads, or its C threads (BIGMOE_SSD_READER)."""
PATHS = ("load", "mailbox")
"""The ways a read comes in: SsdService.load (host), SsdService.request through the pinned mailbox (CUDA)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp", help="where the test checkpoint goes (on the disk to measure)")
    p.add_argument("--gb", type=float, default=0.4, help="size of the synthetic expert checkpoint, GB")
    p.add_argument("--reads", type=int, default=120, help="single-expert reads per measurement")
    p.add_argument("--switch-us", default="5000,1000,200", help="comma list of GIL switch intervals (us)")
    p.add_argument("--workers", type=int, default=4, help="the service's I/O workers")
    p.add_argument("--paths", default="load", help="comma list of load, mailbox (mailbox: CUDA only)")
    p.add_argument("--readers", default="python", help="comma list of python, native")
    p.add_argument(
        "--batch", type=int, default=1, help="experts a request asks for at once (1: a decode miss; ~100: prefill)"
    )
    p.add_argument("--out", type=Path, help="write results as JSON here")
    a = p.parse_args(argv)
    try:
        intervals = [int(x) for x in a.switch_us.split(",")]
        if not intervals or min(intervals) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--switch-us {a.switch_us!r}: a comma list of positive integers (microseconds)")
    paths = a.paths.split(",")
    if not paths or any(x not in PATHS for x in paths):
        p.error(f"--paths {a.paths!r}: a comma list of {', '.join(PATHS)}")
    readers = a.readers.split(",")
    if not readers or any(x not in READERS for x in readers):
        p.error(f"--readers {a.readers!r}: a comma list of {', '.join(READERS)}")
    if not 1 <= a.batch <= 256:
        p.error(f"--batch {a.batch}: between 1 and 256 experts")
    if "mailbox" in paths and not torch.cuda.is_available():
        p.error("--paths mailbox: the GPU's way in needs CUDA")
    where, why, refused = _pick_dir([a.dir])
    if where is None:
        print(f"bench_ssd_gil: O_DIRECT works in none of the directories: {'; '.join(refused)}", file=sys.stderr)
        return 2
    hidden, inter = SHAPES["qwen3.6-35b-a3b"]
    layout = synth_experts.make_layout(hidden, inter, True)
    experts = 256
    layers = max(1, round(a.gb * 1e9 / (experts * layout.record_bytes)))
    work = where / "bigmoe-bench-ssd-gil"  # the only thing this script creates and removes
    before = sys.getswitchinterval()
    try:
        _prepare(work / "ckpt", work / "experts.bmpf", layout, hidden, inter, layers, experts)
        rows = []
        for reader, path, interval, busy in itertools.product(readers, paths, intervals, (False, True)):
            sys.setswitchinterval(interval / 1e6)
            with _open("checkpoint", work / "ckpt", work / "experts.bmpf", layout, layers, experts) as store:
                row = _measure(store, path, a.reads, a.workers, busy, reader=reader, batch=a.batch)
                rows.append(row | {"switch_us": interval})
            r = rows[-1]
            print(
                f"{reader:6s}  {path:7s}  switch {interval:5d} us  busy={int(busy)}  median {r['median_ms']:6.2f} ms"
                f"  p90 {r['p90_ms']:6.2f} ms  mean {r['mean_ms']:6.2f} ms a request of {a.batch}"
            )
    finally:
        sys.setswitchinterval(before)
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "script": "scripts/bench_ssd_gil.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": platform.node(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "odirect_probe": why,
        "record_bytes": layout.record_bytes,
        "layers": layers,
        "experts_per_layer": experts,
        "rows": rows,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    return 0


def _measure(
    store,
    path: str,
    reads: int,
    workers: int,
    busy: bool,
    device: str = "cuda",
    reader: str = "python",
    batch: int = 1,
) -> dict:
    """Milliseconds for each of `reads` requests by `path` of `batch` distinct random experts of one layer (into
    slots 0 .. batch-1 of its layer), answered by `reader`. device: where a mailbox read's request kernel runs (cpu:
    Triton's interpreter, for tests only)."""
    rng = random.Random(7)
    keys = [(rng.randrange(store.num_layers), rng.sample(range(store.num_experts), batch)) for _ in range(reads)]
    gpu = path == "mailbox"
    pin = gpu and device == "cuda"
    box = gpu or reader == "native"  # the C threads serve loads through the mailbox too
    bufs = [torch.empty(batch, store.layout.pitch, dtype=torch.uint8, pin_memory=pin) for _ in range(store.num_layers)]
    stop = threading.Event()
    hog = threading.Thread(target=_keep_the_gil_busy, args=(stop,), daemon=True) if busy else None
    times = []
    with SsdService(store, bufs, io_workers=workers, mailbox=box, max_requests=batch, reader=reader) as svc:
        if svc.native != (reader == "native"):
            raise RuntimeError(f"the {reader} reader did not start: {svc.reader_note}")
        read = _mailbox_read(svc, device, batch) if gpu else lambda layer, ex: svc.load(layer, ex, range(len(ex)))
        read(*keys[0])  # (the request kernel compiles on its first launch)
        if hog is not None:
            hog.start()
        try:
            for layer, experts in keys:
                t0 = time.perf_counter()
                read(layer, experts)
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            stop.set()
            if hog is not None:
                hog.join()
    times.sort()
    return {
        "reader": reader,
        "batch": batch,
        "path": path,
        "busy_thread": busy,
        "reads": reads,
        "median_ms": round(statistics.median(times), 3),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3),
        "mean_ms": round(statistics.fmean(times), 3),
    }


def _mailbox_read(svc: SsdService, device: str, batch: int = 1):
    """A read as a decode step asks it: the request kernel on the current CUDA stream, then a sync (the GIL released
    while the kernel spins on the mailbox) and the service's error check."""
    expert = torch.zeros(batch, dtype=torch.int64, device=device)
    slot = torch.arange(batch, dtype=torch.int64, device=device)

    def read(layer: int, ex: list[int]) -> None:
        expert.copy_(torch.as_tensor(ex, dtype=torch.int64))
        svc.request(layer, expert, slot)
        if expert.is_cuda:
            torch.cuda.synchronize()
        svc.check()

    return read


def _keep_the_gil_busy(stop: threading.Event) -> None:
    """Pure Python work, as vLLM's host thread does between launches: it lets the GIL go only when asked to."""
    while not stop.is_set():
        total = 0
        for i in range(2000):
            total += i * i


if __name__ == "__main__":
    sys.exit(main())
