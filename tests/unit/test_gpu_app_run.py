"""scripts/gpu_app_run.py's last check: what of a stopped server's sessions is still there, running or only exited."""

from __future__ import annotations

import subprocess
import time

import gpu_app_run  # scripts/ is on pytest's pythonpath (pyproject)
import psutil


def wait_for_status(pid: int, status: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != status:
        assert time.monotonic() < deadline, f"pid {pid} never became {status}"
        time.sleep(0.05)


def wait_for_exec(pid: int, cmdline: list[str], timeout_s: float = 10.0) -> None:
    """Until the forked child has exec'd `cmdline` (before that it still shows its parent's)."""
    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).cmdline() != cmdline:
        assert time.monotonic() < deadline, f"pid {pid} never ran {cmdline}"
        time.sleep(0.02)


def test_a_running_process_of_the_session_fails_the_run_and_an_exited_one_is_reported_apart():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)  # its own session, as vLLM's server has
    try:
        wait_for_exec(proc.pid, ["sleep", "30"])  # a loaded machine may list it before its exec
        running, exited = gpu_app_run.leftovers(proc.pid)
        assert [line.split()[0] for line in running] == [str(proc.pid)] and "sleep 30" in running[0]
        assert exited == []
        proc.kill()
        wait_for_status(proc.pid, psutil.STATUS_ZOMBIE)  # ended, not yet reaped by its parent (us)
        running, exited = gpu_app_run.still_running([proc.pid], settle_s=0.5)
        assert running == [] and [line.split()[0] for line in exited] == [str(proc.pid)]
    finally:
        proc.kill()
        proc.wait()
    assert gpu_app_run.leftovers(proc.pid) == ([], [])
