"""A poor man's sampling profiler: the main thread's Python stack every few seconds, written as text.

For slow phases that a profiler cannot be wrapped around cheaply, such as a vLLM engine's start (the
H200's bigmoe engines spent 320 s in "Loading weights" against 19 s for the resident engine): where the
main thread is, sample after sample, says which call the time goes to.

    with StackSampler(logs / "startup-stacks.txt", period_s=10.0):
        llm = LLM(...)
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

DEPTH = 14  # innermost frames kept per sample


class StackSampler:
    """Samples the thread that enters the context; appends each sample, and a tally of innermost frames at exit."""

    def __init__(self, path: Path, period_s: float = 10.0) -> None:
        self.path = Path(path)
        self.period_s = period_s
        self.tally: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._target = 0

    def __enter__(self) -> "StackSampler":
        self._target = threading.get_ident()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._thread = threading.Thread(target=self._loop, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5)
        with self.path.open("a") as out:
            out.write("== innermost frames, by samples\n")
            for frame, n in self.tally.most_common(20):
                out.write(f"{n:5d}  {frame}\n")

    def _loop(self) -> None:
        start = time.monotonic()
        with self.path.open("a") as out:
            while not self._stop.wait(self.period_s):
                frame = sys._current_frames().get(self._target)
                if frame is None:
                    return
                stack = traceback.extract_stack(frame)[-DEPTH:]
                if stack:
                    last = stack[-1]
                    self.tally[f"{last.filename}:{last.lineno} {last.name}"] += 1
                out.write(f"== t={time.monotonic() - start:.1f} s\n")
                out.write("".join(traceback.format_list(stack)))
                out.flush()
