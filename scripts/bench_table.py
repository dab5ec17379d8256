"""One line a row of a bench run (scripts/gpu_vllm_bench.py --out): what to read first after an H200 call.

    python3 scripts/bench_table.py bench-q1.json

Per row: TPOT, its ratio to the same call's resident and --cpu-offload-gb 17 rows of its family (where they ran),
the VRAM hit rate, GB a token over PCIe, whether its greedy tokens equal resident's, and, for profiled rows, the
median launch gap of vLLM's chain beside a prefetch kernel and alone (kernel_timeline's chain_gaps), and the
registers and local-memory bytes a thread of each fused step variant the engine compiled (step_kernels). A file that
is not a bench run is one line and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(bench: dict) -> list[str]:
    rows = bench["configs"]
    resident = {r["family"]: r for r in rows if r["name"] == "resident"}
    offload = {r["family"]: r for r in rows if r["name"] == "offload17"}
    out = []
    for r in rows:
        family, tpot = r["family"], r.get("tpot_ms")
        ref = resident.get(family)
        cells = [f"{r['name']:46s}", f"{family:12s}", f"{tpot if tpot is not None else '-':>7}"]
        cells.append(f"{tpot / ref['tpot_ms']:.2f}x res" if tpot and ref and ref.get("tpot_ms") else "        ")
        off = offload.get(family)
        cells.append(f"{off['tpot_ms'] / tpot:.2f}x off" if tpot and off and off.get("tpot_ms") else "        ")
        hit = (r.get("decode_hit_rate") or {}).get("vram")
        cells.append(f"vram {hit}" if hit is not None else "")
        if r.get("pcie_gb_per_token") is not None:
            cells.append(f"pcie {r['pcie_gb_per_token']} GB")
        if ref and r is not ref and r.get("tokens") and ref.get("tokens"):
            cells.append("tokens same" if r["tokens"] == ref["tokens"] else "TOKENS DIFFER")
        gaps = (r.get("decode_profile") or {}).get("chain_gaps")
        if gaps:
            beside, alone = gaps["beside_side"]["median_us"], gaps["alone"]["median_us"]
            cells.append(f"gaps beside {beside} alone {alone} us")
        steps = r.get("step_kernels") or {}
        if steps:
            cells.append(
                "steps " + ", ".join(f"{v} {k['registers']}r {k['local_bytes']}B" for v, k in sorted(steps.items()))
            )
        out.append("  ".join(c for c in cells if c))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: bench_table.py BENCH.json", file=sys.stderr)
        return 2
    try:
        bench = json.loads(Path(argv[0]).read_text())
        table = lines(bench)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bench_table: {argv[0]} is not a bench run ({e})", file=sys.stderr)
        return 2
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
