"""Engines admitted by host memory: a benchmark that starts several vLLM engines at once holds back an engine whose
host memory would not fit beside the engines already running, until one of them ends.

Why: run 28 started five engines at once on the H200's host (132 GB available): four bigmoe engines, each pinning
the 40-layer checkpoint's 32.2 GB of experts as its RAM tier, and `--cpu-offload-gb 17`. Available memory fell to
about 1 GB, the kernel killed one engine and the other four spent the whole time budget starting. Three such engines
at once (about 102 GB) had run well in the same session.

    budget = HostMemoryBudget(psutil.virtual_memory().available - margin)
    with budget.reserve(need_bytes, "bigmoe-102"):
        ... run the engine ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

GB = 1e9


class HostMemoryBudget:
    """Bytes of host memory shared by engines on several threads. A reservation waits while the engines holding
    reservations leave too little; one that needs more than the whole budget is let in alone (it would have run
    anyway, and waiting for a share that never comes would hang the benchmark)."""

    def __init__(self, total_bytes: int) -> None:
        self.total = max(0, int(total_bytes))
        self.held = 0
        self._changed = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """Whether a reservation of `nbytes` would be let in now."""
        return self.held == 0 or self.held + nbytes <= self.total

    @contextmanager
    def reserve(self, nbytes: int, name: str, say: Callable[[str], None] = print) -> Iterator[None]:
        """Hold `nbytes` while the block runs; says once, naming the engine, when it has to wait."""
        nbytes = max(0, int(nbytes))
        with self._changed:
            if not self.fits(nbytes):
                say(
                    f"{name} waits for host memory: it needs {nbytes / GB:.1f} GB and the engines running hold "
                    f"{self.held / GB:.1f} of {self.total / GB:.1f} GB"
                )
                self._changed.wait_for(lambda: self.fits(nbytes))
            self.held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self.held -= nbytes
                self._changed.notify_all()
