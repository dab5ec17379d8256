"""records: one file per server bigmoe started, so `bigmoe ps/stop/logs` find it from any shell.

A record is named after its server (model, port and pid), never after the model alone, so a
second run of the same model cannot overwrite or delete the first one's. It lives until the
server is gone: whoever stops the server removes it, and a record whose process is dead (or
whose pid now belongs to another process, told apart by its create time) is removed when read.
Records and logs are created 0600: they hold paths and commands another user has no need to see.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_type_hints

import psutil

from bigmoe.errors import BigmoeError
from bigmoe.paths import log_dir, run_dir, write_atomic

CREATE_TIME_SLACK_S = 0.05
"""psutil create times of one process agree to the clock tick (10 ms); a reused pid differs by far more."""
LOGS_KEPT = 50
"""Run logs kept in the log directory, the newest (a start removes older ones; `bigmoe logs` reads the newest)."""
LOG_NAME = re.compile(r"^(?P<name>.+)-(?P<port>\d+)-(?P<stamp>\d{8}-\d{6})\.log$")
"""A run's log file name: model, port, start time (log_name makes it)."""


class NoSuchServer(BigmoeError):
    """No live server matches what the person named, or several do."""


@dataclass
class RunInfo:
    """What the record holds about one server."""

    name: str
    """Model name the server was started for."""
    pid: int
    """Process id of the server (also its process group id: it runs in a session of its own)."""
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
    """Unix time of the start (s)."""
    metrics_dir: str = ""
    """PROMETHEUS_MULTIPROC_DIR of this run (every vLLM process, the pager's too, writes its series there)."""
    create_time: float = 0.0
    """psutil's create time of the server process (Unix s): tells this process from a later one given the same pid."""
    stopped_by: int = 0
    """Pid of the bigmoe process stopping the server (0 = none): the run that started it tells a stop from a crash."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def record(self) -> Path:
        """The record file of this server."""
        return run_dir() / f"{self.name}-{self.port}-{self.pid}.json"


def log_name(name: str, port: int, stamp: str) -> Path:
    """Where a run's log goes: one file per start, findable by model and port after the server is gone."""
    return log_dir() / f"{name}-{port}-{stamp}.log"


def save(info: RunInfo) -> Path:
    """Write the record (atomically; created 0600)."""
    write_atomic(info.record, json.dumps(asdict(info), indent=1).encode())
    return info.record


def remove(info: RunInfo) -> None:
    info.record.unlink(missing_ok=True)


def mark_stopping(info: RunInfo) -> None:
    """Note in the record that this process is stopping the server (before the first signal is sent)."""
    if info.record.exists():
        info.stopped_by = os.getpid()
        save(info)


def stopped_elsewhere(record: Path) -> bool:
    """Whether another process (`bigmoe stop`) stopped the server: its record is gone or marked by another pid."""
    try:
        stopped_by = json.loads(record.read_text()).get("stopped_by", 0)
    except (OSError, ValueError, AttributeError):
        return True
    return stopped_by not in (0, os.getpid())


def process_of(info: RunInfo) -> psutil.Process | None:
    """The server's process if it still runs (a zombie counts as gone), else None."""
    try:
        proc = psutil.Process(info.pid)
        if abs(proc.create_time() - info.create_time) > CREATE_TIME_SLACK_S:
            return None  # the pid was reused by another process
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def live() -> list[RunInfo]:
    """Every server with a record whose process is alive, oldest first; stale records are removed."""
    out = []
    for path in sorted(run_dir().glob("*.json")):
        info = read_record(path)
        if info is None:
            continue  # not a record of this version (or a damaged one); left alone, never acted on
        if process_of(info) is None:
            path.unlink(missing_ok=True)
        else:
            out.append(info)
    return sorted(out, key=lambda i: i.started)


_FIELD_TYPES = {name: (int, float) if kind is float else kind for name, kind in get_type_hints(RunInfo).items()}
"""The type each field of a record must have (JSON writes 1.0 as 1: an int is a float here)."""


def read_record(path: Path) -> RunInfo | None:
    """The record at `path`, or None when it cannot be read or a field has the wrong type (a damaged record is
    never used: its pid could name an unrelated process)."""
    try:
        info = RunInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    for name, kind in _FIELD_TYPES.items():
        value = getattr(info, name)
        if isinstance(value, bool) or not isinstance(value, kind):
            return None
    if info.pid <= 0 or not 0 < info.port < 65536 or not all(map(math.isfinite, (info.started, info.create_time))):
        return None
    return info


def matching(infos: list[RunInfo], target: str | None) -> list[RunInfo]:
    """The servers `target` names: a model name, a port or a pid (all servers when None)."""
    if target is None:
        return list(infos)
    if target.isdigit():
        number = int(target)
        return [i for i in infos if number in (i.port, i.pid)]
    return [i for i in infos if target in (i.name, i.served_name)]


def one(target: str | None) -> RunInfo:
    """The one live server `target` names; NoSuchServer (one line) when none or several do."""
    infos = live()
    found = matching(infos, target)
    if not found:
        raise NoSuchServer("no bigmoe server is running" + (f" for {target}" if target else ""))
    if len(found) > 1:
        raise several(found, "name one by port or pid, or use --all")
    return found[0]


def several(found: list[RunInfo], fix: str) -> NoSuchServer:
    """The one-line error for a name that matches several live servers, listing them."""
    listed = ", ".join(f"{i.name} port {i.port} pid {i.pid}" for i in found)
    return NoSuchServer(f"{len(found)} servers match ({listed}); {fix}")


def last_log(target: str | None) -> Path:
    """The log of the live server `target` names, else the newest log of a run that matches it
    (model name or port): what `bigmoe logs` shows once the server has exited."""
    live_ones = matching(live(), target)
    if len(live_ones) == 1:
        return Path(live_ones[0].log)
    if len(live_ones) > 1:
        raise several(live_ones, "name one by port or pid")  # `logs` has no --all
    logs = [path for path, m in run_logs() if target is None or target in (m["name"], m["port"])]
    if not logs:
        raise NoSuchServer("no bigmoe run has a log" + (f" for {target}" if target else ""))
    return logs[0]


def run_logs() -> list[tuple[Path, re.Match]]:
    """Every run's log in the log directory with its name's parts (LOG_NAME), newest first (start time, then
    modification time)."""
    named = [(path, m) for path in log_dir().glob("*.log") if (m := LOG_NAME.match(path.name))]
    return sorted(named, key=lambda pm: (pm[1]["stamp"], pm[0].stat().st_mtime), reverse=True)


def prune_logs(keep: int = LOGS_KEPT) -> list[Path]:
    """Remove the oldest run logs beyond the newest `keep` (with a dead run's .metrics directory beside one),
    never a log a running server writes; the removed ones, oldest first."""
    writing = {Path(info.log) for info in live()}
    removed = [path for path, _ in reversed(run_logs()[keep:]) if path not in writing]
    for path in removed:
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_suffix(".metrics"), ignore_errors=True)
    return removed


def log_owner(path: Path) -> RunInfo | None:
    """The running server that writes the log at `path`, if one still does."""
    return next((info for info in live() if Path(info.log) == path), None)


def open_log(path: Path):
    """The log file for appending, created 0600 (never chmod-ed after: no moment where others may read it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
