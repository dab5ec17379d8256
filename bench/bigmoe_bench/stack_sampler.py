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
import traceback
from collections import Counter
from pathlib import Path

from bigmoe_bench.periodic import PeriodicFile

DEPTH = 14  # innermost frames kept per sample


class StackSampler(PeriodicFile):
    """Samples the thread that enters the context; appends each sample, and a tally of innermost frames at exit."""

    thread_name = "stack-sampler"

    def __init__(self, path: Path, period_s: float = 10.0) -> None:
        super().__init__(path, period_s)
        self.tally: Counter[str] = Counter()
        self._target = 0

    def start(self) -> None:
        self._target = threading.get_ident()

    def sample(self, out, elapsed_s: float) -> bool | None:
        frame = sys._current_frames().get(self._target)
        if frame is None:
            return False
        stack = traceback.extract_stack(frame)[-DEPTH:]
        if stack:
            last = stack[-1]
            self.tally[f"{last.filename}:{last.lineno} {last.name}"] += 1
        out.write(f"== t={elapsed_s:.1f} s\n")
        out.write("".join(traceback.format_list(stack)))
        return None

    def close(self, out) -> None:
        out.write("== innermost frames, by samples\n")
        for frame, n in self.tally.most_common(20):
            out.write(f"{n:5d}  {frame}\n")
