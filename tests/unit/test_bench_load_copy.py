"""scripts/bench_load_copy.py: torch's CPU copy of expert parts on its threads and on one, idle and busy."""

from __future__ import annotations

import json

import bench_load_copy  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import torch


def test_one_copy_thread_restores_the_thread_count_even_when_the_copy_fails():
    before = torch.get_num_threads()  # (inside it, a CI pytest-xdist worker reported 2: not asserted)
    with pytest.raises(RuntimeError), bench_load_copy.one_copy_thread():
        torch.zeros(2).copy_(torch.zeros(3))  # a shape error passes through
    assert torch.get_num_threads() == before


def test_the_benchmark_times_both_ways_idle_and_busy(tmp_path):
    out = tmp_path / "copy.json"
    assert bench_load_copy.main(["--experts", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"] == 1, r["busy_processes"] > 0) for r in rows] == [
        (torch.get_num_threads() == 1, False),
        (True, False),
        (torch.get_num_threads() == 1, True),
        (True, True),
    ]
    assert all(r["gb_per_s"] > 0 for r in rows)


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert bench_load_copy.main(["--experts", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
