"""launch: vLLM as a child in a session of its own, ready when /health answers, stopped as a group.

The server is started from the plan's argv exactly (a list, never a shell string), with secrets
in its environment only. It logs to a file of its own (created 0600) and has a record
(bigmoe.serve.records) from its start until it is gone, so `bigmoe ps/stop/logs` find it from any
shell. Stopping is SIGTERM to its process group, a wait for every member (children included),
then SIGKILL to whatever is left: nothing it started outlives it.
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

from bigmoe.errors import BigmoeError
from bigmoe.serve import records
from bigmoe.serve.records import RunInfo
from bigmoe.serve.vllm_log import STAGES, error_line, exit_reason, stages_in

__all__ = [
    "STAGES",
    "LaunchError",
    "RunInfo",
    "Server",
    "error_line",
    "free_port",
    "kill",
    "port_free",
    "stages_in",
    "start",
    "stop",
    "wait_ready",
]

STOP_GRACE_S = 15.0
"""How long the group gets to exit after SIGTERM before SIGKILL (s); vLLM usually needs 1-5 s."""
KILL_WAIT_S = 5.0
"""How long SIGKILLed processes get to disappear (s)."""
POLL_S = 0.2
"""Step of the waits for a process to end (s)."""


class LaunchError(BigmoeError):
    """The server could not start, stopped during start-up, or could not be stopped."""


@dataclass
class Server:
    """A started server: its record and, in the shell that started it, its process."""

    info: RunInfo
    proc: subprocess.Popen | None
    """The child process (None when the server was found through its record)."""
    runfile: Path
    """Its record (gone once someone stopped it)."""

    @property
    def endpoint(self) -> str:
        return self.info.endpoint

    @property
    def command(self) -> list[str]:
        """The argv the server was started with (empty when found through its record)."""
        return [str(a) for a in self.proc.args] if self.proc is not None else []

    @classmethod
    def of(cls, info: RunInfo) -> "Server":
        return cls(info, None, info.record)


def port_free(host: str, port: int) -> bool:
    return bind_error(host, port) is None


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not bind (host, port) now (EADDRINUSE: the port is taken; a gaierror or
    EADDRNOTAVAIL: the host is no address of this machine), or None when it could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
        except (TypeError, UnicodeError):  # a host name that is not text a resolver takes
            return OSError(errno.EINVAL, "not a valid host name")
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict[str, str], info: RunInfo, secret_env: dict[str, str] | None = None) -> Server:
    """Start the server in its own session and write its record; return at once (see wait_ready).

    `argv` is run as given and written as the log's first line; `secret_env` (the API key) reaches
    the server's environment only, never its argv, the log or the record. Prometheus multiprocess
    mode gets a fresh directory, so the pager's series from the engine's processes reach /metrics."""
    if not port_free(info.host, info.port):
        raise LaunchError(f"port {info.port} on {info.host} is in use; pick another with --port")
    records.prune_logs()
    metrics = Path(info.log).with_suffix(".metrics")
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir(parents=True)
    info.metrics_dir = str(metrics)
    full_env = {**os.environ, **env, "PROMETHEUS_MULTIPROC_DIR": str(metrics), **(secret_env or {})}
    with records.open_log(Path(info.log)) as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    info.pid = proc.pid
    info.create_time = psutil.Process(proc.pid).create_time()  # readable even if it already exited (unreaped)
    records.save(info)
    return Server(info, proc, info.record)


def wait_ready(server: Server, timeout_s: float, on_stage: Callable[[str], None] = lambda s: None) -> None:
    """Block until /health answers 200; report each start-up stage once as it appears in the log.
    Raises LaunchError (the cause first: the log's root cause, or the signal that killed it) if the
    server exits, or, after stopping it, if the time runs out."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            for stage in stages_in(Path(server.info.log)):
                if stage not in seen:
                    seen.add(stage)
                    on_stage(stage)
            code = server.proc.poll() if server.proc is not None else None
            if code is not None:
                raise LaunchError(exit_reason(code, Path(server.info.log), " during start-up"))
            try:
                if client.get(server.endpoint + "/health").status_code == 200:
                    if "serving" not in seen:
                        on_stage("serving")
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                stop(server)
                raise LaunchError(
                    f"vLLM did not answer /health within {timeout_s:.0f} s; stopped it (log: {server.info.log})"
                )
            time.sleep(0.5)


def stop(server: Server, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group, SIGKILL after grace_s; then its record and metrics go.
    LaunchError if a process of the group survives SIGKILL (the record is kept so `bigmoe ps` shows it)."""
    records.mark_stopping(server.info)
    left = end_group(server.info, grace_s)
    if server.proc is not None:
        try:
            server.proc.wait(timeout=KILL_WAIT_S)  # reap our child, so it is not left a zombie
        except subprocess.TimeoutExpired:
            left = left or [server.proc.pid]
    if left:
        raise LaunchError(
            f"processes {', '.join(map(str, left))} of the server (pid {server.info.pid}) did not exit after SIGKILL"
        )
    records.remove(server.info)
    if server.info.metrics_dir:
        shutil.rmtree(server.info.metrics_dir, ignore_errors=True)


def kill(server: Server) -> None:
    """SIGKILL to the whole group at once (the second Ctrl-C), then as stop()."""
    stop(server, grace_s=0.0)


def signal_group(info: RunInfo, signum: int) -> None:
    """Send `signum` to every process of the server now (no wait)."""
    _signal(info.pid, group(info), signum)


def end_group(info: RunInfo, grace_s: float) -> list[int]:
    """SIGTERM (none when grace_s is 0) then SIGKILL to every process of the server; the pids still alive."""
    procs = group(info)
    if grace_s > 0:
        _signal(info.pid, procs, signal.SIGTERM)
        procs = _wait_gone(procs, grace_s)
    if procs:
        _signal(info.pid, procs, signal.SIGKILL)
        procs = _wait_gone(procs, KILL_WAIT_S)
    return [p.pid for p in procs]


def group(info: RunInfo) -> list[psutil.Process]:
    """The server and every process it started: its descendants, and members of its process group
    whose parent is gone (an engine process orphaned by a `kill -9` of the server)."""
    found: dict[int, psutil.Process] = {}
    leader = records.process_of(info)
    if leader is not None:
        found[leader.pid] = leader
        for child in _children(leader):
            found[child.pid] = child
    elif _pid_taken(info.pid):
        return []  # the pid (so the group id) belongs to another process now; nothing of ours is left under it
    for proc in psutil.process_iter(["create_time"]):
        try:
            born_after = proc.info["create_time"] >= info.create_time - records.CREATE_TIME_SLACK_S
            if os.getpgid(proc.pid) == info.pid and born_after:
                found.setdefault(proc.pid, proc)
        except (ProcessLookupError, PermissionError, TypeError):
            continue
    return [p for p in found.values() if _running(p)]


def _pid_taken(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _signal(pgid: int, procs: list[psutil.Process], signum: int) -> None:
    """To the group, and to each member on its own (one that left the group still gets it)."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
    for proc in procs:
        try:
            proc.send_signal(signum)
        except psutil.Error:
            pass


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to timeout_s for procs to end; those still running (a zombie counts as ended)."""
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive:
        _, alive = psutil.wait_procs(alive, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
        alive = [p for p in alive if _running(p)]
        if time.monotonic() >= deadline:
            break
    return alive


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
