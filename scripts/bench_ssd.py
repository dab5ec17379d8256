"""SSD tier throughput: O_DIRECT expert reads with N I/O workers, from a checkpoint and from a paging file.

Writes a synthetic expert checkpoint of a preset's real expert shape (FP8 with
128x128 scales, weights drawn from a trained model's law) under --dir, builds a raw
paging file from it (and with `--sources ...,compressed` a compressed one, read
through the DecodedStore both pagers use: each record expanded by the C decoder in
the reading thread), then reads every expert in random order, for each worker count:

- `store`: N threads calling store.read() into their own aligned buffers (the disk's ceiling);
- `load`: SsdService.load() into RAM slots (staging buffer, checks, slot copy): the host-driven path;
- `gpu`: (CUDA only) SsdService.request() from device tensors through the pinned mailbox, synced per batch.

`gbps` counts raw expert bytes delivered; `disk_gbps` the bytes read from the file (fewer for compressed records).

    PYTHONPATH=pager:app:bench python scripts/bench_ssd.py --dir /tmp --gb 1.5 --out $OUT/bench_ssd.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from bigmoe_bench import synth_experts
from bigmoe_bench.disk_reads import read_records
from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION
from bigmoe_pager.codec.record_decoder import DecodedStore, record_decoder
from bigmoe_pager.core.expert_store import CheckpointStore  # noqa: E402
from bigmoe_pager.core.odirect import odirect_works  # noqa: E402
from bigmoe_pager.core.paging_build import EncodedStore, compressed_pitch
from bigmoe_pager.core.paging_file import PagingFileMeta, PagingFileStore, write_paging_file  # noqa: E402
from bigmoe_pager.core.ssd_service import SsdService  # noqa: E402

SOURCES = ("checkpoint", "paging-file", "compressed")
SHAPES = {"qwen3.6-35b-a3b": (2048, 512), "qwen3.8-flash-next": (2560, 640)}  # (hidden, moe intermediate)
BATCH = 64  # experts per load/request call: about one decode step's SSD misses over a few layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir",
        default="/tmp",
        help="where the test files go (on the disk to measure); a comma list tries each until O_DIRECT works",
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-35b-a3b")
    p.add_argument("--gb", type=float, default=1.5, help="size of the synthetic expert checkpoint, GB")
    p.add_argument("--experts", type=int, default=256, help="experts a layer (layers make up --gb, at least one)")
    p.add_argument("--workers", default="1,2,4,8,16", help="comma list of I/O worker counts")
    p.add_argument("--modes", default="store,load,gpu", help="comma list of store, load, gpu")
    p.add_argument(
        "--sources", default="checkpoint,paging-file", help="comma list of " + ", ".join(SOURCES) + " (the files read)"
    )
    p.add_argument("--keep", action="store_true", help="keep the test files (DIR/bigmoe-bench-ssd) for the next run")
    p.add_argument("--out", type=Path, help="write results as JSON here")
    a = p.parse_args(argv)
    sources = a.sources.split(",")
    if not sources or any(x not in SOURCES for x in sources):
        p.error(f"--sources {a.sources!r}: a comma list of {', '.join(SOURCES)}")

    a.dir, why, refused = _pick_dir(a.dir.split(","))
    if a.dir is None:
        print(f"O_DIRECT works in none of the directories: {'; '.join(refused)}", file=sys.stderr)
        return 2
    print(f"measuring in {a.dir} ({_fstype(a.dir)}); {why}")
    hidden, inter = SHAPES[a.shape]
    layout = synth_experts.make_layout(hidden, inter, True)
    experts = a.experts
    layers = max(1, round(a.gb * 1e9 / (experts * layout.record_bytes)))
    work = a.dir / "bigmoe-bench-ssd"  # the only thing this script creates and removes
    ckpt_dir, pf_path = work / "ckpt", work / "experts.bmpf"
    t0 = time.perf_counter()
    _prepare(ckpt_dir, pf_path, layout, hidden, inter, layers, experts, "compressed" in sources)
    prep_s = time.perf_counter() - t0

    modes = [m for m in a.modes.split(",") if m != "gpu" or torch.cuda.is_available()]
    results = []
    for source in sources:
        for workers in (int(w) for w in a.workers.split(",")):
            for mode in modes:
                with _open(source, ckpt_dir, pf_path, layout, layers, experts) as store:
                    results.append(_measure(mode, source, store, workers))
                r = results[-1]
                print(
                    f"{source:12s} {mode:6s} workers={workers:3d}  {r['gbps']:6.2f} GB/s  (disk {r['disk_gbps']:.2f}) "
                    f"({r['experts']} experts, {r['seconds']:.2f} s)"
                )

    report = {
        "script": "scripts/bench_ssd.py",
        "argv": sys.argv[1:],
        "machine": platform.node(),
        "dir": str(a.dir),
        "filesystem": _fstype(a.dir),
        "odirect_probe": why,
        "dirs_refused": refused,
        "shape": a.shape,
        "record_bytes": layout.record_bytes,
        "pitch": layout.pitch,
        "layers": layers,
        "experts_per_layer": experts,
        "data_gb": layers * experts * layout.record_bytes / 1e9,
        "prepare_s": prep_s,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # which expands the compressed records: HostDecoder (C) unless no compiler was found
        "decoder": type(record_decoder(layout)).__name__ if "compressed" in sources else None,
        "results": results,
    }
    _table(results)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _pick_dir(candidates: list[str]) -> tuple[Path | None, str, list[str]]:
    """The first candidate directory where an aligned O_DIRECT read works, its probe note, and the refusals."""
    refused = []
    for c in candidates:
        d = Path(c)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            refused.append(f"{d}: {e.strerror}")
            continue
        ok, why = odirect_works(d)
        if ok:
            return d, why, refused
        refused.append(why)
    return None, "", refused


def _fstype(path: Path) -> str:
    """Filesystem type and device of the mount holding path, from /proc/mounts ("unknown" elsewhere)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if str(path.resolve()).startswith(mnt.rstrip("/") + "/") or str(path.resolve()) == mnt:
                if len(mnt) >= len(best):
                    best, kind = mnt, f"{fs} on {dev} at {mnt}"
    except OSError:
        pass
    return kind


def _prepare(
    ckpt_dir: Path, pf_path: Path, layout, hidden: int, inter: int, layers: int, experts: int, compressed: bool = False
) -> None:
    """Synthetic checkpoint and paging files, reused when a previous run left them (--keep)."""
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    if not ckpt_dir.exists():
        tmp = ckpt_dir.with_name(ckpt_dir.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shards = max(1, layers)
        synth_experts.write_checkpoint(tmp, hidden, inter, layers, experts, fp8=True, shards=shards, law="student_t")
        tmp.rename(ckpt_dir)
    if not pf_path.exists():
        with CheckpointStore(ckpt_dir, layout) as src:
            write_paging_file(pf_path, _meta(layout, layers, experts), src)
    if compressed and not _compressed_path(pf_path).exists():
        with CheckpointStore(ckpt_dir, layout) as src:
            write_paging_file(
                _compressed_path(pf_path),
                _meta(layout, layers, experts, True),
                EncodedStore(src),
                pitch=compressed_pitch(layout),
            )
    os.sync()  # O_DIRECT reads of dirty pages would wait for writeback inside the timed region


def _compressed_path(pf_path: Path) -> Path:
    return pf_path.with_name(pf_path.stem + "-codec" + pf_path.suffix)


def _meta(layout, layers: int, experts: int, compressed: bool = False) -> PagingFileMeta:
    codec = dict(codec=CODEC_NAME, codec_version=CODEC_VERSION) if compressed else {}
    return PagingFileMeta("bench/synthetic", "0", layout.signature(), layers, experts, **codec)


def _open(source: str, ckpt_dir: Path, pf_path: Path, layout, layers: int, experts: int):
    """The store of `source` (one of SOURCES), to use in a `with`."""
    if source == "checkpoint":
        return CheckpointStore(ckpt_dir, layout)
    if source == "compressed":
        meta, pitch = _meta(layout, layers, experts, True), compressed_pitch(layout)
        inner = PagingFileStore(_compressed_path(pf_path), layout, meta, pitch=pitch)
        return DecodedStore(inner, record_decoder(layout))
    return PagingFileStore(pf_path, layout, _meta(layout, layers, experts))


def _keys(store, seed: int = 0) -> list[tuple[int, int]]:
    order = torch.randperm(store.num_layers * store.num_experts, generator=torch.Generator().manual_seed(seed)).tolist()
    return [(k // store.num_experts, k % store.num_experts) for k in order]


def _measure(mode: str, source: str, store, workers: int) -> dict:
    keys = _keys(store)
    disk_before = store.counters.snapshot()["bytes"]
    t0 = time.perf_counter()
    if mode == "store":
        read_records(store, keys, workers)
    else:
        _service_reads(store, keys, workers, gpu=mode == "gpu")
    seconds = time.perf_counter() - t0
    nbytes = len(keys) * store.layout.record_bytes
    disk = store.counters.snapshot()["bytes"] - disk_before
    return {
        "source": source,
        "mode": mode,
        "workers": workers,
        "experts": len(keys),
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "disk_bytes": disk,
        "disk_gbps": disk / seconds / 1e9,
    }


def _service_reads(store, keys: list[tuple[int, int]], workers: int, gpu: bool) -> None:
    pin = torch.cuda.is_available()
    bufs = [torch.empty(BATCH, store.layout.pitch, dtype=torch.uint8, pin_memory=pin) for _ in range(store.num_layers)]
    by_layer: dict[int, list[int]] = {}
    for layer, expert in keys:
        by_layer.setdefault(layer, []).append(expert)
    with SsdService(store, bufs, io_workers=workers, mailbox=gpu, max_requests=BATCH) as svc:
        for layer, experts in by_layer.items():
            for i in range(0, len(experts), BATCH):
                chunk = experts[i : i + BATCH]
                if gpu:
                    ex = torch.tensor(chunk, dtype=torch.int64, device="cuda")
                    svc.request(layer, ex, torch.arange(len(chunk), device="cuda"))
                    torch.cuda.synchronize()
                    svc.check()
                else:
                    svc.load(layer, chunk, list(range(len(chunk))))


def _table(results: list[dict]) -> None:
    """GB/s per source and mode by worker count; a worker count measured twice shows both runs (a / b)."""
    workers = sorted({r["workers"] for r in results})
    rows = sorted({(r["source"], r["mode"]) for r in results})
    print("\nGB/s by I/O workers")
    print(f"{'source':12s} {'mode':6s} " + " ".join(f"{w:>11d}" for w in workers))
    for source, mode in rows:
        runs: dict[int, list[str]] = {w: [] for w in workers}
        for r in results:
            if (r["source"], r["mode"]) == (source, mode):
                runs[r["workers"]].append(f"{r['gbps']:.2f}")
        print(f"{source:12s} {mode:6s} " + " ".join(f"{' / '.join(runs[w]) or '-':>11s}" for w in workers))


if __name__ == "__main__":
    sys.exit(main())
