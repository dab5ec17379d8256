"""A benchmark's host, sampled while it runs: memory, page cache, disk reads and CPU, as JSON lines.

Why: on the H200, two bigmoe engines loading the 40-layer checkpoint at once read it at about
100 MB/s each (320 s in vLLM's "Loading weights") while the resident engine took 19 s. Whether
that is the disk (the page cache losing the checkpoint to the engines' pinned RAM tiers) or the
CPU shows in these samples: disk read MB/s and the page cache's size against CPU busy percent.

    with HostMonitor(logs / "host.jsonl", period_s=5.0):
        ... start engines ...
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from bigmoe_bench.periodic import PeriodicFile

MB = 1e6


class HostMonitor(PeriodicFile):
    """One JSON line every `period_s` seconds appended to `path` until the context exits."""

    thread_name = "host-monitor"

    def __init__(self, path: Path, period_s: float = 5.0) -> None:
        super().__init__(path, period_s)
        self._last = (None, 0.0)

    def start(self) -> None:
        self._last = (psutil.disk_io_counters(), 0.0)
        psutil.cpu_percent(interval=None)  # the first call only sets the baseline

    def sample(self, out, elapsed_s: float) -> None:
        disk, (last_disk, last_t) = psutil.disk_io_counters(), self._last
        out.write(json.dumps(sample(elapsed_s, elapsed_s - last_t, disk, last_disk)) + "\n")
        self._last = (disk, elapsed_s)


def sample(elapsed_s: float, span_s: float, disk, last_disk) -> dict:
    """One line: seconds since start, memory in GB, disk reads over the last span in MB/s, CPU busy %."""
    mem = psutil.virtual_memory()
    span = max(span_s, 1e-6)
    row = {
        "t_s": round(elapsed_s, 1),
        "available_gb": round(mem.available / 1e9, 2),
        "cached_gb": round(getattr(mem, "cached", 0) / 1e9, 2),
        "free_gb": round(mem.free / 1e9, 2),
        "cpu_percent": psutil.cpu_percent(interval=None),
    }
    if disk is not None and last_disk is not None:
        row["disk_read_mb_s"] = round((disk.read_bytes - last_disk.read_bytes) / MB / span, 1)
        row["disk_reads_per_s"] = round((disk.read_count - last_disk.read_count) / span, 1)
    return row


def read_samples(path: Path) -> list[dict]:
    """The samples written so far (a line cut short by a crash is left out)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
