"""`bigmoe run` end to end against real vLLM (CPU build) with the tiny model:
one prompt headless, with the command `bigmoe plan` printed; a served model watched,
listed, logged and stopped from another process, its API key kept secret, a second
run of the same model failing without losing it; bad input answered with one line."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from bigmoe.serve import launch
from bigmoe.serve.client import chat
from bigmoe.serve.watch import Watcher

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

BIGMOE = [sys.executable, "-m", "bigmoe.cli"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A BIGMOE_HOME of its own, so models, logs and runfiles do not touch the user's."""
    return tmp_path_factory.mktemp("bigmoe-home")


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")}
    env["BIGMOE_HOME"] = str(home)
    return env | extra


def bigmoe(home: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BIGMOE, *args], env=env_for(home, **env), capture_output=True, text=True, timeout=timeout)


def test_run_executes_the_printed_plan_answers_and_reports_tpot(home):
    port = launch.free_port()
    planned = bigmoe(home, "plan", "tiny-moe", "--json", "--port", str(port), timeout=300)
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    proc = bigmoe(
        home,
        "run",
        "tiny-moe",
        "--yes",
        "--json",
        "--port",
        str(port),
        "--prompt",
        "Tell me about the sea.",
        "--max-tokens",
        "24",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = next(e for e in events if e["event"] == "launch")
    assert started["command"] == shlex.join(plan["argv"]), "run executes the command bigmoe plan printed"
    assert Path(started["log"]).read_text().splitlines()[0] == "$ " + shlex.join(plan["argv"])
    answer = next(e for e in events if e["event"] == "answer")
    assert answer["text"].strip()
    assert answer["tpot_ms"] > 0 and answer["ttft_ms"] > 0
    assert [e["event"] for e in events][-1] == "stopped"
    assert launch.port_free("127.0.0.1", port), "the server must be gone after the answer"


def test_served_model_is_watched_listed_logged_and_stopped(home):
    port, key = launch.free_port(), "sk-e2e-secret"
    runner = subprocess.Popen(
        [*BIGMOE, "run", "tiny-moe", "--yes", "--json", "--port", str(port), "--vram-slots", "6", "--ram-slots", "10"],
        env=env_for(home, BIGMOE_API_KEY=key),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        started = _wait_for_event(runner, "launch", timeout=600)
        ready = _wait_for_event(runner, "ready", timeout=600)
        endpoint = ready["endpoint"]
        assert key not in json.dumps(started) + json.dumps(ready) and "$BIGMOE_API_KEY" in ready["curl"]
        ps = bigmoe(home, "ps")
        assert "tiny-moe" in ps.stdout and str(port) in ps.stdout
        pid = int(ps.stdout.split("pid ")[1].split()[0])
        server = psutil.Process(pid)
        assert all(key not in " ".join(p.cmdline()) for p in [server, *server.children(recursive=True)])
        assert server.environ()["VLLM_API_KEY"] == key
        for path in [Path(started["log"]), *(home / "run").glob("*.json")]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and key not in path.read_text()
        unauthorized = httpx.post(endpoint + "/v1/chat/completions", json={"model": "tiny-moe", "messages": []})
        assert unauthorized.status_code == 401

        # A second run of the same model that fails to start must not lose the first server.
        second = bigmoe(
            home, "run", "tiny-moe", "--yes", "--port", str(launch.free_port()), "--start-timeout", "5", timeout=300
        )
        assert second.returncode == 4 and "did not answer /health within 5 s" in second.stderr
        assert f":{port}" in bigmoe(home, "ps").stdout

        watcher = Watcher(endpoint)
        assert watcher.poll() is None  # the first scrape is the baseline, not a window of nanoseconds
        time.sleep(1.1)
        answer = chat(endpoint, "tiny-moe", "Say something about rivers.", max_tokens=16, api_key=key)
        assert answer.text.strip()
        window = watcher.poll()
        assert window.tpot_ms is not None and window.tpot_ms > 0
        assert window.tokens_per_s > 0
        sample = watcher.scrape()
        for key, lookups in sample.lookups.items():
            hits = sample.hits.get(key, 0.0)
            assert 0 <= hits <= lookups
        vram = [(k, v) for k, v in sample.lookups.items() if k[1] == "vram"]
        assert vram and sum(v for _, v in vram) > 0, "the pager's series must be in /metrics"
        # 6 VRAM and 10 RAM slots of 16 experts: every tier is looked up, and VRAM misses
        assert {"vram", "ram", "ssd"} <= set(window.hit_rate), window.hit_rate
        assert 0 < window.hit_rate["vram"] < 1
        metrics = httpx.get(endpoint + "/metrics").text
        assert "bigmoe_expert_bytes_total" in metrics and 'tier="ssd"' in metrics

        logs = bigmoe(home, "logs", str(port), "-n", "5")
        assert logs.returncode == 0 and logs.stdout.strip()

        stop = bigmoe(home, "stop", str(port), timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert runner.wait(timeout=120) == 0
        assert _group_gone(pid)
        assert "no bigmoe server is running" in bigmoe(home, "ps").stdout
        after = bigmoe(home, "logs", str(port), "-n", "0")
        assert after.returncode == 0 and after.stdout.startswith("$ ")  # the log outlives the server
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
        _kill_servers_of(home)


@pytest.mark.parametrize(
    "args,message,code",
    [
        (["run", "no-such-model", "--yes"], "unknown model 'no-such-model'", 1),
        (["run", "tiny-moe", "--yes", "--port", "0"], "Invalid value for '--port'", 2),
        (["run", "tiny-moe", "--yes", "--model-dir", "/nonexistent/ckpt"], "no readable config.json", 1),
        (["stop", "tiny-moe"], "no bigmoe server is running for tiny-moe", 1),
        (["run", "qwen3.8-flash-next", "--yes"], "plan refused", 3),
    ],
)
def test_bad_input_gets_one_line_and_a_nonzero_exit(home, args, message, code):
    proc = bigmoe(home, *args, timeout=120)
    assert proc.returncode == code
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_preset_file_gets_one_line(home, tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[model]\nname = 'x'\n")
    proc = bigmoe(home, "run", str(bad), "--yes")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"bigmoe: {bad} lacks the key 'arch'"]


def test_a_checkpoint_that_is_not_the_preset_is_refused_before_launch(home, tiny_checkpoint):
    tiny = sys.modules["make_tiny_moe"]
    other = tiny_checkpoint(
        tiny.TinyShape(layers=2, experts=24, top_k=6, hidden=128, moe_intermediate=64), "bf16", seed=3
    )
    proc = bigmoe(home, "run", "tiny-moe", "--yes", "--model-dir", str(other), timeout=300)
    assert proc.returncode == 1
    assert "but preset tiny-moe says experts = 16" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "no bigmoe server is running" in bigmoe(home, "ps").stdout


def test_missing_vllm_gets_one_line(home):
    """A fake of a missing vLLM: the module is blocked in sys.modules before the CLI runs."""
    code = (
        "import sys; sys.modules['vllm'] = None; from bigmoe.cli import main; "
        "main(['run', 'tiny-moe', '--yes', '--prompt', 'hi'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "bigmoe: vLLM is not installed in this Python environment; run installer/install.sh "
        "(or pip install 'bigmoe[cpu]' / 'bigmoe[cuda]')"
    ]


def test_port_in_use_is_refused_before_anything_starts(home):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = bigmoe(home, "run", "tiny-moe", "--yes", "--port", str(port), timeout=300)
    assert proc.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in proc.stderr
    assert "no bigmoe server is running" in bigmoe(home, "ps").stdout


def _wait_for_event(proc: subprocess.Popen, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"bigmoe run ended before '{name}': {proc.stderr.read()[-2000:]}")
        if line.startswith("{"):
            event = json.loads(line)
            if event["event"] == name:
                return event
    raise AssertionError(f"no '{name}' event within {timeout} s")


def _kill_servers_of(home: Path) -> None:
    """A failed test must not leave a server behind: stop every server whose runfile is in home."""
    for runfile in (home / "run").glob("*.json"):
        try:
            os.killpg(json.loads(runfile.read_text())["pid"], signal.SIGKILL)
        except (ProcessLookupError, ValueError, KeyError, OSError):
            pass


def _group_gone(pgid: int, within_s: float = 10.0) -> bool:
    """No process of the group runs any more. A zombie has ended (launch.stop counts it so too); whether init has
    reaped the orphaned engine processes yet is up to init, so they are not waited for."""
    deadline = time.monotonic() + within_s
    while True:
        running = []
        for proc in psutil.process_iter(["status"]):
            try:
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    running.append(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
        if not running or time.monotonic() > deadline:
            return not running
        time.sleep(0.2)
