"""The bench's configuration names (@r[RECALL], ~POLICY, +ahead: scripts/bench_names.py), the measurements one engine
makes (every family, every recall), its prediction traces (scripts/gpu_vllm_bench.py), the rows of an engine's run and
their SSD floors (scripts/bench_rows.py), and the per-family ratios of --combine (scripts/bench_combine.py; the H200
run itself is the lead's)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_combine  # scripts/ is on pytest's pythonpath (pyproject)
import bench_names
import bench_rows
import gpu_vllm_bench as bench
import numpy as np
import pytest
from bigmoe_bench import traces
from bigmoe_pager.core.slots import MIN_USED_PERCENT, PREFETCH_BUDGET
from bigmoe_pager.settings import PagerSettings

DEFAULT_EVICTION = PagerSettings().eviction


@pytest.mark.parametrize(
    "name,parsed",
    [
        ("bigmoe-102", ("bigmoe-102", None, None)),
        ("bigmoe-102@r0.8", ("bigmoe-102", 0.8, None)),
        ("bigmoe-102@r", ("bigmoe-102", bench_names.EVERY, None)),
        ("bigmoe-32@r1~lru", ("bigmoe-32", 1.0, "lru")),
        ("offload17~lfu-fast", ("offload17", None, "lfu-fast")),
        ("bigmoe-32-ram128-ssd@r0.8~lfu-duel+ahead", ("bigmoe-32-ram128-ssd", 0.8, "lfu-duel")),
        ("bigmoe-32-ram128-ssd@r0.8~lru+ahead", ("bigmoe-32-ram128-ssd", 0.8, "lru")),
        ("bigmoe-32-ram128-ssd@r+ahead", ("bigmoe-32-ram128-ssd", bench_names.EVERY, None)),
        ("bigmoe-102-layerbuf@r+hi", ("bigmoe-102-layerbuf", bench_names.EVERY, None)),
        ("bigmoe-32-ram128-ssd@r0.8~lru+hi+ahead", ("bigmoe-32-ram128-ssd", 0.8, "lru")),
        ("bigmoe-32-ram128-ssd-layerbuf@r0.8+ahead4", ("bigmoe-32-ram128-ssd-layerbuf", 0.8, None)),
        ("bigmoe-102-layerbuf#2", ("bigmoe-102-layerbuf", None, None)),
        ("bigmoe-102-layerbuf@r0.8+b1+gate0", ("bigmoe-102-layerbuf", 0.8, None)),
        ("bigmoe-102-layerbuf@r~lru+gate50#12", ("bigmoe-102-layerbuf", bench_names.EVERY, "lru")),
        ("bigmoe-102-layerbuf@r0.8+b1+gate25", ("bigmoe-102-layerbuf", 0.8, None)),
        ("bigmoe-102-layerbuf@r+gate100+b12+hi", ("bigmoe-102-layerbuf", bench_names.EVERY, None)),
    ],
)
def test_names_parse(name, parsed):
    assert bench_names.parse_name(name) == parsed


def test_a_second_engine_of_one_configuration_runs_it_alike_under_its_own_rows(tmp_path):
    one, two = (
        bench.config_for(n, tmp_path / "f.npz", 32) for n in ("bigmoe-32@r~lru+gate50", "bigmoe-32@r~lru+gate50#2")
    )
    assert one.env == two.env and one.name != two.name
    assert (
        bench_names.row_name("bigmoe-32@r~lru+gate50#2", bench_names.Point(0.8, "popular"))
        == "bigmoe-32@r0.8:popular~lru+gate50#2"
    )
    assert bench_names.recalls_of("bigmoe-32@r#2", [bench_names.Point(0.0), bench_names.Point(1.0)]) == [
        bench_names.Point(0.0),
        bench_names.Point(1.0),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "bigmoe-7"],
        ["--configs", "bigmoe-102~mru"],
        ["--configs", "bigmoe-102@r1.5"],
        ["--configs", "bigmoe-102@rx"],
        ["--configs", "bigmoe-32-ram128-ssd+ahead"],
        ["--configs", "bigmoe-102+hi"],
        ["--configs", "bigmoe-102+b1"],
        ["--configs", "bigmoe-102@r0.8+gate101"],
        ["--configs", "bigmoe-102@r0.8+gate"],
        ["--configs", "bigmoe-102#two"],
        ["--families", "standard,zigzag"],
        ["--families", "standard", "--family", "topic-shift"],
        ["--recalls", "0,1.2"],
        ["--recalls", "0,high"],
        ["--recalls", "0,0.8:often"],
        ["--parallel", "0"],
        [
            "--configs",
            "bigmoe-102-layerbuf@r+one-node+host+chained-only",
            "--recalls",
            "0,0.8",
            "--profile-tokens",
            "4",
        ],
        ["--configs", "bigmoe-102@r0.8+one-node+host", "--profile-tokens", "4"],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(tmp_path / "o.json"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error:" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "configs,recalls",
    [
        ("bigmoe-102-layerbuf@r+one-node+host+chained-only", "0"),
        ("bigmoe-102@r0.8+one-node", "0.8"),
        ("resident", "0.8"),
    ],
)
def test_profiling_is_taken_where_no_host_copied_round_prefetches(configs, recalls, tmp_path):
    """Runs 36-37 stalled host-copied rounds after torch.profiler; at recall 0 they copy nothing, and a path without
    the host copier profiles as before."""
    argv = ["--out", str(tmp_path / "o.json"), "--configs", configs, "--recalls", recalls, "--profile-tokens", "4"]
    assert bench.parse_args(argv).profile_tokens == 4


@pytest.mark.parametrize(
    "argv,families,recalls",
    [
        ([], ["standard"], [(0.0, "uniform"), (0.6, "uniform"), (0.8, "uniform"), (0.95, "uniform"), (1.0, "uniform")]),
        (["--family", "topic-shift", "--recalls", "0,1"], ["topic-shift"], [(0.0, "uniform"), (1.0, "uniform")]),
        (
            ["--families", "standard,topic-shift", "--recalls", "0,0:none,0.8:popular", "--wrong", "popular"],
            ["standard", "topic-shift"],
            [(0.0, "popular"), (0.0, "none"), (0.8, "popular")],
        ),
    ],
)
def test_family_and_recall_lists(argv, families, recalls, tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "o.json"), *argv])
    assert args.families == families and args.recalls == recalls and args.precision is None


@pytest.mark.parametrize(
    "name,rows",
    [
        ("resident", [("resident", "standard", None), ("resident", "topic-shift", None)]),
        ("bigmoe-102@r0.8", [("bigmoe-102@r0.8", "standard", 0.8), ("bigmoe-102@r0.8", "topic-shift", 0.8)]),
        (
            "bigmoe-102@r~lru",
            [
                ("bigmoe-102@r0~lru", "standard", 0.0),
                ("bigmoe-102@r0.8~lru", "standard", 0.8),
                ("bigmoe-102@r0~lru", "topic-shift", 0.0),
                ("bigmoe-102@r0.8~lru", "topic-shift", 0.8),
            ],
        ),
        (
            "bigmoe-32-ram128-ssd@r0.8+ahead",
            [
                ("bigmoe-32-ram128-ssd@r0.8+ahead", "standard", 0.8),
                ("bigmoe-32-ram128-ssd@r0.8+ahead", "topic-shift", 0.8),
            ],
        ),
    ],
)
def test_one_engine_measures_every_family_and_recall_in_turn(name, rows):
    points = [bench_names.Point(0.0), bench_names.Point(0.8)]
    traces_of = {(f, p): Path(f"{f}-{p}") for f in ("standard", "topic-shift") for p in (None, *points)}
    todo = bench.measurements(name, ["standard", "topic-shift"], points, traces_of)
    named = [
        (bench_names.row_name(name, m["recall"] is not None and bench_names.Point(m["recall"], m["wrong"]) or None), m)
        for m in todo
    ]
    assert [(n, m["family"], m["recall"]) for n, m in named] == rows
    assert [m["trace"] for m in todo] == [
        str(traces_of[f, r if r is None else bench_names.Point(r)]) for _, f, r in rows
    ]


def test_points_with_other_wrong_ids_are_measured_by_the_same_engine_and_named_apart():
    points = bench_names.parse_points("0,0:none,0.8,0.8:popular", "uniform")
    traces_of = {("standard", p): Path(f"standard-{p.recall}-{p.wrong}") for p in points}
    todo = bench.measurements("bigmoe-102@r", ["standard"], points, traces_of)
    assert [(m["recall"], m["wrong"]) for m in todo] == [
        (0.0, "uniform"),
        (0.0, "none"),
        (0.8, "uniform"),
        (0.8, "popular"),
    ]
    assert len({m["trace"] for m in todo}) == 4
    names = [bench_names.row_name("bigmoe-102@r~lru", bench_names.Point(m["recall"], m["wrong"])) for m in todo]
    assert names == [
        "bigmoe-102@r0~lru",
        "bigmoe-102@r0:none~lru",
        "bigmoe-102@r0.8~lru",
        "bigmoe-102@r0.8:popular~lru",
    ]
    rows = bench_rows.engine_rows({"name": "bigmoe-102@r", "result": {"measurements": []}}, todo, None)
    assert [r["name"] for r in rows] == [
        "bigmoe-102@r0",
        "bigmoe-102@r0:none",
        "bigmoe-102@r0.8",
        "bigmoe-102@r0.8:popular",
    ]
    assert [r["wrong_ids"] for r in rows] == ["uniform", "none", "uniform", "popular"]


@pytest.fixture
def small(monkeypatch):
    """A 3-layer, 32-expert top-4 model and 64-row replayed traces."""
    monkeypatch.setattr(bench, "SHAPE", {**bench.SHAPE, "experts": 32, "top_k": 4})
    monkeypatch.setattr(bench, "LAYERS", 3)
    monkeypatch.setattr(bench, "REPLAY_TOKENS", 64)


def test_prediction_traces_have_one_shape_at_every_recall_and_the_family_trace_rows(small, tmp_path):
    plain = traces.load_trace(bench.family_trace(tmp_path, "topic-shift"))
    assert plain.shape == (64, 3, 4)
    assert np.array_equal(plain, traces.load_trace(tmp_path / "topic-shift-trace.npz")[:64])
    shapes = set()
    for recall in (0.0, 0.6, 1.0):
        path = bench.predicted_trace(tmp_path, "topic-shift", recall, None)
        assert path.name == f"topic-shift-64-r{recall:g}-topk-trace.npz"
        assert np.array_equal(traces.load_trace(path), plain)
        shapes.add(traces.load_predictions(path, 32).shape)
    assert shapes == {(64, 3, 4)}  # a top-k proposal: k ids per row at every recall, so traces swap in place
    popular = bench.predicted_trace(tmp_path, "topic-shift", 0.6, None, "popular")
    assert popular.name == "topic-shift-64-r0.6-topk-popular-trace.npz"  # beside the uniform one, never mistaken
    assert traces.load_predictions(popular, 32).shape == (64, 3, 4)
    assert not np.array_equal(
        traces.load_predictions(popular, 32),
        traces.load_predictions(path.with_name("topic-shift-64-r0.6-topk-trace.npz"), 32),
    )


@pytest.mark.parametrize("policy", bench_names.EVICTIONS)
def test_every_policy_suffix_sets_an_eviction_the_engine_takes(policy, tmp_path):
    name = f"bigmoe-32@r0.8~{policy}"
    assert bench_names.row_name(f"bigmoe-32@r~{policy}", bench_names.Point(0.8)) == name
    env = bench.config_for(name, tmp_path / "f.npz", 32).env
    assert PagerSettings.from_env({"BIGMOE_EVICTION": env["BIGMOE_EVICTION"]}).eviction == policy


def test_a_configuration_starts_on_its_first_trace_with_its_suffixes(tmp_path):
    assert tuple(bench.configs(tmp_path / "first.npz", 32)) == bench_names.BASES  # every name parse_name knows runs
    env = bench.config_for("bigmoe-32-ram128-ssd@r~lru+ahead", tmp_path / "first.npz", 32).env
    assert env["BIGMOE_ROUTE_REPLAY"] == str(tmp_path / "first.npz") and env["BIGMOE_EVICTION"] == "lru"
    assert env["BIGMOE_SSD_READ_AHEAD"] == "1" and env["BIGMOE_RAM_SLOTS"] == "16"
    assert "BIGMOE_SSD_READ_AHEAD" not in bench.config_for("bigmoe-102@r0.8", tmp_path / "f.npz", 32).env
    high = bench.config_for("bigmoe-102@r0.8+hi", tmp_path / "f.npz", 32).env
    assert high["BIGMOE_PREFETCH_HIGH_PRIORITY"] == "1" and "BIGMOE_SSD_READ_AHEAD" not in high
    assert "BIGMOE_PREFETCH_HIGH_PRIORITY" not in env and "BIGMOE_SSD_READ_AHEAD_LAYERS" not in env
    for gone in ("+one", "+edges", "+poll-once", "+bare", "+nowait", "+instep", "+idle16"):  # removed (session 35)
        with pytest.raises(ValueError):
            bench_names.parse_name(f"bigmoe-102@r0+one-node+host{gone}")
    node = PagerSettings.from_env(bench.config_for("bigmoe-102@r0.8+one-node", tmp_path / "f.npz", 32).env)
    assert node.prefetch_one_node is True and node.prefetch_one_node_programs == 0
    narrow = PagerSettings.from_env(bench.config_for("bigmoe-102@r0+one-node+nodes4", tmp_path / "f.npz", 32).env)
    assert narrow.prefetch_one_node is True and narrow.prefetch_one_node_programs == 4
    gate = bench.config_for("bigmoe-102@r0.8+gate50", tmp_path / "f.npz", 32).env
    assert gate["BIGMOE_PREFETCH_MIN_USED_PERCENT"] == "50"
    deep = bench.config_for("bigmoe-32-ram128-ssd@r0.8+ahead4", tmp_path / "f.npz", 32).env
    assert deep["BIGMOE_SSD_READ_AHEAD"] == "1" and deep["BIGMOE_SSD_READ_AHEAD_LAYERS"] == "4"
    budget = bench.config_for("bigmoe-102@r0.8+b2+gate0", tmp_path / "f.npz", 32).env
    assert budget["BIGMOE_PREFETCH_BUDGET"] == "2" and budget["BIGMOE_PREFETCH_MIN_USED_PERCENT"] == "0"
    assert PagerSettings.from_env(budget).prefetch_budget == 2
    far = PagerSettings.from_env(bench.config_for("bigmoe-102@r0.8+host+dist2", tmp_path / "f.npz", 32).env)
    assert far.prefetch_distance == 2 and far.prefetch_host_copier is True
    cold = PagerSettings.from_env(bench.config_for("bigmoe-102@r0+one-node+host+hot0", tmp_path / "f.npz", 32).env)
    assert cold.host_copier_hot_ms == 0 and PagerSettings.from_env({}).host_copier_hot_ms is None
    only = bench.config_for("bigmoe-102@r0+one-node+host+chained-only#2", tmp_path / "f.npz", 32).env
    assert PagerSettings.from_env(only).prefetch_chained_only
    switched = bench.config_for("bigmoe-32-ram128-ssd-layerbuf+switch200", tmp_path / "f.npz", 32).env
    assert PagerSettings.from_env(switched).gil_switch_us == 200  # no @r needed: an engine setting
    native = bench.config_for("bigmoe-32-ram128-ssd-layerbuf+creader", tmp_path / "f.npz", 32).env
    assert PagerSettings.from_env(native).ssd_reader == "native"  # no @r needed either
    assert PagerSettings.from_env(switched).ssd_reader == "python"
    with pytest.raises(ValueError):  # a prefetch suffix still needs @r, beside an engine suffix too
        bench_names.parse_name("bigmoe-102+creader+host")
    every = bench.config_for("bigmoe-102@r0+one-node+host+every-forward", tmp_path / "f.npz", 32).env
    assert PagerSettings.from_env(every).prefetch_chained_only is False
    assert PagerSettings.from_env({}).prefetch_chained_only is None


def test_a_prefetching_engine_names_the_gate_and_budget_it_ran_even_the_defaults(tmp_path):
    plain = bench.config_for("bigmoe-102@r0.8", tmp_path / "f.npz", 32).env
    settings = PagerSettings.from_env(plain)
    assert (
        settings.prefetch_budget == PREFETCH_BUDGET
        and bench_names.default_prefetch_suffix() == f"+b{PREFETCH_BUDGET}+gate{MIN_USED_PERCENT}"
    )
    assert settings.prefetch_min_used_percent == int(plain["BIGMOE_PREFETCH_MIN_USED_PERCENT"])
    assert "BIGMOE_PREFETCH_BUDGET" not in bench.config_for("bigmoe-102", tmp_path / "f.npz", 32).env
    assert bench.config_for("bigmoe-102@r0.8+b0+gate25", tmp_path / "f.npz", 32).env["BIGMOE_PREFETCH_BUDGET"] == "0"


def measurement(family, recall, tpot, ssd=None):
    counters = {"ram": {"lookups": 10, "hits": 8, "bytes_moved": 0}}
    timed = {"ssd": {"bytes_moved": int(ssd * 1e9 * 3 + 2e9)}} if ssd else {}
    return {
        "family": family,
        "recall": recall,
        "tpot_ms": tpot,
        "ttft_ms": 100.0,
        "decode_counters": counters,
        "decode_tokens": 4,
        "timed_counters": timed,
        "ssd_gb_per_token": ssd,
        "tokens": [1, 2, 3, 4],
    }


def test_an_engines_run_is_one_row_per_family_and_recall_and_a_failed_one_says_why_in_each():
    todo = [{"family": f, "recall": r, "trace": "t"} for f in ("standard", "topic-shift") for r in (0.0, 0.8)]
    done = [measurement(t["family"], t["recall"], 5.0) for t in todo]
    joins = ["the next layer's MoE call (a whole-forward capture)"]
    result = {"startup_s": 90.0, "turn_wait_s": 12.5, "measurements": done, "prefetch_joins": joins}
    result.update(load_copy_bytes=3 << 30, load_copy_s=1.5)
    rows = bench_rows.engine_rows({"name": "bigmoe-102@r", "env": {}, "seconds": 200.0, "result": result}, todo, None)
    assert [(r["name"], r["family"]) for r in rows] == [
        ("bigmoe-102@r0", "standard"),
        ("bigmoe-102@r0.8", "standard"),
        ("bigmoe-102@r0", "topic-shift"),
        ("bigmoe-102@r0.8", "topic-shift"),
    ]
    assert all(r["tpot_ms"] == 5.0 and r["turn_wait_s"] == 12.5 and r["configuration"] == "bigmoe-102@r" for r in rows)
    assert all(r["prefetch_joins"] == joins for r in rows)
    assert all((r["load_copy_bytes"], r["load_copy_s"]) == (3 << 30, 1.5) for r in rows)
    failed = bench_rows.engine_rows({"name": "bigmoe-102@r", "env": {}, "error": "exit 1: CUDA OOM"}, todo, None)
    assert len(failed) == 4 and all(r["error"] == "exit 1: CUDA OOM" and "tpot_ms" not in r for r in failed)


def test_a_point_named_twice_is_measured_twice_under_its_own_rows():
    """RECALLS=0.8,1,0.8: the engine measures 0.8, 1, then 0.8 again (its drift within one engine)."""
    todo = [{"family": "standard", "recall": r, "trace": "t"} for r in (0.8, 1.0, 0.8)]
    done = [measurement("standard", r, tpot) for r, tpot in ((0.8, 5.0), (1.0, 4.0), (0.8, 5.5))]
    rows = bench_rows.engine_rows({"name": "bigmoe-102@r", "env": {}, "result": {"measurements": done}}, todo, None)
    assert [(r["name"], r["tpot_ms"]) for r in rows] == [
        ("bigmoe-102@r0.8", 5.0),
        ("bigmoe-102@r1", 4.0),
        ("bigmoe-102@r0.8/2", 5.5),
    ]
    short = bench_rows.engine_rows(
        {"name": "bigmoe-102@r", "env": {}, "result": {"measurements": done[:2]}}, todo, None
    )
    assert "error" in short[2] and "tpot_ms" not in short[2]


def test_ssd_floors_are_the_disk_time_of_the_bytes_read():
    m = {**measurement("standard", 0.8, 20.0, ssd=0.1), "ttft_ms": 1000.0}
    floors = bench_rows.disk_floors(m, {"gb_per_s": 5.0})
    # decode: 0.1 GB / 5 GB/s = 20 ms; prefill: 0.3 + 2 GB timed less 3 decode tokens' 0.3 GB = 2 GB -> 400 ms
    assert floors == {
        "disk_floor_tpot_ms": 20.0,
        "tpot_vs_disk_floor": 1.0,
        "disk_floor_ttft_ms": 400.0,
        "ttft_vs_disk_floor": 2.5,
    }
    assert bench_rows.disk_floors(m, {"error": "no O_DIRECT"}) == {}
    assert bench_rows.disk_floors(measurement("standard", 0.8, 20.0), {"gb_per_s": 5.0}) == {}


def test_combine_reports_each_familys_ratios_and_the_ssd_floor(tmp_path):
    def part(family, rows, disk=None):
        return {
            "command": "x",
            "checkpoint": {},
            "disk": disk,
            "configs": [{"name": n, "tpot_ms": t, "family": family, **extra} for n, t, extra in rows],
        }

    def ssd_row(ttft_ms, gb_per_token, floor_tpot_ms, floor_ttft_ms):
        return {
            "ttft_ms": ttft_ms,
            "ssd_gb_per_token": gb_per_token,
            "disk_floor_tpot_ms": floor_tpot_ms,
            "disk_floor_ttft_ms": floor_ttft_ms,
            "ttft_vs_disk_floor": round(ttft_ms / floor_ttft_ms, 3),
        }

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    current = {"BIGMOE_EVICTION": DEFAULT_EVICTION, **bench_names.prefetch_defaults()}
    standard = [
        ("resident", 4.0, {}),
        ("offload17", 15.0, {}),
        ("bigmoe-102", 5.0, {}),
        ("bigmoe-102@r0", 5.2, {}),
        ("bigmoe-102@r0.8", 4.9, {}),
        (f"bigmoe-102-layerbuf@r0.8{bench_names.default_prefetch_suffix()}", 5.0, {}),
        ("bigmoe-102-layerbuf@r0.8", 4.8, {"env": current}),  # a later engine's plain name wins
        ("bigmoe-32@r0.8", 6.0, {}),
        (f"bigmoe-32-layerbuf~{DEFAULT_EVICTION}", 7.5, {"env": {"BIGMOE_EVICTION": DEFAULT_EVICTION}}),
        ("bigmoe-32-layerbuf", 6.0, {"env": {"BIGMOE_EVICTION": DEFAULT_EVICTION}}),  # both named it: the later wins
        # reads ahead: 3x the plain pager's SSD bytes a token at 6 GB/s, so 1.2x its own floor and 3.6x the needed
        ("bigmoe-32-ram128-ssd@r0.8+ahead", 30.0, ssd_row(2000.0, 0.15, 25.0, 1500.0)),
        ("bigmoe-32-ram128-ssd", 60.0, ssd_row(2000.0, 0.05, 10.0, 2000.0)),  # 5 GB/s; prefill 10 GB against 9
    ]
    for _, tpot, extra in standard:  # each SSD row's TPOT over its own floor, as bench_rows.disk_floors gives it
        if "disk_floor_tpot_ms" in extra:
            extra["tpot_vs_disk_floor"] = round(tpot / extra["disk_floor_tpot_ms"], 3)
    a.write_text(json.dumps(part("standard", standard, {"gb_per_s": 6.0})))
    b.write_text(
        json.dumps(
            part(
                "topic-shift",  # the plugin's default prefill buffer: its rows stand for the slot count
                [
                    ("resident", 4.0, {}),
                    ("offload17", 15.0, {}),
                    ("bigmoe-102-layerbuf@r0.8", 5.6, {}),
                    (f"bigmoe-102-layerbuf@r0.8{bench_names.default_prefetch_suffix()}", 5.0, {}),  # ran the defaults
                    ("bigmoe-32-layerbuf", 7.5, {}),
                    (f"bigmoe-32-layerbuf~{DEFAULT_EVICTION}", 6.0, {}),  # the default policy's row wins
                    ("bigmoe-102-layerbuf", 5.2, {"env": {"BIGMOE_EVICTION": "lru"}}),  # not today's default
                    (f"bigmoe-102-layerbuf~{DEFAULT_EVICTION}", 5.4, {}),
                ],
            )
        )
    )
    assert bench_combine.combine([a, b], out) == 0
    report = json.loads(out.read_text())
    std, shift = report["families"]["standard"], report["families"]["topic-shift"]
    assert std["speedup_vs_offload17_at_102"] == 3.125 and std["tpot_vs_resident_at_102"] == 1.2
    assert std["speedup_vs_offload17_at_32"] == 2.5 and std["speedup_vs_offload17_at_102_no_prefetch"] == 3.0
    assert std["tpot_vs_resident_at_102_recall_0"] == 1.3
    assert std["rows"]["102"] == "bigmoe-102-layerbuf@r0.8" and std["rows"]["32_no_prefetch"] == "bigmoe-32-layerbuf"
    assert std["speedup_vs_offload17_at_32_no_prefetch"] == 2.5
    assert set(shift.pop("sources")) == {k for k, v in shift.items() if isinstance(v, float)}
    assert shift == {
        "speedup_vs_offload17_at_102": 3.0,
        "tpot_vs_resident_at_102": 1.25,
        "speedup_vs_offload17_at_32_no_prefetch": 2.5,
        "speedup_vs_offload17_at_102_no_prefetch": 2.778,
        "tpot_vs_resident_at_102_no_prefetch": 1.35,
        "rows": {
            "102": f"bigmoe-102-layerbuf@r0.8{bench_names.default_prefetch_suffix()}",
            "32_no_prefetch": f"bigmoe-32-layerbuf~{DEFAULT_EVICTION}",
            "102_no_prefetch": f"bigmoe-102-layerbuf~{DEFAULT_EVICTION}",
        },
    }
    assert report["ssd_tpot_vs_disk_floor"] == 1.2 and report["ssd_ttft_vs_disk_floor"] == 1.333
    assert report["ssd_floor_row"] == {"family": "standard", "name": "bigmoe-32-ram128-ssd@r0.8+ahead"}
    # the needed floor: the fewest bytes either row read (0.05 GB a token, 9 GB of prefill), at each row's GB/s
    assert report["ssd_needed_floor"] == {
        "family": "standard",
        "gb_per_token": 0.05,
        "prefill_gb": 9.0,
        "rows": {
            "bigmoe-32-ram128-ssd@r0.8+ahead": {"tpot_vs_needed_disk_floor": 3.6, "ttft_vs_needed_disk_floor": 1.333},
            "bigmoe-32-ram128-ssd": {"tpot_vs_needed_disk_floor": 6.0, "ttft_vs_needed_disk_floor": 1.111},
        },
    }
    assert report["ssd_tpot_vs_needed_disk_floor"] == {"ratio": 3.6, "row": "bigmoe-32-ram128-ssd@r0.8+ahead"}
    assert report["ssd_ttft_vs_needed_disk_floor"] == {"ratio": 1.111, "row": "bigmoe-32-ram128-ssd"}
    assert report["disk"] == {"gb_per_s": 6.0}
    targets = report["issue15_targets"]
    assert targets["standard"]["102 slots >= 3x faster than offload17 at recall 0.8"] is True
    assert targets["topic-shift"]["102 slots <= 1.3x resident at recall 0.8"] is True
    assert targets["standard"]["102 slots at recall 0 no slower than without prefetch"] is False
    assert targets["ssd"] == {  # 1.2x its own floor is not a met target: its wasted reads raised that floor
        "32/128/SSD TPOT within 1.3x of the disk floor of the bytes needed": False,
        "32/128/SSD TTFT within 1.3x of the disk floor of the bytes needed": True,
    }
    assert report["speedup_vs_offload17_at_102"] == 3.0  # the standard family's, as before
    beyond = {(r["family"], r["name"]): r.get("beyond_resident_ms_per_token") for r in report["configs"]}
    assert beyond["standard", "bigmoe-102@r0.8"] == 0.9 and beyond["topic-shift", "bigmoe-102-layerbuf@r0.8"] == 1.6
    assert beyond["standard", "resident"] is None  # the reference itself


def test_prefetch_figures_come_from_the_decode_counters_of_tiers_prefetched_into():
    plain = {"vram": {"lookups": 100, "hits": 80, "prefetched": 0}, "ram": {"lookups": 20, "hits": 20}}
    assert bench_rows.prefetch_summary(plain, 10) == {}
    decode = {
        "vram": {
            "lookups": 100,
            "hits": 90,
            "prefetched": 40,
            "prefetch_used": 30,
            "prefetch_wasted_bytes": 10 * 3_000_000,
            "prefetch_late": 5,
        },
        "ram": {"lookups": 10, "hits": 10, "prefetched": 0},
    }
    assert bench_rows.prefetch_summary(decode, 10) == {
        "prefetch_accuracy_vram": 0.75,  # 30 needs met ahead of 40 that were not resident otherwise (30 + 10 misses)
        "prefetch_wasted_gb_per_token_vram": 0.003,
        "prefetched_per_token_vram": 4.0,
        "prefetch_late_per_token_vram": 0.5,  # 5 of the 30 used were still being copied when their step came
    }
    ahead = {"ram": {"lookups": 40, "hits": 30, "prefetched": 20, "prefetch_used": 15}, "ssd": {"hurried": 6}}
    got = bench_rows.prefetch_summary(ahead, 10)
    assert got["prefetch_accuracy_ram"] == 0.6 and got["ssd_reads_hurried_per_token"] == 0.6


@pytest.mark.parametrize(
    "name,pinned_gb",
    [
        ("resident", 0.0),
        ("offload17", 17 * 2**30 / 1e9),
        ("bigmoe-102-layerbuf@r0.8+one-node+host", 32.2),  # every expert in the RAM tier (run 28: 32.2 GB copied)
        ("bigmoe-32", 32.2),
        ("bigmoe-32-ram128-ssd@r0.8+ahead", 16.1),  # half of them
    ],
)
def test_an_engines_host_memory_is_its_pinned_tier_and_a_process(name, pinned_gb, tmp_path):
    need = bench.engine_host_bytes(bench.config_for(name, tmp_path / "t.npz", bench.SHAPE["experts"]))
    assert need - bench.ENGINE_HOST_BYTES == pytest.approx(pinned_gb * 1e9, rel=0.01)


def test_combine_takes_each_ratio_side_by_side_in_one_call_and_from_the_named_path(tmp_path):
    """Run 27's layout: call r measured resident and the 102-slot rows, call t offload17 and the same rows again,
    call s offload17 and the 32-slot rows; each ratio pairs a row with the reference of its own call."""
    path = "+one-node+host+chained-only"

    def call(name, rows):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"command": name, "configs": [{"name": n, "tpot_ms": t} for n, t in rows]}))
        return f

    files = [
        call("r", [("resident", 3.5), ("bigmoe-102-layerbuf", 5.2), (f"bigmoe-102-layerbuf@r0.8{path}", 4.9)]),
        call("t", [("offload17", 14.0), ("bigmoe-102-layerbuf", 5.0), (f"bigmoe-102-layerbuf@r0.8{path}", 4.8)]),
        call(
            "s",
            [("offload17", 15.0), ("bigmoe-32-layerbuf@r0.8", 7.0), (f"bigmoe-32-layerbuf@r0.8{path}", 6.0)],
        ),
    ]
    out = tmp_path / "prefetch.json"
    assert bench_combine.combine(files, out, path) == 0
    std = json.loads(out.read_text())["families"]["standard"]
    assert std["tpot_vs_resident_at_102"] == 1.4  # call r's 4.9 over call r's resident, not call t's 4.8
    assert std["speedup_vs_offload17_at_102"] == 2.917  # call t's offload17 over call t's 4.8, not call s's 15.0
    assert std["speedup_vs_offload17_at_32"] == 2.5  # the path's row, not the default path's 7.0
    assert std["tpot_vs_resident_at_102_no_prefetch"] == round(5.2 / 3.5, 3)
    assert std["path"] == path and std["rows"]["32"] == f"bigmoe-32-layerbuf@r0.8{path}"
    assert std["sources"]["tpot_vs_resident_at_102"]["calls"] == ["r.json"]  # each ratio names its call
    assert std["sources"]["speedup_vs_offload17_at_102"]["calls"] == ["t.json"]
    assert all(s["side_by_side"] for s in std["sources"].values())

    assert bench_combine.combine(files, out) == 0  # no path: the default path's rows, and no "path" named
    std = json.loads(out.read_text())["families"]["standard"]
    assert std["speedup_vs_offload17_at_32"] == round(15.0 / 7.0, 3) and "path" not in std


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    "calls,ratio,met",
    [
        # run 27 then run 34: the later call ran both rows side by side, and recall 0 was slower there
        (
            [(None, [("resident", 3.5), ("A", 5.215), ("R0", 5.202)]), (None, [("A", 5.206), ("R0", 5.311)])],
            1.02,
            False,
        ),
        (
            [(None, [("A", 5.206), ("R0", 5.311)]), (None, [("resident", 3.5), ("A", 5.215), ("R0", 5.202)])],
            0.998,
            True,
        ),
        # the same on another card: a straight comparison holds on any card (run 34's H100)
        (
            [(None, [("resident", 3.5), ("A", 5.215), ("R0", 5.202)]), (H100, [("A", 5.206), ("R0", 5.311)])],
            1.02,
            False,
        ),
        # no call ran both: no straight ratio, the rows are compared over the resident engine of their own calls
        ([(None, [("resident", 3.5), ("A", 5.2)]), (None, [("resident", 3.4), ("R0", 5.1)])], None, False),
    ],
)
def test_recall_0_is_judged_against_no_prefetch_in_the_latest_call_that_ran_both(calls, ratio, met, tmp_path):
    names = {"A": "bigmoe-102-layerbuf", "R0": "bigmoe-102-layerbuf@r0+one-node+host+chained-only"}
    files = []
    for i, (card, rows) in enumerate(calls):
        f = tmp_path / f"call{i}.json"
        configs = [{"name": names.get(n, n), "tpot_ms": t} for n, t in rows]
        f.write_text(json.dumps({"command": f"call {i}", "configs": configs, **({"gpu": card} if card else {})}))
        files.append(f)
    out = tmp_path / "prefetch.json"
    assert bench_combine.combine(files, out, "+one-node+host+chained-only") == 0
    report = json.loads(out.read_text())
    assert report["families"]["standard"].get("recall_0_vs_no_prefetch_at_102") == ratio
    assert report["issue15_targets"]["standard"]["102 slots at recall 0 no slower than without prefetch"] is met


@pytest.mark.parametrize(
    "calls,ratio,pair",
    [
        # run 49: the H200's pair spans two calls, a later H100 row pairs with an older H100 machine's offload17
        (
            [
                ("h200-v.json", None, [("R0", 5.0)]),
                ("h200-y.json", None, [("offload17", 15.0)]),
                ("h100-y.json", H100, [("offload17", 20.0)]),
                ("h100-v.json", H100, [("R0", 5.2)]),
            ],
            3.0,
            (["h200-v.json", "h200-y.json"], False),
        ),
        # one call ran both on each card: the H200's call, though the H100's came later
        (
            [
                ("h200.json", None, [("R0", 5.0), ("offload17", 15.0)]),
                ("h100.json", H100, [("R0", 5.2), ("offload17", 20.0)]),
            ],
            3.0,
            (["h200.json"], True),
        ),
        # the H200 has no offload17 row: the H100's pair stands, named as the H100's
        (
            [("h200.json", None, [("R0", 5.0)]), ("h100.json", H100, [("R0", 5.0), ("offload17", 20.0)])],
            4.0,
            (["h100.json"], True),
        ),
    ],
    ids=["pairs-across-calls", "side-by-side", "other-card-only"],
)
def test_a_ratio_takes_the_target_cards_pair_before_a_later_one_of_another_card(calls, ratio, pair, tmp_path):
    r0 = "bigmoe-102-layerbuf@r0+one-node+host+chained-only"
    files = []
    for name, card, rows in calls:
        files.append(tmp_path / name)
        configs = [{"name": r0 if n == "R0" else n, "tpot_ms": t} for n, t in rows]
        files[-1].write_text(json.dumps({"command": name, "configs": configs, **({"gpu": card} if card else {})}))
    out = tmp_path / "prefetch.json"
    assert bench_combine.combine(files, out, "+one-node+host+chained-only") == 0
    standard = json.loads(out.read_text())["families"]["standard"]
    assert standard["speedup_vs_offload17_at_102_recall_0"] == ratio
    source = standard["sources"]["speedup_vs_offload17_at_102_recall_0"]
    assert (source["calls"], source["side_by_side"]) == pair


@pytest.mark.parametrize(
    "calls_pooled,ratio,listed",
    [
        (1, 0.99, ["call2.json"]),  # the latest call alone, its two recall-0 rows averaged
        (2, 1.0, ["call1.json", "call2.json"]),  # (1.01 + 0.99) / 2
        (5, 1.0, ["call1.json", "call2.json"]),  # as many as ran both: call 0 ran no recall-0 row
    ],
)
def test_recall_0_pools_the_latest_calls_that_ran_both_and_averages_each_call_s_replicas(
    calls_pooled, ratio, listed, tmp_path
):
    """Run 40: one call's engines of the same configuration differed by up to 0.2 ms, so the recall-0 ratio may be
    the mean over the latest N calls of one build (--recall-0-calls), each call's replicas (#2) averaged."""
    calls = [
        [("A", 5.0)],
        [("A", 5.0), ("A#2", 5.2), ("R0", 5.151)],  # 5.151 / 5.1 = 1.01
        [("R0", 5.0), ("A", 5.1), ("R0#2", 5.098)],  # 5.049 / 5.1 = 0.99
    ]
    names = {"A": "bigmoe-102-layerbuf", "R0": "bigmoe-102-layerbuf@r0+one-node+host+chained-only"}
    files = []
    for i, rows in enumerate(calls):
        f = tmp_path / f"call{i}.json"
        configs = []
        for n, t in rows:
            base, _, replica = n.partition("#")
            configs.append({"name": names[base] + (f"#{replica}" if replica else ""), "tpot_ms": t})
        f.write_text(json.dumps({"command": f"call {i}", "configs": configs}))
        files.append(f)
    out = tmp_path / "prefetch.json"
    assert (
        bench.main(
            [
                "--combine",
                *map(str, files),
                "--out",
                str(out),
                "--path",
                "+one-node+host+chained-only",
                "--recall-0-calls",
                str(calls_pooled),
            ]
        )
        == 0
    )
    standard = json.loads(out.read_text())["families"]["standard"]
    assert standard["recall_0_vs_no_prefetch_at_102"] == ratio
    assert list(standard["recall_0_vs_no_prefetch_calls"]) == listed
    assert standard["sources"]["recall_0_vs_no_prefetch_at_102"]["calls"] == listed
    # Each call's difference stands beside the widest spread between its engines of one configuration
    spreads = {"call1.json": (0.051, 0.2), "call2.json": (-0.051, 0.098)}
    assert {c: (v["difference"], v["engine_spread"]) for c, v in standard["recall_0_calls_ms"].items()} == {
        c: spreads[c] for c in listed
    }


def test_a_recall_0_pool_of_no_calls_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--combine", str(tmp_path / "a.json"), "--out", str(tmp_path / "o.json"), "--recall-0-calls", "0"])
    assert exit_.value.code == 2 and "--recall-0-calls takes a count of at least 1" in capsys.readouterr().err


def test_a_ratio_from_two_calls_pairs_rows_of_one_card(tmp_path):
    """Run 34 (H100) measured the recall-0 row without a resident engine: the ratio over resident stays with the
    H200's calls (files before run 35 name no card) instead of pairing an H100 row with an H200 reference."""
    r0 = "bigmoe-102-layerbuf@r0+one-node+host+chained-only"
    older = tmp_path / "h200.json"
    older_rows = [{"name": "resident", "tpot_ms": 3.5}, {"name": r0, "tpot_ms": 5.25, "tokens": [7, 8, 9]}]
    older.write_text(json.dumps({"command": "a", "configs": older_rows}))
    later = tmp_path / "h100.json"
    later.write_text(
        json.dumps(
            {
                "command": "b",
                "gpu": H100,
                "configs": [
                    {
                        "name": r0,
                        "tpot_ms": 5.6,
                        "tokens": [7, 8, 9],
                        "pager_totals": {"vram": {"hits": 9}},
                        "timed_counters": {"vram": {"hits": 3}},
                        "decode_hit_rate": {"vram": 0.9},
                    }
                ],
            }
        )
    )
    out = tmp_path / "prefetch.json"
    assert bench_combine.combine([older, later], out, "+one-node+host+chained-only") == 0
    report = json.loads(out.read_text())
    assert report["families"]["standard"]["tpot_vs_resident_at_102_recall_0"] == 1.5  # 5.25 / 3.5, not 5.6 / 3.5
    source = report["families"]["standard"]["sources"]["tpot_vs_resident_at_102_recall_0"]
    assert source["calls"] == ["h200.json"] and "H200" in source["gpu"]

    # The H100's row stands beside the H200's, not in its place (the targets are the H200's)
    assert [(r["name"], r["tpot_ms"]) for r in report["configs"] if r["name"] == r0] == [(r0, 5.25)]
    assert [(r["name"], r["gpu"]) for r in report["other_card_configs"]] == [(r0, H100)]
    # Its tokens are judged against the H200's rows, then left in its source file
    assert report["other_card_configs"][0]["same_tokens_as"] == [r0]
    # ...and its raw counters too; their digest (the hit rates) stays
    assert not set(bench_combine.IN_SOURCE_ONLY) & set(report["other_card_configs"][0])
    assert report["other_card_configs"][0]["decode_hit_rate"] == {"vram": 0.9}


def test_a_ratio_no_call_measured_whole_names_both_calls_and_says_so(tmp_path):
    r0 = "bigmoe-102-layerbuf@r0+one-node+host+chained-only"
    files = []
    calls = (
        ("h200.json", None, [(r0, 5.25)]),
        ("h100-a.json", H100, [(r0, 5.6)]),
        ("h100-b.json", H100, [("resident", 4.0)]),
    )
    for name, card, rows in calls:  # the H200's row names the configuration; no call ran it beside resident
        files.append(tmp_path / name)
        configs = [{"name": n, "tpot_ms": t} for n, t in rows]
        files[-1].write_text(json.dumps({"command": name, "configs": configs, **({"gpu": card} if card else {})}))
    out = tmp_path / "prefetch.json"
    assert bench_combine.combine(files, out, "+one-node+host+chained-only") == 0
    standard = json.loads(out.read_text())["families"]["standard"]
    assert standard["tpot_vs_resident_at_102_recall_0"] == 1.4  # 5.6 / 4.0, two calls of one card
    assert standard["sources"]["tpot_vs_resident_at_102_recall_0"] == {
        "calls": ["h100-a.json", "h100-b.json"],
        "gpu": H100,
        "side_by_side": False,
    }


@pytest.mark.parametrize(
    "script,name",
    [
        ("echo 'NVIDIA H100 80GB HBM3'; echo 'NVIDIA H100 80GB HBM3'", "NVIDIA H100 80GB HBM3"),
        ("exit 9", None),
        (None, None),
    ],
)
def test_the_bench_names_the_card_it_ran_on(script, name, tmp_path, monkeypatch):
    """nvidia-smi here is a stand-in script (this machine has no GPU); None where it fails or is missing."""
    if script is not None:
        smi = tmp_path / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n{script}\n")
        smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.gpu_name() == name


def test_combine_keeps_every_target_card_calls_tpot_of_a_configuration(tmp_path):
    def call(tpot, gpu=None):
        return {"command": "x", "checkpoint": {}, "configs": [{"name": "resident", "tpot_ms": tpot}], "gpu": gpu}

    files = [tmp_path / f"run{i}-bench.json" for i in range(3)]
    for f, body in zip(files, (call(4.0), call(5.0, "NVIDIA H100 80GB HBM3"), call(6.0)), strict=True):
        f.write_text(json.dumps({k: v for k, v in body.items() if v is not None}))
    assert bench_combine.combine(files, tmp_path / "out.json") == 0
    (row,) = json.loads((tmp_path / "out.json").read_text())["configs"]
    assert row["tpot_ms"] == 6.0  # the latest call's row
    assert row["tpot_ms_calls"] == {"run0-bench.json": 4.0, "run2-bench.json": 6.0}  # the H100's call is not the H200's
