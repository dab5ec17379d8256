"""HostMonitor samples the host while a benchmark runs: one JSON line per period, readable while written."""

from __future__ import annotations

import time

import pytest
from bigmoe_bench.host_monitor import HostMonitor, read_samples


@pytest.mark.parametrize("period_s", [0.05, 0.2])
def test_samples_arrive_each_period_and_stop_with_the_context(tmp_path, period_s):
    path = tmp_path / "logs" / "host.jsonl"
    with HostMonitor(path, period_s=period_s):
        time.sleep(period_s * 5.5)
    rows = read_samples(path)
    assert 3 <= len(rows) <= 6
    times = [r["t_s"] for r in rows]
    assert times == sorted(times)
    for r in rows:
        assert r["available_gb"] > 0 and r["free_gb"] >= 0 and r["cached_gb"] >= 0
        assert 0 <= r["cpu_percent"] <= 100
        assert r.get("disk_read_mb_s", 0) >= 0
    time.sleep(period_s * 2)
    assert len(read_samples(path)) == len(rows)  # nothing written once the context has exited


def test_a_line_cut_short_is_left_out(tmp_path):
    path = tmp_path / "host.jsonl"
    path.write_text('{"t_s": 5.0, "available_gb": 1.0}\n{"t_s": 10.0, "avail')
    assert read_samples(path) == [{"t_s": 5.0, "available_gb": 1.0}]
