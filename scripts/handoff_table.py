"""One line for one probe mode of `gpu_issue15.sh handoff-split`: what each step-kernel variant costs.

    python3 scripts/handoff_table.py MODE handoff-MODE.json

The overlap probe ran each variant in turn several times (a process's first graphs replay fast, run 23), so the
line gives, per variant, ms a token and the fused step's mean us of every round after the first, and the joinless
steps' difference from the plain ones (onenode-bare minus none) over those rounds. A file that is not an overlap probe
report is one line and exit 2.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

STEP = "_step_kernel"


def step_us(row: dict) -> float | None:
    """The fused step's mean us in the row's profiled tokens (None: not profiled, or no step seen)."""
    kernels = (row.get("profile") or {}).get("top_kernels", [])
    return next((k["mean_us"] for k in kernels if k["name"].startswith(STEP)), None)


def later_rounds(report: dict, family: str) -> dict[str, list[dict]]:
    """Each variant's rows of `family` after its first, in run order (the resident row left out)."""
    seen: dict[str, list[dict]] = {}
    for row in report["runs"]:
        if row["family"] == family and row["variant"] != "resident":
            seen.setdefault(row["variant"], []).append(row)
    return {variant: rows[1:] for variant, rows in seen.items()}


def line(mode: str, report: dict) -> str:
    cells = [f"probe {mode}:"]
    for family in dict.fromkeys(row["family"] for row in report["runs"]):
        rounds = later_rounds(report, family)
        cells.append(f"{family}:")
        for variant, rows in rounds.items():
            ms = "/".join(f"{r['ms_per_token']:.3f}" for r in rows)
            us = "/".join(f"{u:.2f}" if (u := step_us(r)) is not None else "-" for r in rows)
            cells.append(f"{variant} {ms} ms, step {us} us;")
        pairs = list(zip(rounds.get("none", []), rounds.get("onenode-bare", [])))
        if pairs:
            cells.append(
                f"bare - none {statistics.fmean(j['ms_per_token'] - p['ms_per_token'] for p, j in pairs):+.3f} ms"
            )
            steps = [(step_us(p), step_us(j)) for p, j in pairs]
            if all(a is not None and b is not None for a, b in steps):
                cells.append(f"step {statistics.fmean(b - a for a, b in steps):+.2f} us;")
    return " ".join(cells)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: handoff_table.py MODE REPORT.json", file=sys.stderr)
        return 2
    mode, path = argv
    try:
        report = json.loads(Path(path).read_text())
        print(line(mode, report))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"handoff_table: {path}: not an overlap probe report ({e.__class__.__name__}: {e})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
