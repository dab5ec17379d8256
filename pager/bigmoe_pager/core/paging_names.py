"""The names of a paging file's companions on disk, apart from the file's format so that listing them costs no
torch import: its damage marker, and the temporary files its builds write before renaming one into place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def damaged_marker(path: str | os.PathLike) -> Path:
    """The sidecar that marks a paging file damaged (it exists only while the file must not be trusted)."""
    path = Path(path)
    return path.with_name(path.name + ".damaged")


def partial_file(path: str | os.PathLike, pid: int) -> Path:
    """The temporary file process `pid` writes the paging file at `path` into, renamed into place when whole."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial-{pid}")


@dataclass(frozen=True)
class Partial:
    """A temporary file of a paging file that was never renamed into place."""

    path: Path
    """The file."""
    pid: int
    """The process that writes (or wrote) it."""
    writing: bool
    """Whether that process still runs (a build under way); else the build died and the file is only waste."""


def partial_files(path: str | os.PathLike) -> list[Partial]:
    """Every temporary file of the paging file at `path`: a build killed before its rename (SIGKILL, power loss)
    leaves one as large as the file it was writing, which nothing else would ever remove."""
    path = Path(path)
    prefix = partial_file(path, 0).name[:-1]
    found = []
    for tmp in sorted(path.parent.glob(f"{prefix}*")) if path.parent.is_dir() else []:
        pid = tmp.name[len(prefix) :]
        if pid.isdigit() and tmp.is_file():
            found.append(Partial(tmp, int(pid), _running(int(pid))))
    return found


def _running(pid: int) -> bool:
    if pid <= 0:
        return False  # no process has it (and kill(0) would signal this process group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds that pid
    return True
