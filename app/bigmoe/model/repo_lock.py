"""One bigmoe process at a time writes a downloaded repo: a `bigmoe pull` (or `run`'s fetch) and a `bigmoe rm` in
two shells never meet in the same files.

The lock is a flock (filelock) on the repo's `bigmoe-fetch.lock`: a second writer is refused within a second with
the holder's pid and command line, which the holder writes into the lock file when it takes it. The
kernel drops a flock when its process dies, so a killed pull never leaves the repo locked.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import psutil
from filelock import FileLock, Timeout

from bigmoe.model.hubcache import RepoCache

WAIT_S = 1.0
"""Seconds a writer waits for the lock before it is refused: far longer than `bigmoe list`'s probe holds it."""


class RepoBusy(Exception):
    """Another process holds the repo's lock; the message names it."""


@contextmanager
def exclusive(cache: RepoCache) -> Iterator[None]:
    """Hold the repo's lock for the block; RepoBusy after WAIT_S if another process holds it."""
    cache.lock.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(cache, on_acquired=_write_pid)
    try:
        lock.acquire(timeout=WAIT_S)
    except Timeout:
        raise RepoBusy(f"{holder(cache)} is writing {cache.repo_id} in {cache.root}") from None
    try:
        yield
    finally:
        lock.release()


def busy(cache: RepoCache) -> bool:
    """Another process holds the repo's lock now: a download or removal is under way. The probe takes the lock
    for an instant without waiting (a writer meanwhile waits WAIT_S) and leaves the holder's pid in place."""
    if not cache.lock.is_file():
        return False
    lock = _lock(cache)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return True
    except OSError:  # the lock cannot be opened from here (a read-only cache): no bigmoe of ours writes there
        return False
    lock.release()
    return False


def _lock(cache: RepoCache, **options) -> FileLock:
    # preserve_lock_file: a lock file unlinked on release could let two writers lock two inodes of one path
    return FileLock(cache.lock, preserve_lock_file=True, **options)


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def holder(cache: RepoCache) -> str:
    """'pid N (its command line)', or 'another process' when the lock file does not say (an older bigmoe)."""
    try:
        pid = int(cache.lock.read_text().split()[0])
        return f"pid {pid} ({_command(psutil.Process(pid).cmdline())})"
    except (OSError, ValueError, IndexError, psutil.Error):
        return "another process"


def _command(argv: list[str]) -> str:
    """The command as its user typed it: from the `bigmoe` script on (not the interpreter's path), three words."""
    names = [os.path.basename(a) for a in argv]
    start = names.index("bigmoe") if "bigmoe" in names else 0
    return " ".join([names[start], *argv[start + 1 : start + 3]])
