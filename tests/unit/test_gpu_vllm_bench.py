"""scripts/gpu_vllm_bench.py's configuration names (@rRECALL, ~POLICY), its prediction traces and the per-family
ratios of --combine (the H200 run itself is the lead's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gpu_vllm_bench as bench  # scripts/ is on pytest's pythonpath (pyproject)
import numpy as np
import pytest
from bigmoe_bench import traces


@pytest.mark.parametrize(
    "name,parsed",
    [
        ("bigmoe-102", ("bigmoe-102", None, None)),
        ("bigmoe-102@r0.8", ("bigmoe-102", 0.8, None)),
        ("bigmoe-32@r1~lru", ("bigmoe-32", 1.0, "lru")),
        ("offload17~lfu-fast", ("offload17", None, "lfu-fast")),
        ("bigmoe-32-ram128-ssd@r0.8~lru+ahead", ("bigmoe-32-ram128-ssd", 0.8, "lru")),
    ],
)
def test_names_parse(name, parsed):
    assert bench.parse_name(name) == parsed


@pytest.mark.parametrize(
    "name", ["bigmoe-7", "bigmoe-102~mru", "bigmoe-102@r1.5", "bigmoe-102@rx", "bigmoe-32-ram128-ssd+ahead"]
)
def test_bad_names_are_one_line_and_exit_2(name, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(tmp_path / "o.json"), "--configs", name])
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_a_recall_config_replays_a_trace_with_predictions(tmp_path):
    trace = tmp_path / "topic-shift-trace.npz"
    ids = traces.named_trace("topic-shift", 40, 3, 32, 4)
    traces.save_trace(trace, ids)
    config = bench.config_for("bigmoe-102@r0.8~lru", trace, 32, "topic-shift", 0.5, tmp_path)
    assert config.env["BIGMOE_EVICTION"] == "lru" and config.env["BIGMOE_PAGER"] == "1"
    replay = Path(config.env["BIGMOE_ROUTE_REPLAY"])
    assert replay.name == "topic-shift-r0.8-p0.5-trace.npz"
    assert np.array_equal(traces.load_trace(replay), ids)
    predicted = traces.load_predictions(replay, 32)
    assert predicted.shape[:2] == (40, 3) and (predicted[:, 2] == -1).all()
    assert bench.config_for("bigmoe-102", trace, 32, "topic-shift", 0.5, tmp_path).env["BIGMOE_ROUTE_REPLAY"] == str(
        trace
    )


@pytest.mark.parametrize(
    "name,ahead", [("bigmoe-32-ram128-ssd@r0.8", False), ("bigmoe-32-ram128-ssd@r0.8+ahead", True)]
)
def test_ahead_lets_the_predictions_post_ssd_reads(tmp_path, name, ahead):
    trace = tmp_path / "standard-trace.npz"
    traces.save_trace(trace, traces.named_trace("standard", 40, 3, 32, 4))
    env = bench.config_for(name, trace, 32, "standard", 0.5, tmp_path).env
    assert env.get("BIGMOE_SSD_READ_AHEAD") == ("1" if ahead else None)
    assert traces.load_predictions(Path(env["BIGMOE_ROUTE_REPLAY"]), 32) is not None
    assert env["BIGMOE_RAM_SLOTS"] == "16"  # the SSD tier is there to read ahead from


def test_combine_reports_each_familys_ratios_at_recall_0_8(tmp_path):
    def part(family, rows):
        return {
            "command": "x",
            "checkpoint": {},
            "configs": [{"name": n, "tpot_ms": t, "family": family} for n, t in rows],
        }

    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(
        json.dumps(
            part(
                "standard",
                [
                    ("resident", 4.0),
                    ("offload17", 15.0),
                    ("bigmoe-102", 5.0),
                    ("bigmoe-102@r0.8", 4.8),
                    ("bigmoe-32@r0.8", 6.0),
                ],
            )
        )
    )
    b.write_text(json.dumps(part("topic-shift", [("resident", 4.0), ("offload17", 15.0), ("bigmoe-102@r0.8", 5.0)])))
    out = tmp_path / "c.json"
    assert bench.combine([a, b], out) == 0
    report = json.loads(out.read_text())
    std, shift = report["families"]["standard"], report["families"]["topic-shift"]
    assert std["speedup_vs_offload17_at_102"] == 3.125 and std["tpot_vs_resident_at_102"] == 1.2
    assert std["speedup_vs_offload17_at_32"] == 2.5 and std["speedup_vs_offload17_at_102_no_prefetch"] == 3.0
    assert shift == {"speedup_vs_offload17_at_102": 3.0, "tpot_vs_resident_at_102": 1.25}
    assert report["speedup_vs_offload17_at_102"] == 3.0  # the standard family's, as before


def test_prefetch_figures_come_from_the_decode_counters_of_tiers_prefetched_into():
    plain = {"vram": {"lookups": 100, "hits": 80, "prefetched": 0}, "ram": {"lookups": 20, "hits": 20}}
    assert bench.prefetch_summary(plain, 10) == {}
    decode = {
        "vram": {
            "lookups": 100,
            "hits": 90,
            "prefetched": 40,
            "prefetch_used": 30,
            "prefetch_wasted_bytes": 10 * 3_000_000,
        },
        "ram": {"lookups": 10, "hits": 10, "prefetched": 0},
    }
    assert bench.prefetch_summary(decode, 10) == {
        "prefetch_accuracy_vram": 0.75,  # 30 needs met ahead of 40 that were not resident otherwise (30 + 10 misses)
        "prefetch_wasted_gb_per_token_vram": 0.003,
        "prefetched_per_token_vram": 4.0,
    }
