"""Reading a growing log file a piece at a time, and finding the line a failed start died on."""

from __future__ import annotations

from pathlib import Path

from bigmoe.serve.launch import error_line
from bigmoe.tui.text import printable

MAX_READ_BYTES = 1 << 20
"""Most bytes read per call, so a burst of logging never stalls the screen (bytes)."""


class LogTail:
    """Hands out the complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[str]:
        """New complete lines, made printable (a line still being written waits for its newline)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(MAX_READ_BYTES)
        except OSError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        return [printable(line.decode(errors="replace")) for line in lines]


def error_index(lines: list[str], log: Path) -> int | None:
    """Index in `lines` (the log made printable) of the line launch.error_line picks, searching from the end."""
    wanted = printable(error_line(log)).strip()
    if not wanted:
        return None
    for i in range(len(lines) - 1, -1, -1):
        if wanted in lines[i]:  # error_line keeps a long line's last 400 characters
            return i
    return None
