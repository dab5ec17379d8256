"""The rows of a bench call: what one engine's result (scripts/vllm_e2e_child.py's bench task, a measurement per
routing family and recall) becomes in the report: its facts, and per measurement the times, hit rates, bytes a decoded
token, issue 15's prefetch figures and, where it read from SSD, its disk floors. Apart from scripts/gpu_vllm_bench.py
(which starts the engines) so that scripts/gpu_qwen4exp_bench.py, which times other layers, makes the same rows.
"""

from __future__ import annotations

import gpu_vllm_e2e as e2e  # noqa: E402  (scripts/ is not a package)
from bench_names import Point, row_name  # noqa: E402

ENGINE_FIELDS = (
    "startup_s",
    "turn_wait_s",
    "quiet_wait_s",
    "cudagraph_mode",
    "experts_kernel",
    "inductor_deterministic",
    *e2e.ENGINE_FACTS,
)
"""What every row of an engine repeats from its run (startup_s excludes the wait for the quiet file; prefetch_joins /
prefetch_forks: where its captures joined the prefetch and how often they forked it; prefetch_chain_timeouts: chained
rounds whose device wait gave up, None where none was chained; prefetch_chain_cancels: joinless rounds their step
came before; prefetch_chain_late: drains that held a slot for a late host copy (each LATE_LIMIT-th holds the rounds
back a while); prefetch_host_copier: the host copier's counters, None where none ran; step_kernels: registers and
local memory bytes a thread of each fused step variant the engine compiled (core.step_kernel.COMPILED); load_copy_*:
what vLLM's loader copied into the RAM tier, and how long)."""


def engine_rows(row: dict, todo: list[dict], disk: dict | None, wrong: str = "uniform") -> list[dict]:
    """One engine's run as result rows, one per (family, recall, wrong ids) it was to measure (a failed run: each
    with its error), named as row_name says, with the engine's startup and turn-wait seconds and the disk floors.
    A point --recalls names twice is measured twice, in turn; its second row's name ends in /2 (the third /3)."""
    name, result = row["name"], row.pop("result", None)
    base = {k: v for k, v in row.items() if k != "name"}
    done: dict[tuple, list[dict]] = {}
    for m in (result or {}).get("measurements", []):
        done.setdefault((m["family"], m["recall"], m.get("wrong")), []).append(m)
    seen: dict[tuple, int] = {}
    engine = {"configuration": name, **{k: (result or {}).get(k) for k in ENGINE_FIELDS}}
    engine["pager_totals"] = (result or {}).get("pager")  # the engine's counters over all its measurements
    out = []
    for m in todo:
        key = (m["family"], m["recall"], m.get("wrong"))
        point = None if m["recall"] is None else Point(m["recall"], m.get("wrong") or wrong)
        seen[key] = seen.get(key, 0) + 1
        repeat = f"/{seen[key]}" if seen[key] > 1 else ""
        head = {
            "name": row_name(name, point, wrong) + repeat,
            "family": m["family"],
            "recall": m["recall"],
            **engine,
            **base,
        }
        if point is not None:
            head["wrong_ids"] = point.wrong
        if len(done.get(key, [])) < seen[key]:
            out.append({**head, "error": row.get("error") or "the engine returned no measurement of this trace"})
            continue
        got = done[key][seen[key] - 1]
        out.append({**head, **summarize(got), **disk_floors(got, disk)})
    return out


def summarize(m: dict) -> dict:
    """One measurement's record: times, hit rates, bytes per decoded token, prefetch figures, the timed tokens."""
    decode = m.get("decode_counters") or {}
    rate = lambda c: round(c["hits"] / c["lookups"], 4) if c.get("lookups") else None  # noqa: E731
    return {
        "tpot_ms": m["tpot_ms"],
        "ttft_ms": m["ttft_ms"],
        "decode_hit_rate": {tier: rate(c) for tier, c in decode.items()},
        "pcie_gb_per_token": m.get("pcie_gb_per_token"),
        "ssd_gb_per_token": m.get("ssd_gb_per_token"),
        **prefetch_summary(decode, m.get("decode_tokens")),
        "timed_counters": m.get("timed_counters"),
        "tokens": m.get("tokens"),
        **({"decode_profile": m["decode_profile"]} if m.get("decode_profile") else {}),
    }


def disk_floors(m: dict, disk: dict | None) -> dict:
    """Issue 15's SSD floors of one measurement, where it read from SSD and the disk was measured: TPOT floor = SSD
    GB per decoded token / the disk's O_DIRECT GB/s; TTFT floor = the timed request's SSD bytes less its decode
    tokens' (at the counters request's per-token rate) / the same bandwidth (an estimate of its prefill's reads)."""
    bw = (disk or {}).get("gb_per_s")
    per_token = m.get("ssd_gb_per_token")
    if not bw or not per_token:
        return {}
    out = {"disk_floor_tpot_ms": round(per_token / bw * 1e3, 3)}
    if m.get("tpot_ms"):
        out["tpot_vs_disk_floor"] = round(m["tpot_ms"] / out["disk_floor_tpot_ms"], 3)
    timed = ((m.get("timed_counters") or {}).get("ssd") or {}).get("bytes_moved")
    if timed is not None and m.get("decode_tokens"):
        prefill_gb = max(timed / 1e9 - per_token * (m["decode_tokens"] - 1), 0.0)
        out["disk_floor_ttft_ms"] = round(prefill_gb / bw * 1e3, 3)
        if m.get("ttft_ms") and out["disk_floor_ttft_ms"]:
            out["ttft_vs_disk_floor"] = round(m["ttft_ms"] / out["disk_floor_ttft_ms"], 3)
    return out


def prefetch_summary(decode: dict, tokens: int | None) -> dict:
    """Issue 15's prefetch figures of the decode counters: per tier that was prefetched into, the share of the
    step's non-resident needs a prefetch had brought in (used / (used + misses)), prefetched GB never used per
    token, and the needed prefetches a token whose copy the step still had to wait for (joinless forwards; None
    from an engine older than the counter). Empty when nothing was prefetched."""
    out = {}
    for tier, c in decode.items():
        if not c.get("prefetched") or not tokens:
            continue
        used, misses = c.get("prefetch_used", 0), c["lookups"] - c["hits"]
        out[f"prefetch_accuracy_{tier}"] = round(used / (used + misses), 4) if used + misses else None
        out[f"prefetch_wasted_gb_per_token_{tier}"] = round(c.get("prefetch_wasted_bytes", 0) / tokens / 1e9, 5)
        out[f"prefetched_per_token_{tier}"] = round(c["prefetched"] / tokens, 3)
        late = c.get("prefetch_late")
        out[f"prefetch_late_per_token_{tier}"] = None if late is None else round(late / tokens, 3)
    hurried = (decode.get("ssd") or {}).get("hurried")
    if hurried is not None and tokens and out:  # reads ahead a step waited for before they started
        out["ssd_reads_hurried_per_token"] = round(hurried / tokens, 3)
    return out
