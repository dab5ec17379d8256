"""measure_pcie: the pinned host-to-device copy rate of one GPU, the rate the expert pager's
RAM tier is copied at. Timed with CUDA events over a few copies of a 256 MiB pinned buffer.

`measure_h2d` runs in the calling process (it imports torch and makes a CUDA context);
`measure_h2d_in_child` runs it in a short-lived child process, so the caller (bigmoe, which
goes on to launch vLLM) keeps no CUDA context and no VRAM. Both never raise: anything that
stops the measurement gives Unknown(reason). Imports only the standard library at module
level (the GPU machine runs it with PYTHONPATH=pager:app and no app dependencies).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bigmoe.machine import child
from bigmoe.machine.hardware import Unknown

COPY_BYTES = 256 << 20
"""Bytes per timed copy: large enough that launch latency is noise."""
REPEATS = 5
"""Timed copies (after one untimed warm-up); the median is reported."""
CHILD_TIMEOUT_S = 120.0
"""Seconds the child may take (importing torch and making a CUDA context included)."""


@dataclass(frozen=True)
class CopyRate:
    """One measured host-to-device rate."""

    gbps: float
    """Median of the timed copies, bytes / seconds / 1e9."""
    best_gbps: float
    """Fastest timed copy, GB/s."""
    copy_bytes: int
    """Bytes per copy."""
    repeats: int
    """Timed copies."""
    device_name: str
    """torch.cuda.get_device_name of the GPU measured."""

    @property
    def basis(self) -> str:
        return (
            f"median of {self.repeats} pinned copies of {self.copy_bytes >> 20} MiB to {self.device_name} "
            f"(best {self.best_gbps:.1f} GB/s)"
        )


def measure_h2d(
    index: int = 0, copy_bytes: int = COPY_BYTES, repeats: int = REPEATS, torch_module=None
) -> CopyRate | Unknown:
    """Time `repeats` pinned host-to-device copies of `copy_bytes` to GPU `index` in this process.
    `torch_module` stands in for torch (None = import it)."""
    torch = torch_module
    if torch is None:
        try:
            import torch
        except ImportError as e:
            return Unknown(f"torch is not importable here ({e})")
    try:
        if not torch.cuda.is_available():
            return Unknown("torch sees no CUDA GPU (torch.cuda.is_available() is False)")
        if not 0 <= index < torch.cuda.device_count():
            return Unknown(f"torch sees {torch.cuda.device_count()} CUDA GPUs, none with index {index}")
        return _time_copies(torch, index, copy_bytes, repeats)
    except (RuntimeError, OSError, AssertionError) as e:  # CUDA errors surface as RuntimeError (OOM included)
        return Unknown(f"the pinned copy test failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


def _time_copies(torch, index: int, copy_bytes: int, repeats: int) -> CopyRate:
    device = torch.device("cuda", index)
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        target.copy_(host, non_blocking=True)  # warm-up: first-touch and driver mapping costs
        torch.cuda.synchronize(device)
        times_ms = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            stop.record()
            stop.synchronize()
            times_ms.append(start.elapsed_time(stop))
    rates = sorted(copy_bytes / (ms / 1000.0) / 1e9 for ms in times_ms if ms > 0)
    if not rates:
        raise RuntimeError("CUDA events timed every copy at 0 ms")
    name = str(torch.cuda.get_device_name(index))
    del host, target
    return CopyRate(round(rates[len(rates) // 2], 2), round(rates[-1], 2), copy_bytes, len(rates), name)


def measure_h2d_in_child(
    index: int = 0, timeout_s: float = CHILD_TIMEOUT_S, python: str | None = None
) -> CopyRate | Unknown:
    """measure_h2d in a child process (`python -m bigmoe.machine.measure_pcie`), so no CUDA context stays here."""
    return child.rate(child.run("bigmoe.machine.measure_pcie", [str(index)], WHAT, timeout_s, python), CopyRate, WHAT)


def parse_child_output(returncode: int, stdout: str, stderr: str) -> CopyRate | Unknown:
    """The child's last stdout line as a CopyRate or Unknown; anything else is an Unknown naming what went wrong."""
    return child.rate(child.parse(returncode, stdout, stderr, WHAT), CopyRate, WHAT)


WHAT = "the pinned copy test"


def main(argv: list[str]) -> int:
    child.report(measure_h2d(int(argv[0]) if argv else 0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
