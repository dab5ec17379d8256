"""A server's log as `bigmoe logs` shows it: the end of the file, then (--follow) each line as the server writes
it, until the server is gone."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bigmoe.errors import BigmoeError

POLL_S = 0.25
"""Seconds between looks at a followed log that had nothing new (a person reading lines never notices 0.25 s)."""


@dataclass(frozen=True)
class LogEnd:
    """A log as it stood when read."""

    lines: list[str]
    """Its whole lines (text; bytes that are not UTF-8 shown as replacement characters)."""
    partial: str
    """What follows the last newline: a line the server is still writing."""
    offset: int
    """Bytes up to the end of the last whole line: where following goes on."""


class LogUnreadable(BigmoeError):
    """The log a record or a log name points at cannot be read (deleted, moved, not a file)."""


def read_log(path: Path) -> LogEnd:
    """The log split on newlines only (as `follow` splits what comes after), its unterminated end kept apart."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LogUnreadable(
            f"cannot read the log {path}: {e.strerror or e}; it was deleted or moved "
            "(bigmoe ps lists the running servers' logs)"
        ) from None
    whole, newline, partial = data.rpartition(b"\n")
    lines = [line.decode(errors="replace") for line in whole.split(b"\n")] if newline else []
    return LogEnd(lines, partial.decode(errors="replace"), len(whole) + len(newline))


def follow(
    path: Path, offset: int, running: Callable[[], bool], write: Callable[[str], None], poll_s: float = POLL_S
) -> None:
    """Write each line appended to `path` after byte `offset` once its newline lands, until `running()` says the
    server is gone; then what it left, an unterminated last line included. `running` is asked before each read, so
    everything written before the server ended is read after it."""
    pending = b""
    with path.open("rb") as log:
        log.seek(offset)
        while True:
            alive = running()
            chunk = log.read()
            if chunk:
                *whole, pending = (pending + chunk).split(b"\n")
                for line in whole:
                    write(line.decode(errors="replace"))
            elif not alive:
                break
            else:
                time.sleep(poll_s)
    if pending:
        write(pending.decode(errors="replace"))
