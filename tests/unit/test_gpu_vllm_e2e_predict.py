"""scripts/gpu_vllm_e2e.py's issue-15 configurations: the live predictor prefetching on the default qwen3.6 shape,
under vLLM's default graphs and under PIECEWISE graphs, each compared with an unpaged reference in its own graph mode
(on the H200 the graph mode alone changed the greedy tokens: PIECEWISE against FULL decode graphs)."""

from __future__ import annotations

from pathlib import Path

import gpu_vllm_e2e as e2e  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import vllm_e2e_child as child


@pytest.fixture
def matrix() -> dict[str, e2e.Config]:
    return {c.name.split(" ")[0]: c for c in e2e.configs(256, Path("p.bmpf"))}


@pytest.mark.parametrize(
    "name,slots,extra,mode,reference",
    [
        ("vram40-predict", ("102", None), {}, None, "unpaged"),
        ("vram40-predict-chain", ("102", None), {"BIGMOE_PREFETCH_CHAIN": "1"}, None, "unpaged"),
        (
            "vram40-predict-joinless",
            ("102", None),
            {"BIGMOE_PREFETCH_CHAIN": "1", "BIGMOE_PREFETCH_JOINLESS": "1"},
            None,
            "unpaged",
        ),
        (
            "vram40-predict-host",
            ("102", None),
            {"BIGMOE_PREFETCH_JOINLESS": "1", "BIGMOE_PREFETCH_HOST_COPIER": "1"},
            None,
            "unpaged",
        ),
        (
            "vram40-predict-host-dist2",
            ("102", None),
            {"BIGMOE_PREFETCH_HOST_COPIER": "1", "BIGMOE_PREFETCH_DISTANCE": "2"},
            None,
            "unpaged",
        ),
        ("vram12-ram50-ssd-predict-ahead", ("32", "128"), {"BIGMOE_SSD_READ_AHEAD": "1"}, None, "unpaged"),
        ("vram40-predict-piecewise", ("102", None), {}, "PIECEWISE", "unpaged-piecewise"),
    ],
)
def test_prefetch_configurations_page_with_the_live_predictor_under_graphs(matrix, name, slots, extra, mode, reference):
    config = matrix[name]
    env = config.env
    assert env["BIGMOE_PREDICT"] == "router" and env["BIGMOE_CUDA_GRAPHS"] == "1" and not config.eager
    assert (env["BIGMOE_VRAM_SLOTS"], env.get("BIGMOE_RAM_SLOTS")) == slots
    assert all(env[k] == v for k, v in extra.items()) and config.reference == reference
    assert matrix[reference].engine == config.engine  # the reference runs in the same graph mode
    spec = {"engine": config.engine, "deterministic": True, "enforce_eager": False}
    assert child._engine_extras(spec).get("compilation_config", {}).get("cudagraph_mode") == mode


def test_a_setting_reaches_every_paged_configuration_and_a_bad_one_stops_the_run(matrix, capsys):
    """--setting BIGMOE_NAME=VALUE (the engines get no BIGMOE_* of the caller's environment): added to every paged
    configuration's env, never to the unpaged reference; an unknown variable or a bad value exits 2 with one line."""
    args = e2e.parse_args(["--out", "r.json", "--setting", "BIGMOE_PREFETCH_CHAINED_ONLY=0"])
    changed = {name: e2e.with_settings(c, args.setting) for name, c in matrix.items()}
    assert "BIGMOE_PREFETCH_CHAINED_ONLY" not in changed["unpaged"].env
    assert changed["vram40-predict-joinless"].env["BIGMOE_PREFETCH_CHAINED_ONLY"] == "0"
    assert changed["vram40-predict-joinless"].env["BIGMOE_PREFETCH_JOINLESS"] == "1"  # its own kept
    for bad in ("BIGMOE_PREFETCH_CHAINED_ONLY=2", "BIGMOE_NO_SUCH=1", "PREFETCH=1"):
        with pytest.raises(SystemExit) as exit:
            e2e.parse_args(["--out", "r.json", "--setting", bad])
        assert exit.value.code == 2
        assert len([line for line in capsys.readouterr().err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize(
    "names,want",
    [
        (["vram40-predict-piecewise"], {"unpaged-piecewise", "vram40-predict-piecewise"}),
        (
            ["vram40-predict", "vram40-predict-piecewise"],
            {"unpaged", "vram40-predict", "unpaged-piecewise", "vram40-predict-piecewise"},
        ),
        (["unpaged"], {"unpaged"}),
        (["vram40-eager-device"], {"unpaged-eager", "vram40-eager-device"}),
    ],
)
def test_a_named_configuration_brings_its_reference(names, want):
    """Run 31 lost a PIECEWISE row to a list that named the paged run and not its reference: the reference now comes
    with it, in the matrix's order (references first)."""
    matrix = e2e.configs(256, Path("p.bmpf"))
    picked = e2e.chosen(matrix, names)
    assert {c.name.split(" ")[0] for c in picked} == want
    firsts = [c.name for c in picked]
    assert all(firsts.index(c.reference) <= firsts.index(c.name) for c in picked)


def test_an_unknown_configuration_name_stops_before_any_work(tmp_path, capsys):
    code = e2e.main(
        ["--out", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w"), "--configs", "unpaged,vram99"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vram99" in err[0] and "vram40-predict" in err[0]
    assert not any((tmp_path / "w").iterdir())  # no checkpoint was started


def test_an_engine_stopped_by_the_budget_says_so_not_its_last_warning(tmp_path, monkeypatch):
    """Run 33: an engine still waiting for its turn at the call's end was reported by its log's last line (a chat
    template warning), which read like a crash."""
    child_script = tmp_path / "child.py"
    child_script.write_text(
        "import time\nprint('WARNING ValueError: a harmless warning', flush=True)\ntime.sleep(60)\n"
    )
    monkeypatch.setattr(e2e, "CHILD", child_script)
    logs = tmp_path / "logs"
    logs.mkdir()
    config = e2e.Config("slow-engine", {})
    row = e2e.run_config(config, {}, tmp_path, logs, deadline=e2e.time.monotonic() + 2)
    assert row["error"].startswith("stopped at the call's budget after ") and "--budget-s" in row["error"]
    assert "ValueError" not in row["error"] and "result" not in row


def test_an_engine_that_fails_is_reported_by_its_error_line(tmp_path, monkeypatch):
    child_script = tmp_path / "child.py"
    child_script.write_text("import sys\nprint('RuntimeError: the slots do not fit', flush=True)\nsys.exit(3)\n")
    monkeypatch.setattr(e2e, "CHILD", child_script)
    logs = tmp_path / "logs"
    logs.mkdir()
    row = e2e.run_config(e2e.Config("broken-engine", {}), {}, tmp_path, logs, deadline=e2e.time.monotonic() + 30)
    assert row["error"] == "exit 3: RuntimeError: the slots do not fit"
