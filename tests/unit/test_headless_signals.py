"""`bigmoe run --yes` under signals, with a small real server standing in for vLLM (launch_driver.py runs
headless.launch_and_serve over launch_fake_server.py): the first Ctrl-C says at once that it stops the
server and does; a second one kills the group at once; SIGHUP leaves the server running with its record;
`bigmoe stop` from another shell ends the run with 0; a server that dies is reported by its cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from bigmoe import exit_codes
from bigmoe.serve import launch, records

DRIVER = str(Path(__file__).with_name("launch_driver.py"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    for info in records.live():  # a failed test leaves nothing running
        launch.kill(launch.Server.of(info))


class Run:
    """The driver as a child process: its JSON lines as they come, with the time each arrived."""

    def __init__(self, *flags: str):
        self.port = launch.free_port()
        self.proc = subprocess.Popen(
            [sys.executable, DRIVER, str(self.port), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        self.events: list[tuple[float, dict]] = []

    def until(self, name: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the run ended before '{name}': {self.proc.stderr.read()[-2000:]}")
            event = json.loads(line)
            self.events.append((time.monotonic(), event))
            if event["event"] == name:
                return event
        raise AssertionError(f"no '{name}' within {timeout} s")

    def signal(self, signum: int) -> float:
        self.proc.send_signal(signum)
        return time.monotonic()

    def finish(self, timeout: float = 60) -> int:
        out, self.stderr = self.proc.communicate(timeout=timeout)
        self.events += [(time.monotonic(), json.loads(line)) for line in out.splitlines() if line.startswith("{")]
        return self.proc.returncode

    def names(self) -> list[str]:
        return [e["event"] for _, e in self.events]


def nothing_left(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return records.live() == [] and not list(records.run_dir().glob("*.json"))


def child_of(log: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in Path(log).read_text().splitlines():
            if line.startswith("child pid "):
                return int(line.split()[-1])
        time.sleep(0.1)
    raise AssertionError("no child pid in the log")


def test_first_ctrl_c_while_serving_says_stopping_at_once_and_stops(home):
    run = Run("--child")
    launch_event = run.until("launch")
    run.until("ready")
    child = child_of(launch_event["log"])
    sent = run.signal(signal.SIGINT)
    stopping = run.until("stopping", timeout=5)
    assert run.events[-1][0] - sent < 1.0, "the stopping line comes at once"
    assert stopping["pid"] == launch_event["pid"] and "Ctrl-C again" in stopping["hint"]
    assert run.finish() == exit_codes.INTERRUPTED
    assert "stopped" in run.names()
    assert nothing_left([launch_event["pid"], child])


def test_second_ctrl_c_during_start_up_kills_the_group_at_once(home):
    run = Run("--child", "--ignore-term", "--listen-after", "60")  # SIGTERM alone would take the 15 s grace
    launch_event = run.until("launch")
    child = child_of(launch_event["log"])
    run.signal(signal.SIGINT)
    run.until("stopping", timeout=5)
    sent = run.signal(signal.SIGINT)
    assert run.finish(timeout=30) == exit_codes.INTERRUPTED, run.stderr
    assert time.monotonic() - sent < 8, "the second Ctrl-C does not wait out the grace period"
    assert "killed" in run.names()
    assert nothing_left([launch_event["pid"], child])


def test_sighup_leaves_the_server_running_with_its_record(home):
    run = Run("--child")
    launch_event = run.until("launch")
    run.until("ready")
    run.signal(signal.SIGHUP)
    assert run.finish() == exit_codes.HANGUP
    [info] = records.live()
    assert info.pid == launch_event["pid"] and info.record.exists()
    assert "SIGHUP" in Path(info.log).read_text() and "bigmoe stop" in Path(info.log).read_text()
    child = child_of(info.log)
    launch.stop(launch.Server.of(info))
    assert nothing_left([info.pid, child])


def test_bigmoe_stop_from_another_shell_ends_the_run_with_0(home):
    run = Run()
    run.until("ready")
    launch.stop(launch.Server.of(records.one("fake")))
    assert run.finish() == exit_codes.OK
    assert run.events[-2][1] == {"event": "stopped", "time": run.events[-2][1]["time"], "by": "bigmoe stop"}


def test_a_server_killed_while_serving_is_reported_by_its_signal(home):
    run = Run()
    launch_event = run.until("launch")
    run.until("ready")
    os.kill(launch_event["pid"], signal.SIGKILL)
    assert run.finish() == exit_codes.ERROR
    assert run.stderr.startswith("bigmoe: vLLM was killed by signal 9 (SIGKILL) while serving")
    assert nothing_left([launch_event["pid"]])
