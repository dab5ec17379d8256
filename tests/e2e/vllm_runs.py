"""One greedy vLLM run per configuration, each in a process of its own, for the e2e tests.

`greedy_run` answers like `subprocess.run([python, greedy_tokens.py, ...])`. Within one pytest process the
runs go through a fork server (`greedy_tokens.py --fork-server`) that imported vLLM once: each run is still
a new process with its own environment, in which vLLM loads the plugins afresh, but it skips the ~15 s of
imports that every e2e engine paid on CI's two cores. If the server cannot start or refuses (vLLM's
plugins already loaded in it), every run falls back to a plain new interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

RUNNER = Path(__file__).with_name("greedy_tokens.py")
RUN_TIMEOUT_S = 600


def greedy_run(model: Path, max_tokens: int, prompts: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """vLLM greedy tokens of `prompts` on `model`; env is the run's whole environment."""
    argv = [str(model), str(max_tokens), *prompts]
    server = _server(env)
    if server is not None:
        reply = server.run(argv, env)
        if reply is not None:
            return subprocess.CompletedProcess(argv, reply["returncode"], reply["stdout"], reply["stderr"])
    return subprocess.run(
        [sys.executable, str(RUNNER), *argv], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


class ForkServer:
    """greedy_tokens.py --fork-server, spoken to in JSON lines; None from run() means it is gone."""

    def __init__(self, env: dict[str, str]):
        self.log = tempfile.NamedTemporaryFile(prefix="greedy-fork-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "--fork-server"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lock = threading.Lock()
        hello = self._answer()
        self.ready = bool(hello and hello.get("ready"))

    def run(self, argv: list[str], env: dict[str, str]) -> dict | None:
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps({"argv": argv, "env": env}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                return None
            return self._answer()

    def _answer(self) -> dict | None:
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)


_started: ForkServer | None = None
_lock = threading.Lock()


def _server(env: dict[str, str]) -> ForkServer | None:
    """This pytest process's fork server, started at the first run (None: plain processes only)."""
    global _started
    if os.environ.get("BIGMOE_TEST_NO_FORK_SERVER") == "1":
        return None
    with _lock:
        if _started is None:
            _started = ForkServer({k: v for k, v in env.items() if not k.startswith("BIGMOE_")})
            atexit.register(_started.close)
    return _started if _started.ready else None
