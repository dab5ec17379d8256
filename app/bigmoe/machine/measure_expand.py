"""measure_expand: how fast one CPU thread of this machine expands compressed expert records, the work the SSD
tier's reader threads do for every record of a compressed paging file (the pager's C decoder, codec/host_decode.c;
numpy's reference, some 40 times slower, where no C compiler is found: then the plan sees that rate).

One synthetic FP8 expert of Qwen3.6's shape (weights of a trained model's Student-t law, each row scaled to E4M3's
range), encoded once, then expanded over and over for about half a second. `measure_expand_in_child` runs it in a
short-lived child process: it imports torch and builds the decoder, which bigmoe's own process need not hold. Never
raises: anything that stops the measurement gives Unknown(reason).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from bigmoe.machine import child
from bigmoe.machine.hardware import Unknown

EXPERT = (2048, 512)
"""(hidden, moe intermediate) of the synthetic expert: Qwen3.6-35B-A3B's, 3.1 MB with its block scales."""
SECONDS = 0.5
"""Seconds of expanding, at least (after one untimed expansion)."""
CHILD_TIMEOUT_S = 120.0
"""Seconds the child may take (importing torch and building the decoder included)."""
WHAT = "the expansion test"


@dataclass(frozen=True)
class ExpandRate:
    """One measured expansion rate."""

    gbps: float
    """Raw record bytes out per second of one thread, / 1e9."""
    records: int
    """Expansions timed."""
    record_bytes: int
    """Raw bytes of the expert."""
    seconds: float
    """Time they took."""
    decoder: str = "C"
    """The decoder the SSD tier would use here: "C", or "numpy (no C compiler)"."""

    @property
    def basis(self) -> str:
        return (
            f"the pager's {self.decoder} decoder on one thread, {self.records} expansions of a "
            f"{self.record_bytes / 1e6:.1f} MB synthetic FP8 expert in {self.seconds:.2f} s"
        )


def measure_expand(seconds: float = SECONDS) -> ExpandRate | Unknown:
    """Time, in this process, the decoder the SSD tier would use here (`record_decoder`: the C one, numpy's where no
    C compiler is found); imports torch and the pager's codec."""
    try:
        import numpy as np
        import torch
        from bigmoe_pager.codec import CodecError, encode_record
        from bigmoe_pager.codec.host_decoder import HostDecoder
        from bigmoe_pager.codec.record_decoder import record_decoder
        from bigmoe_pager.core.layout import ExpertLayout
    except ImportError as e:
        return Unknown(f"the pager's codec is not importable here ({e})")
    layout = ExpertLayout.for_moe(*EXPERT, torch.float8_e4m3fn, 128)
    try:
        raw = _expert(layout, torch)
        data = torch.from_numpy(np.frombuffer(encode_record(raw, layout), np.uint8).copy())
        decoder = record_decoder(layout)
        name = "C" if isinstance(decoder, HostDecoder) else "numpy (no C compiler)"
        out = torch.empty(layout.record_bytes, dtype=torch.uint8)
        decoder.decode_into(data, layout, out)
        if not np.array_equal(out.numpy(), raw):
            return Unknown(f"{WHAT}: the {name} decoder did not give the expert back")
        records, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or not records:
            decoder.decode_into(data, layout, out)
            records += 1
    except (CodecError, RuntimeError, OSError) as e:
        return Unknown(f"{WHAT} failed ({type(e).__name__}: {e})")
    gbps = round(records * layout.record_bytes / elapsed / 1e9, 3)
    return ExpandRate(gbps, records, layout.record_bytes, elapsed, name)


def _expert(layout, torch):
    """One expert record: Student-t(5) weights, each row scaled to E4M3's largest value (448), random block scales."""
    gen = torch.Generator().manual_seed(0)
    parts = {}
    for comp in layout.components:
        if comp.dtype == torch.float8_e4m3fn:
            t = torch.distributions.StudentT(5.0).sample(comp.shape)
            t = t / t.abs().amax(dim=-1, keepdim=True) * 448.0
            parts[comp.name] = t.to(torch.float8_e4m3fn)
        else:
            parts[comp.name] = torch.rand(comp.shape, generator=gen, dtype=comp.dtype)
    return layout.pack(parts)[: layout.record_bytes].numpy()


def measure_expand_in_child(timeout_s: float = CHILD_TIMEOUT_S, python: str | None = None) -> ExpandRate | Unknown:
    """measure_expand in a child process (`python -m bigmoe.machine.measure_expand`)."""
    return parse_fields(child.run("bigmoe.machine.measure_expand", [], WHAT, timeout_s, python))


def parse_fields(fields: dict | Unknown) -> ExpandRate | Unknown:
    """The child's fields as an ExpandRate, or Unknown naming what is wrong with them."""
    return child.rate(fields, ExpandRate, WHAT)


def main() -> int:
    child.report(measure_expand())
    return 0


if __name__ == "__main__":
    sys.exit(main())
