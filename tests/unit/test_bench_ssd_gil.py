"""scripts/bench_ssd_gil.py: single-expert SSD reads through the service, idle and beside a GIL-busy thread."""

from __future__ import annotations

import json
import sys

import bench_ssd_gil  # scripts/ is on pytest's pythonpath (pyproject)
import pytest


def test_each_interval_is_timed_idle_and_busy_and_python_s_own_comes_back(tmp_path):
    before = sys.getswitchinterval()
    out = tmp_path / "gil.json"
    argv = ["--dir", str(tmp_path), "--gb", "0.01", "--reads", "4", "--switch-us", "2000,100", "--out", str(out)]
    assert bench_ssd_gil.main(argv) == 0
    assert sys.getswitchinterval() == before
    rows = json.loads(out.read_text())["rows"]
    assert [(r["switch_us"], r["busy_thread"]) for r in rows] == [
        (2000, False),
        (2000, True),
        (100, False),
        (100, True),
    ]
    assert all(0 < r["median_ms"] <= r["p90_ms"] and r["reads"] == 4 for r in rows)
    assert not (tmp_path / "bigmoe-bench-ssd-gil").exists()  # the script removes what it made


def test_a_bad_interval_list_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_ssd_gil.main(["--dir", str(tmp_path), "--switch-us", "5000,0"])
    assert exit_.value.code == 2
    assert "--switch-us '5000,0': a comma list of positive integers" in capsys.readouterr().err
