"""scripts/bench_ssd.py: every source read whole by every worker count, a compressed paging file included."""

from __future__ import annotations

import json

import bench_ssd  # scripts/ is on pytest's pythonpath (pyproject)
import pytest


def test_a_compressed_paging_file_delivers_every_raw_record_from_fewer_disk_bytes(tmp_path):
    out = tmp_path / "ssd.json"
    argv = ["--dir", str(tmp_path), "--gb", "0.01", "--experts", "6", "--workers", "1,2", "--modes", "store,load"]
    assert bench_ssd.main([*argv, "--sources", "paging-file,compressed", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["source"], r["mode"], r["workers"]): r for r in report["results"]}
    assert len(rows) == 2 * 2 * 2
    raw_bytes = report["layers"] * 6 * report["record_bytes"]
    assert report["decoder"] == "HostDecoder"  # the C decoder expands them wherever a compiler is
    for (source, _, _), r in rows.items():
        assert r["experts"] == report["layers"] * 6 and r["bytes"] == raw_bytes and r["gbps"] > 0
        # Student-t experts: the codec's ~0.85 of the raw bytes come off the disk (each read's aligned span aside)
        assert (r["disk_bytes"] < 0.9 * raw_bytes) == (source == "compressed"), (source, r["disk_bytes"], raw_bytes)
    assert not (tmp_path / "bigmoe-bench-ssd").exists()  # the script removes what it made


def test_an_unknown_source_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_ssd.main(["--sources", "checkpoint,tape"])
    assert stop.value.code == 2
    assert "--sources" in capsys.readouterr().err.splitlines()[-1]
