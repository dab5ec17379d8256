"""Reading a growing log file a piece at a time, and finding the line a failed start died on."""

from __future__ import annotations

from pathlib import Path

from bigmoe.launch import error_line

MAX_READ_BYTES = 1 << 20
"""Most bytes read per call, so a burst of logging never stalls the screen (bytes)."""


class LogTail:
    """Hands out the complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[str]:
        """New complete lines (a line still being written waits for its newline)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(MAX_READ_BYTES)
        except OSError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        return [line.decode(errors="replace").rstrip("\r") for line in lines]


def error_index(lines: list[str], log: Path) -> int | None:
    """Index in `lines` of the line launch.error_line picks for this log (the last one that matches)."""
    wanted = error_line(log)
    for i in range(len(lines) - 1, -1, -1):
        stripped = lines[i].strip()
        if stripped and stripped[-400:] == wanted:
            return i
    return None
