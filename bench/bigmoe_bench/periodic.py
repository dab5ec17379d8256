"""A context that appends to a text file every few seconds from a daemon thread: the base of the benchmarks' samplers.

A subclass writes one sample in `sample(out, elapsed_s)` and, optionally, a closing part in `close(out)`.
"""

from __future__ import annotations

import abc
import threading
import time
from pathlib import Path
from typing import TextIO


class PeriodicFile(abc.ABC):
    """`path` is emptied on entry; sample() runs every `period_s` seconds until the context exits, then close()."""

    thread_name = "periodic-file"

    def __init__(self, path: Path, period_s: float) -> None:
        self.path = Path(path)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.start()
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5)
        with self.path.open("a") as out:
            self.close(out)

    def _loop(self) -> None:
        began = time.monotonic()
        with self.path.open("a") as out:
            while not self._stop.wait(self.period_s):
                if self.sample(out, time.monotonic() - began) is False:
                    return
                out.flush()

    def start(self) -> None:
        """On entry, in the entering thread, before the first sample."""

    @abc.abstractmethod
    def sample(self, out: TextIO, elapsed_s: float) -> bool | None:
        """Write one sample; False stops the sampling."""

    def close(self, out: TextIO) -> None:
        """Write what follows the samples (nothing by default)."""
