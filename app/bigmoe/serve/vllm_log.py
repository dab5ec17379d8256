"""vllm_log: what a vLLM server's log says: how far start-up came, and why it stopped.

vLLM logs from several processes at once, each line prefixed with the process
("(EngineCore pid=12) ") and the logger ("ERROR 12-01 12:04:17 [core.py:1100] "). When the engine
core fails during start-up, its traceback comes first and the API server's wrapper after it
("RuntimeError: Engine core initialization failed. See root cause above."); the root cause is
the engine's last exception line, not the wrapper and not a warning printed on the way down.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

STAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engine", re.compile(r"Initializing a V1 LLM engine|vLLM API server version|non-default args")),
    ("weights", re.compile(r"Loading weights|Loading safetensors|Starting to load model")),
    ("paging tier", re.compile(r"bigmoe.*(pager|paging|tier)", re.I)),
    ("KV cache", re.compile(r"KV cache|GPU KV cache size|CPU KV cache", re.I)),
    ("CUDA graphs", re.compile(r"Capturing CUDA graphs|Graph capturing finished")),
    ("serving", re.compile(r"Application startup complete|Uvicorn running|Starting vLLM API server")),
)
"""Log lines that mark how far start-up has come, in order."""

MAX_LINE = 400
"""Characters of a cause kept (the end of a longer line)."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PREFIX = re.compile(r"^(\([\w-]+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*)?")
"""vLLM's process and logger prefixes."""
EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Exit|Failure)(?:: .*)?$")
"""The last line of a traceback: `module.SomeError: message`."""
ERROR_WORD = re.compile(r"\b(?:Error|error|ERROR):\s")
"""A line that states an error without a traceback ("Error: ...")."""
WRAPPERS = re.compile(
    r"Engine core initialization failed|See root cause above|EngineCore failed to start|"
    r"Engine process failed to start|See stack trace for root cause|"
    r"See stack trace \(above\) for the root cause|"
    r"Traceback \(most recent call last\)"
)
"""Lines that point at the cause instead of stating it."""
ENGINE_GONE = re.compile(
    r"engine core exited unexpectedly|Engine core process \S+ died unexpectedly|"
    r"(?:Worker|Engine core) proc \S+ died unexpectedly"
)
"""vLLM's API server noticing that its engine process vanished without a word (a kill -9, the OOM killer)."""
ENGINE_GONE_CAUSE = (
    "vLLM's engine process ended without logging why (killed by a signal such as SIGKILL, or by the "
    "kernel's out-of-memory killer)"
)
NOISE = re.compile(r"^(WARNING|INFO|DEBUG)\b|oneDNN|\[W\d+ |UserWarning|DeprecationWarning|FutureWarning")
"""Warnings and notes that are printed near a failure but are not its cause."""


def clean(line: str) -> str:
    """A log line without colours and without vLLM's process and logger prefixes."""
    return PREFIX.sub("", ANSI.sub("", line).strip()).strip()


def _candidates(text: str) -> list[str]:
    """The log's lines, cleaned, without those logged as warnings or notes and without known noise."""
    out = []
    for raw in text.splitlines():
        bare = ANSI.sub("", raw).strip()
        level = PREFIX.match(bare).group(3)
        line = clean(raw)
        if line and level not in ("WARNING", "INFO", "DEBUG") and not NOISE.search(line) and not WRAPPERS.search(line):
            out.append(line)
    return out


def root_cause(text: str) -> str | None:
    """The line that says why vLLM stopped: the last exception line that is not a wrapper, else the
    last "Error: ..." line; warnings and notes never count. An engine that vanished without a word is
    said so. None when the log states no error."""
    lines = _candidates(text)
    for pattern in (EXCEPTION, ERROR_WORD):
        for line in reversed(lines):
            if pattern.search(line) if pattern is ERROR_WORD else pattern.match(line):
                return line[-MAX_LINE:]
    if ENGINE_GONE.search(ANSI.sub("", text)):
        return ENGINE_GONE_CAUSE
    return None


def read(log: Path) -> str | None:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return None


def error_line(log: Path) -> str:
    """The most telling line of a failed start: its root cause, else the log's last line."""
    text = read(log)
    if text is None:
        return "(no log)"
    cause = root_cause(text)
    if cause is not None:
        return cause
    lines = [clean(line) for line in text.splitlines() if clean(line)]
    return lines[-1][-MAX_LINE:] if lines else "(empty log)"


def exit_reason(returncode: int, log: Path, when: str = "") -> str:
    """Why the server process ended, cause first: the signal that killed it, or the log's root cause.
    `when` (" during start-up") and the log's path follow in parentheses."""
    where = f"log: {log}"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"vLLM was killed by signal {-returncode} ({name}){when} ({where})"
    text = read(log)
    cause = root_cause(text) if text is not None else None
    if cause is None:
        return f"vLLM exited with code {returncode}{when}; its log states no error ({where})"
    return f"{cause} (vLLM exited with code {returncode}{when}; {where})"


def stages_in(log: Path) -> list[str]:
    """The start-up stages the log has reached, in the order they appeared."""
    text = read(log)
    if text is None:
        return []
    found = [(m.start(), name) for name, pattern in STAGES if (m := pattern.search(text))]
    return [name for _, name in sorted(found)]
