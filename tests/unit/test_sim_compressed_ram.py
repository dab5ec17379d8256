"""scripts/sim_compressed_ram.py: the eviction replay with RAM slots for compressed records in the same bytes."""

from __future__ import annotations

import json

import pytest
import sim_compressed_ram  # scripts/ is on pytest's pythonpath (pyproject)


def test_rows_compare_each_ratio_with_raw_records_of_the_same_shape(tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--tokens", "80", "--layers", "1", "--families", "near-uniform", "--ratios", "1,0.5", "--workers", "1"]
    assert sim_compressed_ram.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    shapes = {r["shape"] for r in rows}
    assert shapes and all(r["ram_slots"] < r["experts"] or r["ratio"] < 1 for r in rows)  # partial tiers only
    for shape in shapes:
        raw, half = (next(r for r in rows if r["shape"] == shape and r["ratio"] == x) for x in (1.0, 0.5))
        assert raw["ssd_reads_vs_raw"] == 1.0 and raw["ssd_bytes_vs_raw"] == 1.0
        assert half["ram_slots"] == min(half["experts"], 2 * raw["ram_slots"])
        # near-uniform routing: twice the RAM slots must read less from SSD, and each read is half the bytes
        assert half["ssd_reads_per_token"] < raw["ssd_reads_per_token"]
        assert half["ssd_bytes_vs_raw"] == pytest.approx(half["ssd_reads_vs_raw"] * 0.5, abs=1e-4)


@pytest.mark.parametrize("argv", [["--ratios", "0.8"], ["--ratios", "1,1.2"], ["--families", "zipf"]])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        sim_compressed_ram.main(argv)
    assert stop.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
