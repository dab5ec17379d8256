"""The handoff split's pieces (`gpu_issue15.sh handoff-split`): the probe build still applies to the tree, and its
one-line table reads overlap probe reports, the GPU's committed ones included."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import handoff_table  # scripts/ is on pytest's pythonpath (pyproject)
import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN34 = ROOT / "docs/bench/vllm033-gpu/run34-probe-idle-h200.json"


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch")
def test_the_probe_build_applies_to_the_step_kernel():
    """When the step kernel changes, this patch must be made again before the next handoff split."""
    r = subprocess.run(
        ["patch", "--dry-run", "-p1", "-s", "-d", str(ROOT), "-i", str(ROOT / "scripts/step_probe.patch")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _row(variant: str, ms: float, step_us: float | None) -> dict:
    profile = {"top_kernels": [{"name": "_up_kernel", "mean_us": 17.0}]}
    if step_us is not None:
        profile["top_kernels"].append({"name": "_step_kernel", "mean_us": step_us})
    return {"family": "standard", "variant": variant, "recall": 0, "ms_per_token": ms, "profile": profile}


@pytest.mark.parametrize("profiled", [True, False])
def test_the_line_leaves_out_each_variants_first_round(profiled):
    runs = [{"family": "standard", "variant": "resident", "recall": None, "ms_per_token": 4.0}]
    for plain, joinless in ((5.0, 9.0), (6.0, 6.1), (6.2, 6.4)):  # the first round replays fast or slow: ignored
        runs += [
            _row("none", plain, 47.0 if profiled else None),
            _row("onenode-bare", joinless, 49.5 if profiled else None),
        ]
    text = handoff_table.line("0", {"runs": runs})
    assert text.startswith("probe 0: standard:")
    assert "none 6.000/6.200 ms" in text and "onenode-bare 6.100/6.400 ms" in text
    assert "bare - none +0.150 ms" in text
    assert ("step +2.50 us" in text) is profiled


def test_the_gpu_report_of_run_34_reads_as_its_table():
    """docs/benchmarks.md's run 34 table: plain 47.34 us, joinless 49.70 (standard); 90.12 and 92.18 (topic-shift)."""
    text = handoff_table.line("1", json.loads(RUN34.read_text()))
    assert "bare - none +0.091 ms step +2.36 us" in text and "bare - none +0.090 ms step +2.06 us" in text


def test_a_file_that_is_no_report_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"configs": []}')
    assert handoff_table.main(["0", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an overlap probe report" in err
