"""Why bigmoe engines load slowly on vLLM 0.33: the loader's copy into the RAM tier, taken apart (no vLLM).

    PYTHONPATH=pager python3 scripts/gpu_load_copy_probe.py --checkpoint DIR --out load-copy-probe.json

On the H200 with vLLM 0.33 and torch 2.14, each bigmoe engine spent about 330 s in "Loading weights" for the
40-layer checkpoint (32 GiB, about 100 MB/s), against 19 s for the resident engine; the engine's sampled stacks sit
on vLLM's `expert_data.copy_(loaded_weight)` into the pinned RAM records (run 8, docs/benchmarks.md). This repeats
that copy outside vLLM: the checkpoint's expert tensors as vLLM's safetensors iterator yields them, copied into the
rows of a page-locked (cudaHostRegister'ed) or plain host buffer, as FP8 (what vLLM does), as bytes, through numpy,
on torch's intra-op threads or on one, and alone or beside a second process doing the same. Each variant stops
after --seconds; the rate is what it copied by then.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

VARIANTS = ("fp8", "fp8-1thread", "bytes", "numpy")
"""How a tensor is copied into its record: torch copy_ as FP8 on torch's threads (vLLM's copy) or on one
thread, torch copy_ of byte views, numpy copyto of byte views."""


def expert_tensors(checkpoint: Path, limit_bytes: int):
    """(file, name) of the checkpoint's FP8 expert weights, in file order, up to limit_bytes."""
    from safetensors import safe_open

    picked, total = [], 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".experts." not in name or not name.endswith("weight"):
                    continue
                sl = f.get_slice(name)
                nbytes = int(np.prod(sl.get_shape()))  # FP8: one byte per element
                picked.append((path, name))
                total += nbytes
                if total >= limit_bytes:
                    return picked
    return picked


def copy_all(tensors, records: torch.Tensor, variant: str, seconds: float) -> tuple[int, float]:
    """Bytes copied and seconds taken: each tensor into the next record, as `variant` copies it."""
    threads = torch.get_num_threads()
    if variant == "fp8-1thread":
        torch.set_num_threads(1)
    copied, started = 0, time.perf_counter()
    try:
        for i, src in enumerate(_iterate(tensors)):
            row = records[i % records.shape[0], : src.numel()]
            if variant in ("fp8", "fp8-1thread"):
                row.view(src.dtype).view(src.shape).copy_(src)
            elif variant == "bytes":
                row.view(src.shape).copy_(src.view(torch.uint8))
            else:
                np.copyto(row.numpy().reshape(src.shape), src.view(torch.uint8).numpy())
            copied += src.numel()
            if time.perf_counter() - started > seconds:
                break
    finally:
        torch.set_num_threads(threads)
    return copied, time.perf_counter() - started


def _iterate(tensors):
    """The tensors as vLLM's safetensors iterator yields them: each file opened once, get_tensor per name."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for path, name in tensors:
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                yield f.get_tensor(name)


def records_for(tensors, pinned: bool) -> torch.Tensor:
    from bigmoe_pager.core.pinned import pinned_empty

    widest = 0
    for path, name in tensors[:8]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            widest = max(widest, int(np.prod(f.get_slice(name).get_shape())))
    rows = min(len(tensors), 256)
    out = pinned_empty((rows, widest), torch.uint8, pin=pinned)
    out.fill_(0)  # pages touched, as the RAM tier's are before the loader writes
    return out


def measure(checkpoint: Path, gib: float, variant: str, pinned: bool, seconds: float) -> dict:
    if torch.cuda.is_available():
        torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # a CUDA context with memory, as an engine has
    tensors = expert_tensors(checkpoint, int(gib * 2**30))
    records = records_for(tensors, pinned)
    copied, took = copy_all(tensors, records, variant, seconds)
    return {
        "variant": variant,
        "pinned": pinned and torch.cuda.is_available(),
        "threads": 1 if variant == "fp8-1thread" else torch.get_num_threads(),
        "bytes": copied,
        "seconds": round(took, 2),
        "gb_per_s": round(copied / took / 1e9, 3),
    }


def hold_pinned(gib: float) -> torch.Tensor | None:
    """Page-locked memory this process keeps while it measures, as an engine's RAM tier is (GiB; 0: none)."""
    if gib <= 0 or not torch.cuda.is_available():
        return None
    from bigmoe_pager.core.pinned import pinned_empty

    return pinned_empty((int(gib * 2**30),), torch.uint8)


def _child(args, ballast_gib: float, queue) -> None:
    held = hold_pinned(ballast_gib)  # noqa: F841 (kept alive while measuring)
    queue.put(measure(*args))


def beside_another(checkpoint: Path, gib: float, variant: str, pinned: bool, seconds: float, ballast: float) -> list:
    """Two processes doing the same variant at once (two engines loading, as gpu_vllm_bench runs them)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    job = (checkpoint, gib, variant, pinned, seconds)
    procs = [ctx.Process(target=_child, args=(job, ballast, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    return [{**r, "processes": 2} for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a folder of safetensors files with FP8 experts")
    ap.add_argument("--gib", type=float, default=1.0, help="expert bytes each variant may copy (GiB)")
    ap.add_argument("--seconds", type=float, default=8.0, help="each variant stops after this long")
    ap.add_argument("--hold-pinned-gib", type=float, default=0.0, help="page-locked GiB each process holds meanwhile")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not sorted(args.checkpoint.glob("*.safetensors")):
        why = f"unknown variants {bad}" if bad else f"no safetensors files in {args.checkpoint}"
        print(f"gpu_load_copy_probe: {why}", file=sys.stderr)
        return 2
    held = hold_pinned(args.hold_pinned_gib)  # noqa: F841 (kept alive while measuring)
    rows = []
    for pinned in (True, False):
        for variant in variants:
            rows.append({**measure(args.checkpoint, args.gib, variant, pinned, args.seconds), "processes": 1})
            print(json.dumps(rows[-1]), flush=True)
    for row in beside_another(args.checkpoint, args.gib, "fp8", True, args.seconds, args.hold_pinned_gib):
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "torch": torch.__version__}
        args.out.write_text(json.dumps({**report, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
