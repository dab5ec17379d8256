"""How fast the GPU reads weights left in pinned RAM, the way vLLM 0.33's `--cpu-offload-gb` leaves them.

vLLM 0.33's UVAOffloader pins offloaded parameters in host memory and hands kernels a device view of them
(unified addressing), so a MoE kernel reads a routed expert's bytes over PCIe as it computes. The Qwen4Exp bench
measured that offload at 0.25 ms per token over resident while its routed experts are about 0.15 GB per token
(docs/benchmarks.md, run 4): this probe measures the read rate that comparison implies, per buffer size, read once
(cold) and again (whatever the GPU's caches keep), beside a plain pinned host-to-device copy.

    source /tmp/site/env.sh; python3 scripts/gpu_uva_probe.py --out $OUT/uva-probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

MIB = 1 << 20


def timed_ms(fn, repeats: int) -> list[float]:
    """CUDA-event times (ms) of `repeats` calls of fn, one after another."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def uva_view(host: torch.Tensor) -> torch.Tensor:
    """A device view of pinned host memory, made by vLLM's own op (what UVAOffloader hands the kernels)."""
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    return get_accelerator_view_from_cpu_tensor(host)


def probe(size_mib: int, repeats: int) -> dict:
    """Read rates (GB/s) of a size_mib buffer: UVA view summed by an SM kernel, and a pinned H2D copy."""
    host = torch.randint(0, 127, (size_mib * MIB,), dtype=torch.uint8).pin_memory()
    view = uva_view(host)
    resident = host.to("cuda")
    target = torch.empty_like(resident)
    # float32 sums over every byte: one read of the buffer by the SMs (the values do not matter)
    uva = timed_ms(lambda: view.view(torch.float32).sum(), repeats)
    vram = timed_ms(lambda: resident.view(torch.float32).sum(), repeats)
    copy = timed_ms(lambda: target.copy_(host, non_blocking=True), repeats)
    rate = lambda ms: round(size_mib * MIB / (ms * 1e-3) / 1e9, 2)  # noqa: E731
    return {
        "size_mib": size_mib,
        "uva_read_gbps_first": rate(uva[0]),
        "uva_read_gbps_best": rate(min(uva)),
        "vram_read_gbps_best": rate(min(vram)),
        "pinned_h2d_gbps_best": rate(min(copy)),
        "uva_ms": [round(t, 3) for t in uva],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes-mib", default="5,16,48,147,600", help="buffer sizes (5 MiB ~ one Flash-Next expert)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_uva_probe: no CUDA GPU is visible", file=sys.stderr)
        return 2
    torch.ones(1, device="cuda").sum()  # context and allocator up before the first timing
    rows = [probe(int(s), args.repeats) for s in args.sizes_mib.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
