"""scripts/gpu_conditional_probe.py off the GPU: it refuses in one line, and its figures are per step over plain.
Its GPU run (run 41) times the IF nodes and checks that each body ran as often as its condition said."""

from __future__ import annotations

import gpu_conditional_probe as probe  # scripts/ is on pytest's pythonpath (pyproject)
import pytest


def test_without_a_gpu_the_probe_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]
    assert not (tmp_path / "c.json").exists()


def test_a_torch_without_if_nodes_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "IF_NODE", "no_such_capture_method")
    assert probe.main(["--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDAGraph.no_such_capture_method" in err[0] and "vLLM 0.33" in err[0]


@pytest.mark.parametrize("steps", [1, 40])
def test_each_variant_is_reported_per_step_over_plain_from_its_median_round(steps):
    times = {"plain": [50.0, 40.0, 40.0], "if-on": [40.0 + 8 * steps] * 3, "if-off": [40.0, 40.0 + 4 * steps, 999.0]}
    summary = probe.summarize(times, steps)
    assert summary["plain"]["us_per_step_over_plain"] == 0
    assert summary["if-on"]["us_per_step_over_plain"] == 8
    assert summary["if-off"]["us_per_step_over_plain"] == 4
    assert summary["if-off"]["rounds"] == times["if-off"]


def test_a_skipped_body_runs_no_times_and_every_other_once_a_step():
    assert {v: probe.bodies_per_step(v) for v in probe.VARIANTS} == {"plain": 1, "if-on": 1, "if-off": 0, "either": 1}
