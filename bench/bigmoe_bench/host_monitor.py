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
import threading
import time
from pathlib import Path

import psutil

MB = 1e6


class HostMonitor:
    """A daemon thread appending one sample every `period_s` seconds to `path` until the context exits."""

    def __init__(self, path: Path, period_s: float = 5.0) -> None:
        self.path = Path(path)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "HostMonitor":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._thread = threading.Thread(target=self._loop, name="host-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5)

    def _loop(self) -> None:
        start = time.monotonic()
        last_disk, last_t = psutil.disk_io_counters(), start
        psutil.cpu_percent(interval=None)  # the first call only sets the baseline
        with self.path.open("a") as out:
            while not self._stop.wait(self.period_s):
                now = time.monotonic()
                disk = psutil.disk_io_counters()
                out.write(json.dumps(sample(now - start, now - last_t, disk, last_disk)) + "\n")
                out.flush()
                last_disk, last_t = disk, now


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
