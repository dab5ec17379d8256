"""Expert records read from a store (checkpoint or paging file) on a few threads, as the SSD tier reads them.

The disk's rate for the SSD tier's reads: `scripts/bench_ssd.py` reads every record once,
`scripts/gpu_vllm_bench.py` reads for a few seconds to get the disk floor of its SSD runs.
"""

from __future__ import annotations

import threading
import time

from bigmoe_pager.core.odirect import aligned_empty


def read_records(store, keys: list[tuple[int, int]], workers: int, deadline: float | None = None) -> int:
    """Read the (layer, expert) records of `keys`, dealt round-robin to `workers` threads, each into its own
    aligned buffer of one record pitch; each thread stops early once time.monotonic() reaches `deadline` (None:
    never). Returns the reads done; the first read error is raised once every thread has stopped."""
    counts = [0] * workers
    errors: list[BaseException] = []

    def run(w: int) -> None:
        buf = aligned_empty(store.layout.pitch)
        try:
            for layer, expert in keys[w::workers]:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                store.read(layer, expert, buf)
                counts[w] += 1
        except Exception as e:  # noqa: BLE001  (raised again below, on the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts)
