"""One bigmoe process at a time writes a downloaded repo: a `bigmoe pull` (or `run`'s fetch), a `bigmoe rm` and a
`bigmoe verify` that removes bad files, in two shells, never meet in the same files.

The lock is a flock (filelock) on the repo's `bigmoe-fetch.lock`: a second writer is refused within a second with
the holder's pid and command line, which the holder writes into the lock file when it takes it. The kernel drops a
flock when its process dies, so a killed pull never leaves the repo locked. Readers (`bigmoe list`, `verify --keep`)
only probe it with a shared flock, which two readers can hold at once.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from typing import Iterator

import psutil
from filelock import FileLock, Timeout

from bigmoe.errors import BigmoeError
from bigmoe.model.hubcache import RepoCache

WAIT_S = 1.0
"""Seconds a writer waits for the lock before it is refused: far longer than a reader's probe holds it."""
LOCK_MODE = 0o664
"""The lock file's permissions: a hub cache shared by a group stays lockable by each of its users (as
huggingface_hub's own lock files)."""
PID_SLACK_S = 0.5
"""Seconds a process may seem to start after it wrote its pid (its start time is kept in clock ticks)."""


class RepoBusy(BigmoeError):
    """Another process holds the repo's lock; the message names it."""


class LockFailed(BigmoeError):
    """The repo's lock file cannot be made or opened here (a read-only cache, another user's file)."""


@contextmanager
def exclusive(cache: RepoCache) -> Iterator[None]:
    """Hold the repo's lock for the block; RepoBusy after WAIT_S if another process holds it."""
    lock = FileLock(cache.lock, mode=LOCK_MODE, preserve_lock_file=True, on_acquired=_write_pid)
    # preserve_lock_file: a lock file unlinked on release could let two writers lock two inodes of one path
    try:
        cache.lock.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=WAIT_S)
    except Timeout:
        raise RepoBusy(f"{holder(cache)} is writing {cache.repo_id} in {cache.root}") from None
    except OSError as e:
        raise LockFailed(
            f"cannot lock {cache.lock}: {e.strerror or e}; bigmoe needs to write there to change {cache.repo_id} "
            "(pass a writable --cache-dir)"
        ) from None
    try:
        yield
    finally:
        lock.release()


def busy(cache: RepoCache) -> bool:
    """Another process writes the repo now (holds its lock). A shared flock for an instant: readers never see each
    other, and a writer that starts meanwhile waits WAIT_S at most."""
    try:
        fd = os.open(cache.lock, os.O_RDONLY)
    except OSError:  # no lock file: no bigmoe has written this repo
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and the shared lock with it


def _write_pid(fd: int) -> None:
    data = f"{os.getpid()}\n".encode()
    os.pwrite(fd, data, 0)  # before the truncation, so the file is never empty while held
    os.ftruncate(fd, len(data))


def holder(cache: RepoCache) -> str:
    """'pid N (its command line)' of the process that holds the lock, or 'another process' when the file does not
    say (an older bigmoe) or names a pid that a later process took over."""
    try:
        pid = int(cache.lock.read_text().split()[0])
        process = psutil.Process(pid)
        if process.create_time() > cache.lock.stat().st_mtime + PID_SLACK_S:
            return "another process"
        return f"pid {pid} ({_command(process.cmdline())})"
    except (OSError, ValueError, IndexError, psutil.Error):
        return "another process"


COMMAND_CHARS = 80
"""The most of the holder's command line an error line quotes."""


def _command(argv: list[str]) -> str:
    """The command as its user typed it, on one line: from the `bigmoe` script on (not the interpreter's path),
    three words, at most COMMAND_CHARS."""
    names = [os.path.basename(a) for a in argv]
    start = names.index("bigmoe") if "bigmoe" in names else 0
    words = " ".join(" ".join([names[start], *argv[start + 1 : start + 3]]).split())
    return words if len(words) <= COMMAND_CHARS else words[: COMMAND_CHARS - 3] + "..."
