"""How long checking a paging file takes at start (docs/benchmarks.md, issue 17).

    python scripts/bench_paging_check.py [--dir /tmp] [--layers 8] [--experts 128]

Writes a paging file of random FP8-expert records (hidden 2048, intermediate 768, 128x128 blocks: 4.5 MiB
each; 8 x 128 of them = 4.5 GiB) with PagingFileWriter, then times PagingFileStore.check_records over every
record and over the sample prepare checks above FULL_CHECK_BYTES. Deletes the file afterwards. A script, not a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bigmoe.serve.prepare import sample_records
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.paging_file import PagingFileMeta, PagingFileStore, PagingFileWriter, sample_keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="Where the file is written.")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    layout = ExpertLayout.for_moe(2048, 768, torch.float8_e4m3fn, 128)
    meta = PagingFileMeta("bench/check", "r", layout.signature(), args.layers, args.experts)
    path = args.dir / "bench-check.pages"
    record = np.random.default_rng(0).integers(0, 256, layout.record_bytes, dtype=np.uint8)
    try:
        start = time.perf_counter()
        with PagingFileWriter(path, meta, layout.pitch) as writer:
            for key in range(args.layers * args.experts):
                record[:8] = np.frombuffer(np.int64(key).tobytes(), np.uint8)  # every record different
                writer.add(key // args.experts, key % args.experts, record)
            writer.commit()
        size = path.stat().st_size / 2**30
        print(f"wrote {size:.2f} GiB in {time.perf_counter() - start:.1f} s")
        with PagingFileStore(path, layout, meta) as store:
            start = time.perf_counter()
            store.check_records()
            full = time.perf_counter() - start
            n = min(sample_records(layout.record_bytes), args.layers * args.experts)
            start = time.perf_counter()
            store.check_records(sample_keys(args.layers * args.experts, n))
            sampled = time.perf_counter() - start
        print(
            f"full check of {args.layers * args.experts} records: {full:.1f} s ({size / full:.2f} GiB/s); "
            f"sample of {n} records: {sampled:.2f} s"
        )
    finally:
        path.unlink(missing_ok=True)
        os.sync()


if __name__ == "__main__":
    main()
