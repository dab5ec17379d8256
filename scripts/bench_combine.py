"""`gpu_vllm_bench.py --combine`: merges the result files of several calls into one (docs/bench/prefetch.json) and
computes issue 15's ratios per family, each paired side by side in one call where one ran both rows, else on one card
(the target card's first), the SSD rows' disk-floor ratios and the targets they meet. Apart from the engine harness
(gpu_vllm_bench.py, whose main dispatches here) because it runs no engine: it reads result rows by their names
(bench_names) and writes one JSON file.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import gpu_vllm_e2e as e2e  # noqa: E402  (scripts/ is not a package)
from bench_names import AHEAD, default_prefetch_suffix, ran_current_defaults  # noqa: E402
from bigmoe_pager.settings import PagerSettings


def family_ratios(
    rows: dict[tuple[str, str], dict], every: dict | None = None, path: str = "", recall_0_calls: int = 1
) -> dict[str, dict]:
    """Per family, issue 15's ratios at prediction recall 0.8 (and without prefetch, and at recall 0, to compare);
    `rows` ((family, name) -> row) is in recency order, `every` ((family, name) -> every row of that name, file by
    file; default: the rows) pairs each row with the resident or offload17 row of its own call where there is one.
    Each family's output names under "rows" the configuration each 102- and 32-slot ratio used, the first there
    is of:
    - with `path` (name suffixes), a prefetching row of that path (`bigmoe-N-layerbuf@r0.8` + path), the family's
      output then naming it as "path";
    - a plain name whose env names the plugin's current defaults (ran_current_defaults), the most recent;
    - a prefetching row that names the default gate and budget in its suffix (default_prefetch_suffix);
    - a row that names the default eviction (~POLICY);
    - the plain name (the defaults of its day).
    Recall 0 against no prefetch: only side by side, the mean ratio of the latest `recall_0_calls` calls that ran
    both (recall_0_ratios), each call's ratio also listed."""
    every = every if every is not None else {key: [r] for key, r in rows.items()}
    out = {}
    default = "~" + PagerSettings().eviction
    prefetch = default_prefetch_suffix()
    order = {key: i for i, key in enumerate(rows)}
    for family in sorted({f for f, _ in rows}):
        t = {name: r.get("tpot_ms") for (f, name), r in rows.items() if f == family}
        ratios, used, sources = {}, {}, {}
        for suffix, key in (("@r0.8", ""), ("", "_no_prefetch"), ("@r0", "_recall_0")):
            # The plugin's default prefill (the whole-layer buffer) where it ran; decode is the same either way.
            found = {}
            for n in (102, 32):
                plain = [f"bigmoe-{n}-layerbuf{suffix}{p}" for p in (default, "")] + [f"bigmoe-{n}{suffix}"]
                current = [m for m in plain if ran_current_defaults(rows.get((family, m), {}), bool(suffix))]
                current.sort(key=lambda m: order[family, m], reverse=True)  # the latest first
                named = [f"bigmoe-{n}-layerbuf{suffix}{p}{prefetch}" for p in (default, "")] if suffix else []
                on_path = [f"bigmoe-{n}-layerbuf{suffix}{path}"] if path and suffix else []
                names = on_path + current + named + plain
                found[n] = next((m for m in names if t.get(m)), None)
                if found[n]:
                    used[f"{n}{key}"] = found[n]
            for n, ref, label, upward in (
                (102, "offload17", "speedup_vs_offload17_at_102", True),
                (102, "resident", "tpot_vs_resident_at_102", False),
                (32, "offload17", "speedup_vs_offload17_at_32", True),
            ):
                mine, theirs, where = side_by_side(every, family, found[n], ref) if found[n] else (None, None, {})
                if mine and theirs:
                    ratios[label + key] = round(theirs / mine if upward else mine / theirs, 3)
                    sources[label + key] = where
        if used.get("102_recall_0") and used.get("102_no_prefetch"):
            # Recall 0 against no prefetch straight, only where one call ran both (calls differ by 4-6%: run 33)
            calls = recall_0_ratios(every, family, used["102_recall_0"], used["102_no_prefetch"])[-recall_0_calls:]
            if calls:
                ratios["recall_0_vs_no_prefetch_at_102"] = round(sum(c.ratio for c in calls) / len(calls), 3)
                ratios["recall_0_vs_no_prefetch_calls"] = {c.source: round(c.ratio, 3) for c in calls}
                ratios["recall_0_calls_ms"] = {c.source: c.report() for c in calls}
                cards = {r.get("source"): r for r in every.get((family, used["102_recall_0"]), [])}
                gpus = sorted({_card(cards[c.source]) for c in calls})
                sources["recall_0_vs_no_prefetch_at_102"] = {
                    "calls": [c.source for c in calls],
                    "gpu": ", ".join(gpus),
                    "side_by_side": True,
                }
        if path and any(m.endswith(path) for m in used.values()):
            ratios["path"] = path
        out[family] = {**ratios, "rows": used, "sources": sources}
    return out


@dataclass(frozen=True)
class Recall0Call:
    """One call's recall-0 row beside its no-prefetch row: TPOTs in ms, each configuration's engines averaged."""

    source: str
    """The result file."""
    recall_0: list[float]
    """TPOT of each engine of the recall-0 configuration (the row and its `#k` replicas)."""
    no_prefetch: list[float]
    """TPOT of each engine of the no-prefetch configuration."""

    @property
    def ratio(self) -> float:
        return statistics.fmean(self.recall_0) / statistics.fmean(self.no_prefetch)

    def report(self) -> dict[str, float]:
        """The difference in ms beside the widest spread between engines of one configuration in the call (0 where
        each ran one engine): a difference inside that spread says nothing about the build (run 40: up to 0.29 ms)."""
        spread = max(max(t) - min(t) for t in (self.recall_0, self.no_prefetch))
        diff = statistics.fmean(self.recall_0) - statistics.fmean(self.no_prefetch)
        return {"difference": round(diff, 3), "engine_spread": round(spread, 3)}


def recall_0_ratios(every: dict, family: str, name: str, ref: str) -> list[Recall0Call]:
    """Each call (result file) that measured both `name` and `ref` in `family`, oldest first, with its replicas
    (`name#2`, ...) beside the row they repeat."""

    def by_call(base: str) -> dict[str, list[float]]:
        tpots: dict[str, list[float]] = {}
        for (f, n), found in every.items():
            if f == family and (n == base or (n.startswith(base + "#") and n[len(base) + 1 :].isdigit())):
                for r in found:
                    if r.get("tpot_ms"):
                        tpots.setdefault(r.get("source"), []).append(r["tpot_ms"])
        return tpots

    mine, theirs = by_call(name), by_call(ref)
    order = [r.get("source") for r in every.get((family, name), [])]
    return [Recall0Call(s, mine[s], theirs[s]) for s in dict.fromkeys(order) if s in mine and s in theirs]


def side_by_side(
    every: dict, family: str, name: str, ref: str, fallback: bool = True
) -> tuple[float | None, float | None, dict]:
    """TPOTs of `name` and of the reference `ref` in `family`, from the latest call (result file) that measured
    both: ratios are taken side by side in one call where one did; else (fallback) the latest row of `name` with a
    reference measured on the same card (result files before run 35 name none: all the H200's, but run 34's, whose
    card was added from the device's reply) and that card's latest reference; else none. The third item says where
    the pair came from: the call of each row, the card, and whether one call ran both (machines of one card differ
    by 10-20% in paged rows: run 43). Within each of those two steps the target card's rows come first, however
    recent another card's are (run 49: a later H100 row would otherwise pair with an older H100 machine's reference
    while the H200 had a pair of its own)."""
    mine = sorted((r for r in every.get((family, name), []) if r.get("tpot_ms")), key=_on_target_card)
    theirs = {r.get("source"): r for r in every.get((family, ref), []) if r.get("tpot_ms")}
    for r in reversed(mine):
        if r.get("source") in theirs:
            return r["tpot_ms"], theirs[r["source"]]["tpot_ms"], _pair_source(r, theirs[r["source"]])
    if not fallback:
        return None, None, {}
    for r in reversed(mine):
        same_card = [o for o in every.get((family, ref), []) if o.get("tpot_ms") and o.get("gpu") == r.get("gpu")]
        if same_card:
            return r["tpot_ms"], same_card[-1]["tpot_ms"], _pair_source(r, same_card[-1])
    return (mine[-1]["tpot_ms"] if mine else None), None, {}


def _pair_source(row: dict, ref: dict) -> dict:
    calls = dict.fromkeys([row.get("source"), ref.get("source")])
    return {"calls": list(calls), "gpu": _card(row), "side_by_side": len(calls) == 1}


TARGET_CARD = "H200"
"""Issue 15's targets are the H200's: result files naming another card (`gpu`) keep their rows beside its rows
(other_card_configs), not in their place; files before run 35 name no card (all the H200's but run 34's)."""


def _on_target_card(row: dict) -> bool:
    return TARGET_CARD in (row.get("gpu") or TARGET_CARD)  # files before run 35 name no card: the H200's


def _card(row: dict) -> str:
    return row.get("gpu") or "not named (files before run 35: the H200)"


def ssd_ratios(rows: dict[tuple[str, str], dict]) -> dict:
    """Top-level SSD figures: the SSD configuration's TPOT and TTFT over their disk floors, from the standard family
    (else the first) at recall 0.8 with reads ahead, else at 0.8, else any SSD row; which row is named. Then the
    same family's rows over its needed floors (needed_disk_floors), and the best of them: the figures the targets
    judge."""
    ssd = [(f, n) for (f, n), r in rows.items() if "tpot_vs_disk_floor" in r]
    if not ssd:
        return {}
    rank = lambda key: (key[0] != "standard", "@r0.8" not in key[1], not key[1].endswith(AHEAD), key)  # noqa: E731
    family, name = min(ssd, key=rank)
    r = rows[family, name]
    needed = needed_disk_floors({n: rows[f, n] for f, n in ssd if f == family})
    best = lambda key: min(((v[key], n) for n, v in needed["rows"].items() if key in v), default=(None, None))  # noqa: E731
    (tpot, tpot_row), (ttft, ttft_row) = best("tpot_vs_needed_disk_floor"), best("ttft_vs_needed_disk_floor")
    return {
        "ssd_tpot_vs_disk_floor": r["tpot_vs_disk_floor"],
        "ssd_ttft_vs_disk_floor": r.get("ttft_vs_disk_floor"),
        "ssd_floor_row": {"family": family, "name": name},
        "ssd_needed_floor": {"family": family, **needed},
        "ssd_tpot_vs_needed_disk_floor": {"ratio": tpot, "row": tpot_row},
        "ssd_ttft_vs_needed_disk_floor": {"ratio": ttft, "row": ttft_row},
    }


def needed_disk_floors(rows: dict[str, dict]) -> dict:
    """A row's own disk floor counts every byte it read, so reads ahead that are never used raise the floor they are
    judged by (run 9: 3.2x the plain pager's bytes a token, 147 against 86 ms, 0.90x "its" floor). The needed floor
    is the disk time of the fewest bytes any of these rows (one family's, the same trace) read: GB a decoded token
    and GB of the timed request's prefill, each over the row's own call's disk GB/s (its floor's bytes over its
    floor). Returns those GB and, per row, its TPOT and TTFT over them."""
    gb_per_s = {n: r["ssd_gb_per_token"] / r["disk_floor_tpot_ms"] * 1e3 for n, r in rows.items()}
    prefill_gb = {
        n: r["disk_floor_ttft_ms"] / 1e3 * gb_per_s[n] for n, r in rows.items() if r.get("disk_floor_ttft_ms")
    }
    token_gb = min(r["ssd_gb_per_token"] for r in rows.values())
    least_prefill = min(prefill_gb.values(), default=None)
    out = {}
    for n, r in rows.items():
        got = {"tpot_vs_needed_disk_floor": round(r["tpot_ms"] / (token_gb / gb_per_s[n] * 1e3), 3)}
        if least_prefill and r.get("ttft_ms"):
            got["ttft_vs_needed_disk_floor"] = round(r["ttft_ms"] / (least_prefill / gb_per_s[n] * 1e3), 3)
        out[n] = got
    return {
        "gb_per_token": token_gb,
        "prefill_gb": None if least_prefill is None else round(least_prefill, 3),
        "rows": out,
    }


IN_SOURCE_ONLY = ("tokens", "pager_totals", "timed_counters")
"""Fields of another card's rows that the combined file leaves in their source files (see combine)."""


def combine(files: list[Path], out: Path, path: str = "", recall_0_calls: int = 1) -> int:
    """Merge result files (one per call) into one: their rows by (family, name), issue 15's ratios per family (of
    the prefetch `path` where one is named: family_ratios), the SSD floors, and the targets those ratios meet."""
    rows, every, other_cards = {}, {}, []
    meta = {}
    for f in files:
        part = json.loads(f.read_text())
        meta.setdefault("checkpoint", part.get("checkpoint"))
        meta.setdefault("commands", []).append(part.get("command"))
        if "gb_per_s" in (part.get("disk") or {}):
            meta.setdefault("disk", part["disk"])
        card = part.get("gpu")
        for r in part["configs"]:  # a later file's row replaces an earlier one's and moves to the end (recency)
            key = (r.get("family", "standard"), r["name"])
            row = {**r, "source": f.name, **({"gpu": card} if card else {})}
            if not _on_target_card(row):
                other_cards.append(row)
            else:
                rows.pop(key, None)
                rows[key] = row
            every.setdefault(key, []).append(row)
    for key, r in rows.items():
        # SSD rows of one configuration ranged 58-97 ms over the H200's calls (runs 29, 32): keep every call's TPOT
        calls = [c for c in every[key] if _on_target_card(c) and c.get("tpot_ms")]
        if len(calls) > 1:
            r["tpot_ms_calls"] = {c["source"]: c["tpot_ms"] for c in calls}
    tpot = {name: r.get("tpot_ms") for (family, name), r in rows.items() if family == "standard"}
    for r in [*rows.values(), *other_cards]:
        # Greedy tokens of the timed request: which configurations of its family (on the target card) produced
        # exactly the same.
        if r.get("tokens") is not None:
            family = r.get("family", "standard")
            r["same_tokens_as"] = [
                n for (f, n), o in rows.items() if f == family and o is not r and o.get("tokens") == r["tokens"]
            ]
    for (family, name), r in rows.items():
        resident = rows.get((family, "resident"), {}).get("tpot_ms")
        if r.get("tpot_ms") and resident and name != "resident":
            # What the GPU spends per token beyond the resident engine: waits for copies and reads, and the pager's
            # own kernels (a replayed CUDA graph cannot tell the two apart).
            r["beyond_resident_ms_per_token"] = round(r["tpot_ms"] - resident, 3)
    families = family_ratios(rows, every, path, recall_0_calls)
    report = {**meta, "configs": list(rows.values()), "families": families, **ssd_ratios(rows)}
    if other_cards:
        # Their tokens and raw counters stay in their source files: same_tokens_as above is the tokens' verdict and
        # the per-token figures (hit rates, bytes, prefetch) the counters' digest; kept here they would grow the
        # combined file by about 4 KB a row each call (the tree travels to the GPU, 12 MiB at most).
        report["other_card_configs"] = [{k: v for k, v in r.items() if k not in IN_SOURCE_ONLY} for r in other_cards]
    report["issue15_targets"] = issue15_targets(families, report)
    if tpot.get("bigmoe-102") and tpot.get("offload17") and tpot.get("resident"):
        report["speedup_vs_offload17_at_102"] = round(tpot["offload17"] / tpot["bigmoe-102"], 3)
        report["tpot_vs_resident_at_102"] = round(tpot["bigmoe-102"] / tpot["resident"], 3)
        report["targets"] = {
            "102 slots <= 1.6x resident": report["tpot_vs_resident_at_102"] <= 1.6,
            "102 slots >= 2.5x faster than offload17": report["speedup_vs_offload17_at_102"] >= 2.5,
            "32 slots faster than offload17": bool(tpot.get("bigmoe-32")) and tpot["bigmoe-32"] < tpot["offload17"],
        }
    e2e.write_json(out, report)
    for r in report["configs"]:
        print(
            f"{r.get('family', 'standard'):12s} {r['name']:28s} TPOT {r.get('tpot_ms')} ms  TTFT {r.get('ttft_ms')} ms"
            f"  hit {r.get('decode_hit_rate')}  PCIe GB/token {r.get('pcie_gb_per_token')}"
            f"  SSD GB/token {r.get('ssd_gb_per_token')}  same tokens as: {r.get('same_tokens_as', '-')}"
            f"  {r.get('error', '')}"
        )
    print({k: v for k, v in report.items() if k not in ("configs", "checkpoint", "commands")})
    return 0


def issue15_targets(families: dict[str, dict], report: dict) -> dict:
    """Issue 15's targets, each met (True), missed (False) or not measured (absent)."""
    out = {}
    for family, r in families.items():
        checks = {
            "102 slots <= 1.3x resident at recall 0.8": ("tpot_vs_resident_at_102", lambda v: v <= 1.3),
            "102 slots >= 3x faster than offload17 at recall 0.8": ("speedup_vs_offload17_at_102", lambda v: v >= 3),
            "32 slots >= 2x faster than offload17 at recall 0.8": ("speedup_vs_offload17_at_32", lambda v: v >= 2),
        }
        got = {label: ok(r[key]) for label, (key, ok) in checks.items() if key in r}
        # The two rows side by side where one call ran both; else both over the resident engine where measured
        # (each paired within its own call), else over offload17; a slower row is a larger TPOT over resident, a
        # smaller speedup over offload17.
        at0, plain = r.get("tpot_vs_resident_at_102_recall_0"), r.get("tpot_vs_resident_at_102_no_prefetch")
        if "recall_0_vs_no_prefetch_at_102" in r:
            got["102 slots at recall 0 no slower than without prefetch"] = r["recall_0_vs_no_prefetch_at_102"] <= 1.0
        elif at0 and plain:
            got["102 slots at recall 0 no slower than without prefetch"] = at0 <= plain
        else:
            at0 = r.get("speedup_vs_offload17_at_102_recall_0")
            plain = r.get("speedup_vs_offload17_at_102_no_prefetch")
            if at0 and plain:
                got["102 slots at recall 0 no slower than without prefetch"] = at0 >= plain
        out[family] = got
    for key, label in (("ssd_tpot_vs_needed_disk_floor", "TPOT"), ("ssd_ttft_vs_needed_disk_floor", "TTFT")):
        ratio = (report.get(key) or {}).get("ratio")
        if ratio:
            out.setdefault("ssd", {})[f"32/128/SSD {label} within 1.3x of the disk floor of the bytes needed"] = (
                ratio <= 1.3
            )
    return out
