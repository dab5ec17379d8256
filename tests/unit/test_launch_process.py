"""Servers as processes: one record per server until it is gone, stop ends the whole group, failures
say their cause first, secrets stay out of argv/logs/records. A small real server
(launch_fake_server.py) stands in for vLLM: what is under test is the process handling."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from bigmoe.cli.commands import cli
from bigmoe.serve import launch, records
from click.testing import CliRunner

FAKE = str(Path(__file__).with_name("launch_fake_server.py"))


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A BIGMOE_HOME of its own; every server a test started is killed at the end."""
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    while STARTED:
        server = STARTED.pop()
        for proc in launch.group(server.info):
            proc.kill()
        server.proc.kill()
        server.proc.wait()


STARTED: list[launch.Server] = []
"""Servers the running test started."""


def start(port: int, *flags: str, name: str = "tiny-moe", secret: dict | None = None) -> launch.Server:
    info = records.RunInfo(
        name=name,
        pid=0,
        host="127.0.0.1",
        port=port,
        log=str(records.log_name(name, port, time.strftime("%Y%m%d-%H%M%S"))),
        model_path="/nowhere",
        served_name=name,
        started=time.time(),
    )
    server = launch.start([sys.executable, FAKE, str(port), *flags], {}, info, secret)
    STARTED.append(server)
    return server


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def child_pid(server: launch.Server) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in Path(server.info.log).read_text().splitlines():
            if line.startswith("child pid "):
                return int(line.split()[-1])
        time.sleep(0.1)
    raise AssertionError("the fake server never started its child")


def test_a_second_server_of_the_same_model_keeps_the_first_ones_record():
    first = start(launch.free_port())
    launch.wait_ready(first, 30)
    failed = start(launch.free_port(), "--exit", "1")  # a second run of the same model that fails to start
    with pytest.raises(launch.LaunchError):
        launch.wait_ready(failed, 30)
    launch.stop(failed)
    assert [i.pid for i in records.live()] == [first.info.pid]
    assert first.runfile.exists() and first.runfile != failed.runfile
    second = start(launch.free_port())
    launch.wait_ready(second, 30)
    assert {i.pid for i in records.live()} == {first.info.pid, second.info.pid}
    launch.stop(second)
    assert [i.pid for i in records.live()] == [first.info.pid] and not gone(first.info.pid)
    launch.stop(first)
    assert records.live() == []


def test_stop_ends_the_group_children_included_even_when_sigterm_is_ignored():
    server = start(launch.free_port(), "--child", "--ignore-term")
    launch.wait_ready(server, 30)
    child = child_pid(server)
    assert {p.pid for p in launch.group(server.info)} == {server.info.pid, child}
    t0 = time.monotonic()
    launch.stop(server, grace_s=1.0)
    assert time.monotonic() - t0 < 8, "SIGKILL follows the grace period"
    assert gone(server.info.pid) and gone(child)
    assert not server.runfile.exists() and not Path(server.info.metrics_dir).exists()


def test_an_engine_orphaned_by_kill_9_of_the_server_is_still_stopped():
    server = start(launch.free_port(), "--child")
    launch.wait_ready(server, 30)
    child = child_pid(server)
    os.kill(server.info.pid, signal.SIGKILL)
    server.proc.wait()
    assert not gone(child)
    launch.stop(launch.Server.of(server.info), grace_s=2.0)
    assert gone(child) and not server.runfile.exists()


def test_kill_9_during_start_up_names_the_signal_not_a_log_line():
    server = start(launch.free_port(), "--listen-after", "60")
    threading.Timer(1.0, os.kill, (server.info.pid, signal.SIGKILL)).start()
    with pytest.raises(launch.LaunchError) as failure:
        launch.wait_ready(server, 60)
    assert str(failure.value).startswith("vLLM was killed by signal 9 (SIGKILL) during start-up")
    assert "onednn" not in str(failure.value).lower()
    launch.stop(server)


def test_an_engine_failure_puts_its_cause_first():
    server = start(launch.free_port(), "--exit", "1")
    with pytest.raises(launch.LaunchError) as failure:
        launch.wait_ready(server, 30)
    assert str(failure.value).startswith("ValueError: fake engine failure (vLLM exited with code 1 during start-up")
    launch.stop(server)


def test_stale_records_are_removed_and_a_reused_pid_is_left_alone(home):
    bystander = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = records.RunInfo("tiny-moe", 2**22 + 7, "127.0.0.1", 1, "/x.log", "/m", "tiny-moe", 0.0, create_time=1.0)
        reused = records.RunInfo(
            "tiny-moe",
            bystander.pid,
            "127.0.0.1",
            2,
            "/y.log",
            "/m",
            "tiny-moe",
            0.0,
            create_time=bystander.create_time() - 100,
        )
        for info in (dead, reused):
            records.save(info)
        assert records.live() == []
        assert not dead.record.exists() and not reused.record.exists()
        assert launch.group(reused) == []  # nothing to signal: the pid is someone else's now
        assert bystander.is_running()
    finally:
        bystander.kill()
        bystander.wait()


def test_servers_are_named_by_model_port_or_pid_and_ambiguity_is_one_line():
    a, b = start(launch.free_port()), start(launch.free_port())
    for server in (a, b):
        launch.wait_ready(server, 30)
    with pytest.raises(records.NoSuchServer) as ambiguous:
        records.one("tiny-moe")
    message = str(ambiguous.value)
    assert "\n" not in message and f"port {a.info.port} pid {a.info.pid}" in message and f"pid {b.info.pid}" in message
    assert records.one(str(a.info.port)).pid == a.info.pid
    assert records.one(str(b.info.pid)).pid == b.info.pid
    runner = CliRunner()
    ps = runner.invoke(cli, ["ps"])
    assert ps.exit_code == 0 and str(a.info.port) in ps.output and str(b.info.port) in ps.output
    stopped = runner.invoke(cli, ["stop", str(a.info.port)])
    assert stopped.exit_code == 0 and gone(a.info.pid) and not gone(b.info.pid)
    stopped = runner.invoke(cli, ["stop", "--all"])
    assert stopped.exit_code == 0 and gone(b.info.pid) and records.live() == []


@pytest.mark.parametrize("follow", [[], ["--follow"]])
def test_logs_are_read_after_the_server_has_exited(follow):
    server = start(launch.free_port(), "--exit", "3")
    with pytest.raises(launch.LaunchError):
        launch.wait_ready(server, 30)
    launch.stop(server)
    for target in ("tiny-moe", str(server.info.port)):
        shown = CliRunner().invoke(cli, ["logs", target, "-n", "0", *follow])  # a follow of a gone server: no wait
        assert shown.exit_code == 0 and "fake engine failure" in shown.output
    assert records.last_log(None) == Path(server.info.log)
    with pytest.raises(records.NoSuchServer, match="no bigmoe run has a log for other-model"):
        records.last_log("other-model")


def test_logs_follow_prints_the_lines_a_running_server_writes_later_and_ends_when_it_stops():
    server = start(launch.free_port(), "--listen-after", "2")  # "startup complete" comes 2 s after its first lines
    while not Path(server.info.log).exists() or b"version" not in Path(server.info.log).read_bytes():
        time.sleep(0.05)
    shown = {}
    reader = threading.Thread(target=lambda: shown.update(out=CliRunner().invoke(cli, ["logs", "--follow"])))
    reader.start()
    launch.wait_ready(server, 30)
    time.sleep(0.5)  # a poll or two to print the ready line
    assert reader.is_alive()  # following while the server runs
    launch.stop(server)
    reader.join(10)
    assert not reader.is_alive()  # ended with the server
    out = shown["out"]
    assert out.exit_code == 0, out.output
    assert out.output.count("vLLM API server version") == 1 and out.output.count("Application startup complete") == 1


def test_the_api_key_reaches_the_server_by_environment_only_and_files_are_private():
    old = os.umask(0o022)
    try:
        server = start(launch.free_port(), secret={"VLLM_API_KEY": "sk-very-secret"})
        launch.wait_ready(server, 30)
    finally:
        os.umask(old)
    proc = psutil.Process(server.info.pid)
    assert not any("sk-very-secret" in arg for arg in proc.cmdline())
    assert proc.environ().get("VLLM_API_KEY") == "sk-very-secret"
    for path in (Path(server.info.log), server.runfile):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert "sk-very-secret" not in path.read_text()
    assert "VLLM_API_KEY is set" in Path(server.info.log).read_text()
    assert json.loads(server.runfile.read_text())["pid"] == server.info.pid
    launch.stop(server)


def test_ps_says_which_servers_serve_and_which_are_still_starting():
    ready, late = start(launch.free_port()), start(launch.free_port(), "--listen-after", "60")
    launch.wait_ready(ready, 30)
    runner = CliRunner()
    listed = runner.invoke(cli, ["ps", "--json"])
    assert listed.exit_code == 0
    state = {row["pid"]: row["state"] for row in json.loads(listed.output)}
    assert state == {ready.info.pid: "serving", late.info.pid: "starting"}
    lines = runner.invoke(cli, ["ps"]).output.splitlines()
    assert any(f"pid {ready.info.pid}\t" in line and "\tserving\t" in line for line in lines)
    assert any(f"pid {late.info.pid}\t" in line and "\tstarting\t" in line for line in lines)
    runner.invoke(cli, ["stop", "--all"])
    assert json.loads(runner.invoke(cli, ["ps", "--json"]).output) == []


def test_old_logs_are_pruned_but_never_one_a_running_server_writes():
    logs = [records.log_name("tiny-moe", 8000 + i % 2, f"20260101-0000{i:02d}") for i in range(8)]
    for path in logs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("log\n")
        path.with_suffix(".metrics").mkdir()
    me = psutil.Process(os.getpid())
    still_running = records.RunInfo("tiny-moe", me.pid, "127.0.0.1", 8000, str(logs[0]), "/m", "tiny-moe", 0.0)
    still_running.create_time = me.create_time()
    records.save(still_running)
    assert records.prune_logs(keep=3) == logs[1:5]
    assert [p for p in logs if p.exists()] == [logs[0], *logs[5:]]
    assert not any(p.with_suffix(".metrics").exists() for p in logs[1:5]) and logs[0].with_suffix(".metrics").exists()
    assert records.last_log("8001") == logs[7] and records.last_log(None) == logs[0]
