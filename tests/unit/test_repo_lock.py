"""model/repo_lock.py: one bigmoe process at a time writes a download; readers only probe. (The lock against a real
`bigmoe pull` in another process: tests/unit/test_fetch.py.)"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest
from bigmoe.model import repo_lock
from bigmoe.model.hubcache import RepoCache


@pytest.fixture
def cache(tmp_path) -> RepoCache:
    return RepoCache(tmp_path / "hub", "Org/Name")


def test_a_readers_probe_is_not_a_writer_and_a_writer_waits_it_out(cache, monkeypatch):
    monkeypatch.setattr(repo_lock, "WAIT_S", 10.0)  # room for a late timer on a busy machine
    with repo_lock.exclusive(cache):
        pass  # the lock file now exists, as after any pull
    reader = os.open(cache.lock, os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)  # another reader, mid-probe
    try:
        assert not repo_lock.busy(cache), "two readers saw each other as a download"
        threading.Timer(0.2, os.close, [reader]).start()  # the probe ends within WAIT_S
        began = time.monotonic()
        with repo_lock.exclusive(cache):
            assert time.monotonic() - began > 0.1, "the writer did not wait for the reader's probe"
    finally:
        try:
            os.close(reader)
        except OSError:
            pass  # the timer closed it


def test_a_writer_in_another_process_is_busy_and_named(cache):
    code = (
        "import sys, time; from pathlib import Path; from bigmoe.model import repo_lock; "
        "from bigmoe.model.hubcache import RepoCache\n"
        "with repo_lock.exclusive(RepoCache(Path(sys.argv[1]), 'Org/Name')):\n"
        "    print('held', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(cache.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert repo_lock.busy(cache)
        with pytest.raises(repo_lock.RepoBusy, match=f"pid {child.pid} .* is writing Org/Name") as refused:
            with repo_lock.exclusive(cache):
                pass
        assert "\n" not in str(refused.value)  # its command line (a multi-line -c program) quoted on one line
    finally:
        child.kill()
        child.wait()
    assert not repo_lock.busy(cache), "a killed writer left the repo locked"


@pytest.mark.parametrize("written", ["before", "after"])
def test_the_holder_is_named_only_if_it_was_running_when_it_wrote_its_pid(cache, written):
    with repo_lock.exclusive(cache):
        pass
    cache.lock.write_text(f"{os.getpid()}\n")
    if written == "before":  # the pid was written before this process began: a later process took that pid
        os.utime(cache.lock, (0, 0))
    says = repo_lock.holder(cache)
    assert says == "another process" if written == "before" else says.startswith(f"pid {os.getpid()} (")


def test_a_lock_that_cannot_be_made_is_one_line_not_a_traceback(cache):
    cache.root.mkdir(parents=True)
    (cache.root / ".locks").write_text("not a folder")
    with pytest.raises(repo_lock.LockFailed, match="cannot lock .*--cache-dir") as failed:
        with repo_lock.exclusive(cache):
            pass
    assert "\n" not in str(failed.value)
    assert not repo_lock.busy(cache)
