"""The paging benchmark's code path on CPU (tiny shapes): every configuration runs and the JSON has the issue's keys."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_pager  # noqa: E402  (scripts/ is not a package)

RUN_KEYS = {"model", "config", "vram_frac", "ram_frac", "ms_per_token", "hit_rate", "pcie_gb_per_token", "floor_ms_per_token"}


def test_smoke_run_writes_every_configuration(tmp_path):
    out, md = tmp_path / "pager.json", tmp_path / "pager.md"
    rc = bench_pager.main(["--device", "cpu", "--smoke", "--tokens", "2", "--warmup", "2",
                           "--configs", "static,bigmoe,bigmoe-lfu", "--out", str(out), "--markdown", str(md)])
    assert rc == 0
    report = json.loads(out.read_text())
    configs = sorted({(r["config"], r["vram_budget"]) for r in report["runs"]})
    assert configs == sorted([("resident", 1.0)] + [(c, f) for c in ("static", "bigmoe", "bigmoe-lfu") for f in (0.125, 0.4)])
    for run in report["runs"]:
        assert RUN_KEYS <= set(run)
        assert run["ms_per_token"] > 0
    big = [r for r in report["runs"] if r["config"] == "bigmoe"]
    assert all(0 < r["hit_rate"]["vram"] < 1 and r["pcie_gb_per_token"] > 0 for r in big)
    assert "| smoke | bigmoe |" in md.read_text()


def test_a_recorded_trace_of_the_wrong_shape_is_refused(tmp_path):
    trace = tmp_path / "t.npz"
    bench_pager.traces.save_trace(trace, bench_pager.traces.standard_trace(5, 3, 32, 3, seed=0))
    with pytest.raises(SystemExit, match="k = 4"):
        bench_pager.main(["--device", "cpu", "--smoke", "--tokens", "2", "--warmup", "2", "--trace", str(trace)])
