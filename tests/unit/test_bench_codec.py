"""scripts/bench_codec.py on the CPU: a row per law and chunk geometry, and one line for a geometry it cannot run."""

from __future__ import annotations

import json

import bench_codec  # scripts/ is on pytest's pythonpath (pyproject)
import pytest


def test_each_geometry_gets_its_row_from_the_same_records(tmp_path):
    out = tmp_path / "codec.json"
    argv = ["--cpu-only", "--shape", "64x64", "--experts", "1", "--workers", "1", "--out", str(out)]
    assert bench_codec.main([*argv, "--geometries", "16x128,128x16"]) == 0
    shape = json.loads(out.read_text())["shapes"]["64x64"]
    laws = shape["laws"]
    assert sorted(laws) == ["gaussian", "gaussian@128x16", "student_t", "student_t@128x16"]
    assert [laws[k]["geometry"] for k in ("student_t", "student_t@128x16")] == ["16x128", "128x16"]
    for law in ("student_t", "gaussian"):
        # the same records: one bound; more lanes, more chunk-header bytes
        assert laws[law]["entropy_bound_ratio"] == laws[f"{law}@128x16"]["entropy_bound_ratio"]
        assert laws[law]["ratio"] < laws[f"{law}@128x16"]["ratio"]
    assert shape["ratio"] == laws["student_t"]["ratio"]  # the headline stays the pager's geometry
    assert all(law["host_decode_GBps"] > 0 for law in laws.values())  # the C decoder, every geometry


@pytest.mark.parametrize("geometries", ["12x128", "16x3", "lanes"])
def test_a_geometry_it_cannot_run_is_one_line_and_exit_2(geometries, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_codec.main(["--cpu-only", "--geometries", geometries])
    assert stop.value.code == 2
    assert "geometry" in capsys.readouterr().err.splitlines()[-1]
