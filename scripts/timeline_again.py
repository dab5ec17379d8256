"""Read a bench run's kernel timelines again with today's bigmoe_bench.kernel_timeline.

The bench rows keep what kernel_timeline said on the machine; the Chrome traces behind them stay in the run's logs
tarball (100 MB or more: not in git). When the summary learns something new (run 20: `chain_gaps`), this reads
the traces again and writes, for every profiled row, the new summary's chosen fields:

    tar xzf logs-bench-q1.tgz -C /tmp/q1
    python3 scripts/timeline_again.py bench-q1.json /tmp/q1/logs-bench-q1 --fields chain_gaps --out gaps-q1.json

A row whose trace is missing from the logs directory is one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bigmoe_bench.kernel_timeline import summarize_file  # noqa: E402


def trace_in(logs: Path, recorded: str) -> Path:
    """The row's trace inside the extracted logs directory (the machine's path keeps only its last two parts)."""
    return logs / Path(recorded).parent.name / Path(recorded).name


def again(bench: dict, logs: Path, fields: list[str]) -> list[dict]:
    rows = []
    for row in bench["configs"]:
        profile = row.get("decode_profile")
        if not profile:
            continue
        path = trace_in(logs, profile["trace"])
        if not path.is_file():
            raise FileNotFoundError(f"{row['name']} ({row['family']}): no trace at {path}")
        summary = summarize_file(path, profile["tokens"])
        rows.append(
            {
                "name": row["name"],
                "family": row["family"],
                "tpot_ms": row.get("tpot_ms"),
                **{f: summary.get(f) for f in fields},
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="a bench JSON (scripts/gpu_vllm_bench.py --out)")
    parser.add_argument("logs", type=Path, help="its logs directory, extracted from the run's logs tarball")
    parser.add_argument("--fields", default="chain_gaps", help="comma-separated summary fields to keep")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        bench = json.loads(args.bench.read_text())
        rows = again(bench, args.logs, [f for f in args.fields.split(",") if f])
    except (OSError, ValueError, KeyError) as e:
        print(f"timeline_again: {e}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps({"bench": args.bench.name, "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(
            r["name"],
            r["family"],
            r["tpot_ms"],
            json.dumps({f: r[f] for f in r if f not in ("name", "family", "tpot_ms")}),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
