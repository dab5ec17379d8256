"""bigmoe plan's TPOT estimate against every committed H200 measurement of the 40-layer benchmark (within 25%),
with the hit rates the eviction simulator measured for that run's family, policy and slots. Each vLLM 0.33
configuration counts as the mean over the H200 calls that ran it (`tpot_ms_calls` in prefetch.json): calls of one
SSD configuration ranged from 58 to 97 ms (runs 29 and 32), more than the 25% any one estimate could hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bigmoe.plan import speed as plan_speed
from bigmoe.plan.speed import Speeds, estimate, family_hit
from bigmoe_pager.settings import PagerSettings

DEFAULT_EVICTION = PagerSettings().eviction  # the curves bigmoe plan reads are the default policy's

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
H200 = Speeds(
    pcie_gbps=55.2, disk_gbps=1.55, memory_gbps=4800 * plan_speed.DECODE_EFFICIENCY, measured=(), assumptions=()
)
"""The H200 machine: pinned H2D 55.2 GB/s and 1.55 GB/s O_DIRECT with 4 workers, both measured there
(docs/benchmarks.md, docs/bench/ssd.json); HBM from the data sheet."""


def bench_shape() -> dict:
    """The 40-layer Qwen3.6-shaped FP8 checkpoint of scripts/gpu_vllm_bench.py, in bytes one token reads."""
    c = json.loads((BENCH / "vllm-gpu.json").read_text())["checkpoint"]
    h, inter, layers = c["hidden"], c["moe_intermediate"], c["layers"]
    record = 3 * h * inter + 3 * (h // 128) * (inter // 128) * 4  # FP8 weights + fp32 128x128 block scales
    attention = h * c["heads"] * c["head_dim"] * 2 + h * c["kv_heads"] * c["head_dim"] * 2  # q, o + k, v (FP8)
    dense = layers * (attention + c["experts"] * h * 2) + c["vocab"] * h * 2  # + bf16 router per layer, bf16 head
    return {
        "layers": layers,
        "experts": c["experts"],
        "top_k": c["top_k"],
        "record_bytes": record,
        "resident_bytes": dense + layers * c["top_k"] * record,
    }


def measured_runs() -> list[tuple[str, str, dict]]:
    """(family, eviction, run) for every measured bigmoe/resident run of the 40-layer benchmark."""
    standard = json.loads((BENCH / "vllm-gpu.json").read_text())["configs"]
    shifted = json.loads((BENCH / "topic-shift-h200.json").read_text())["configs"]
    runs = []
    for c in standard:
        if c["name"] == "resident" or c["name"].startswith("bigmoe") and c.get("tpot_ms"):
            env = c["env"]
            run = {
                "name": c["name"],
                "tpot_ms": c["tpot_ms"],
                "vram_slots": int(env.get("BIGMOE_VRAM_SLOTS", 256)),
                "ram_slots": int(env.get("BIGMOE_RAM_SLOTS", 256)),
            }
            runs.append(("standard", env.get("BIGMOE_EVICTION", "lfu"), run))
    for c in shifted:
        if c["name"] == "resident" or c["name"].startswith("bigmoe"):
            run = {
                "name": c["name"],
                "tpot_ms": c["tpot_ms"],
                "vram_slots": c.get("vram_slots", 256),
                "ram_slots": c.get("ram_slots", 256),
            }
            runs.append(("topic-shift", c.get("eviction", "lfu"), run))
    for c in json.loads((BENCH / "prefetch.json").read_text())["configs"]:  # vLLM 0.33, without prefetch
        if c.get("tpot_ms") and c.get("recall") is None and (c["name"] == "resident" or c["name"].startswith("bigmoe")):
            env = c["env"]
            calls = list((c.get("tpot_ms_calls") or {c["source"]: c["tpot_ms"]}).values())
            run = {
                "name": f"{c['name']} (vLLM 0.33)",
                "tpot_ms": sum(calls) / len(calls),  # the configuration's mean over the H200 calls that ran it
                "vram_slots": int(env.get("BIGMOE_VRAM_SLOTS", 256)),
                "ram_slots": int(env.get("BIGMOE_RAM_SLOTS", 256)),
            }
            runs.append((c["family"], env.get("BIGMOE_EVICTION") or default_eviction(c["source"]), run))
    return runs


def default_eviction(source: str) -> str:
    """The plugin's default eviction when the combined row's file (`source`, e.g. run10-bench-b.json) was measured; rows
    name their policy in env since run 11's calls (gpu_vllm_bench.config_for), not before."""
    run = int(source.removeprefix("run").split("-")[0])
    return "lfu-fast" if run <= 10 else "lfu-duel"  # lfu-duel became the default after run 10 (session 13)


def simulated_hits(family: str, policy: str, vram: int, ram: int) -> tuple[float, float]:
    """(VRAM hit, VRAM-or-RAM hit) of docs/bench/eviction.json (lfu-duel: eviction-duel.json) for the 256-expert
    top-8 shape."""
    if vram >= 256:
        return 1.0, 1.0
    rows = json.loads((BENCH / ("eviction-duel.json" if policy == "lfu-duel" else "eviction.json")).read_text())
    rows = rows["results"]
    row = next(
        r
        for r in rows
        if r["family"] == family and r["experts"] == 256 and r["vram_slots"] == vram and r["ram_slots"] == ram
    )
    return row[policy]["vram_hit"], row[policy]["ram_hit"]


@pytest.mark.parametrize("family,policy,run", measured_runs(), ids=lambda v: v["name"] if isinstance(v, dict) else v)
def test_estimate_is_within_a_quarter_of_each_h200_measurement(family, policy, run):
    shape = bench_shape()
    hits = simulated_hits(family, policy, run["vram_slots"], run["ram_slots"])
    got = estimate(
        H200,
        "cuda",
        layers=shape["layers"],
        experts=shape["experts"],
        top_k=shape["top_k"],
        resident_bytes=shape["resident_bytes"],
        record_bytes=shape["record_bytes"],
        ssd_record_bytes=shape["record_bytes"],
        vram_slots=run["vram_slots"],
        ram_slots=run["ram_slots"],
        hits=(hits, hits),
    )
    assert got.tpot_ms[0] == got.tpot_ms[1]
    assert got.tpot_ms[0] == pytest.approx(run["tpot_ms"], rel=0.25), (run["name"], hits, got)


def test_every_measured_configuration_is_checked():
    names = {(f, r["name"]) for f, _, r in measured_runs()}
    for family in ("standard", "topic-shift"):
        assert (family, "resident") in names
    assert {("standard", n) for n in ("bigmoe-102", "bigmoe-32", "bigmoe-32-ram128-ssd-layerbuf")} <= names
    assert {("topic-shift", n) for n in ("bigmoe-102", "bigmoe-32", "bigmoe-32-ram128-ssd")} <= names
    on_033 = {
        (f, n) for f in ("standard", "topic-shift") for n in ("resident", "bigmoe-102-layerbuf", "bigmoe-32-layerbuf")
    }
    on_033.add(("standard", "bigmoe-32-ram128-ssd-layerbuf"))
    assert {(f, f"{n} (vLLM 0.33)") for f, n in on_033} <= names


def test_hit_curves_are_the_simulators():
    curves = json.loads((BENCH / "eviction.json").read_text())["curves_256x8"]
    for family, points in plan_speed.HIT_CURVES.items():
        assert [list(p) for p in points] == curves[family][DEFAULT_EVICTION]


@pytest.mark.parametrize("family", plan_speed.HIT_FAMILIES)
def test_family_hit_grows_with_slots_and_ends_at_one(family):
    rates = [family_hit(family, s, 512, 10) for s in (0, 5, 10, 35, 100, 218, 400, 511, 512)]
    assert rates == sorted(rates) and rates[0] == 0.0 and rates[-1] == 1.0


def test_compressed_records_trade_disk_time_for_cpu_expansion():
    """Fewer SSD bytes, each read record expanded on the CPU: the estimate counts both, and nothing when RAM holds
    every expert."""
    from bigmoe.plan.speed import EXPAND_GBPS, EXPAND_THREADS

    shape = bench_shape()
    kw = dict(
        layers=shape["layers"],
        experts=shape["experts"],
        top_k=shape["top_k"],
        resident_bytes=shape["resident_bytes"],
        record_bytes=shape["record_bytes"],
        vram_slots=32,
    )
    small = int(0.85 * shape["record_bytes"])
    raw = estimate(H200, "cuda", ssd_record_bytes=shape["record_bytes"], ram_slots=128, hits=((0.8, 0.9),) * 2, **kw)
    packed = estimate(
        H200, "cuda", ssd_record_bytes=small, compressed=True, ram_slots=128, hits=((0.8, 0.9),) * 2, **kw
    )
    misses = shape["layers"] * shape["top_k"] * (1 - 0.9)
    disk_saved = misses * (shape["record_bytes"] - small) / (H200.disk_gbps * 1e9) * 1e3
    expand = misses * shape["record_bytes"] / (EXPAND_GBPS * EXPAND_THREADS * 1e9) * 1e3  # H200 names no rate
    assert packed.ssd_mib_per_token[0] < raw.ssd_mib_per_token[0]
    assert packed.tpot_ms[0] == pytest.approx(raw.tpot_ms[0] - disk_saved + expand, abs=0.02)
    everything = shape["experts"]
    assert estimate(H200, "cuda", ssd_record_bytes=small, compressed=True, ram_slots=everything, **kw) == estimate(
        H200, "cuda", ssd_record_bytes=shape["record_bytes"], ram_slots=everything, **kw
    )


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 2), (16, 4), (None, 4)])
def test_records_are_expanded_by_at_most_one_thread_a_core(cores, threads):
    """The SSD tier's four reader threads expand records at once only on a machine of four cores or more: fewer
    cores make compressed records dearer, in the estimate and in the SSD source's price alike."""
    from bigmoe.plan.speed import EXPAND_GBPS, expand_threads, speeds_for, ssd_ms_per_gb

    assert expand_threads(cores) == threads
    speeds = speeds_for(None, None, compressed=True, cores=cores)
    assert speeds.expand_threads == threads
    assert any(f"by {threads} reader threads" in line for line in speeds.assumptions)
    per_gb = ssd_ms_per_gb(1.0, 0.85, EXPAND_GBPS, threads)
    assert per_gb == pytest.approx(850 + 1000 / (EXPAND_GBPS * threads))
