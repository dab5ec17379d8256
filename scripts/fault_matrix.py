"""Fault matrix: replay each fault case of issue 17 against the real `bigmoe` command and report, per
case, the message the user sees, the exit code, stray processes and files left behind.

    python scripts/fault_matrix.py [--only CASE ...] [--out docs/bench/faults.md]

Every case runs in a BIGMOE_HOME of its own under a temporary directory, with real vLLM (CPU build)
where the case needs a server, the local Hub stand-in (tests/hubserver.py) where it needs a download,
and small tmpfs mounts for a full disk and for O_DIRECT refused (mounting needs root; those cases say
so when it is refused). A case reads "ok" when the message is one clear line, the exit code is what
the case expects, no process it started is left and no partial file is left. A script, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIGMOE = [sys.executable, "-m", "bigmoe.cli"]
from bigmoe import exit_codes  # noqa: E402

READY_S = 900.0  # seconds a CPU start may take on a loaded machine


@dataclass
class Row:
    """One case's outcome."""

    case: str
    message: str
    exit_code: int | None
    stray: list[str]
    files_left: list[str]
    ok: bool
    note: str = ""


class Case:
    """A BIGMOE_HOME of its own and the bigmoe processes started in it."""

    def __init__(self, root: Path, name: str):
        self.home = root / name
        self.home.mkdir(parents=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("BIGMOE_", "HF_"))}
        self.env.update(BIGMOE_HOME=str(self.home), HF_HUB_CACHE=str(self.home / "hf"))
        self.runners: list[subprocess.Popen] = []
        self.pids: set[int] = set()  # every process seen in a runner's tree

    def run(self, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*BIGMOE, *args], env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [*BIGMOE, *args],
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=ROOT,
        )
        self.runners.append(proc)
        return proc

    def wait_event(self, proc: subprocess.Popen, name: str, timeout: float = READY_S) -> dict | None:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.remember(proc.pid)
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    return None
                continue
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    self.remember(proc.pid)
                    return event
        return None

    def remember(self, pid: int) -> None:
        """Note a process and its descendants (vLLM runs in its own group, so track by tree, not group)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            self.pids.update(p.pid for p in [root, *root.children(recursive=True)])

    def stray(self) -> list[str]:
        """Processes this case started that are still alive (zombies of our own children reaped first)."""
        for proc in self.runners:
            proc.poll()
        alive = []
        for pid in sorted(self.pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {p.name()}")
        return alive

    def cleanup(self) -> None:
        subprocess.run([*BIGMOE, "stop", "--all"], env=self.env, capture_output=True, timeout=180)
        for pid in self.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()

    def partial_files(self) -> list[str]:
        """Files a crash may leave: partial downloads, partial paging files, temporary checkpoints."""
        left = []
        for p in self.home.rglob("*"):
            name = p.name
            if name.endswith(".incomplete") or ".partial" in name or name.endswith(".damaged"):
                left.append(str(p.relative_to(self.home)))
        return left

    def runfiles(self) -> list[str]:
        runs = self.home / "run"  # bigmoe.paths.run_dir under this case's BIGMOE_HOME
        return [str(p.relative_to(self.home)) for p in runs.glob("*.json")] if runs.is_dir() else []


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("{")]
    return lines[-1].strip() if lines else ""


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("bigmoe:") or '"event": "error"' in line]


def free_port() -> int:
    from bigmoe.serve.launch import free_port as pick

    return pick()


# -- the cases ----------------------------------------------------------------------------------------


def case_second_run(c: Case) -> Row:
    first = c.start("run", "tiny-moe", "--yes", "--json", "--port", str(free_port()))
    ready = c.wait_event(first, "ready")
    if ready is None:
        return Row(
            "second run of the same model", "first server never became ready", first.poll(), c.stray(), [], False
        )
    second = c.run("run", "tiny-moe", "--yes", "--port", str(free_port()), "--start-timeout", "5", timeout=900)
    ps = c.run("ps").stdout
    first_listed = str(ready["endpoint"].rsplit(":", 1)[1]) in ps
    stop = c.run("stop", "--all", timeout=300)
    first.wait(timeout=120)
    stray = c.stray()
    ok = first_listed and stop.returncode == 0 and not stray and len(error_lines(second.stderr)) <= 1
    return Row(
        "second run of the same model",
        last_line(second.stderr),
        second.returncode,
        stray,
        c.runfiles(),
        ok,
        f"first server listed by ps while the second failed: {first_listed}; stop --all rc {stop.returncode}",
    )


def case_double_ctrl_c(c: Case) -> Row:
    runner = c.start("run", "tiny-moe", "--yes", "--json", "--port", str(free_port()))
    if c.wait_event(runner, "launch", timeout=600) is None:
        return Row(
            "double Ctrl-C during start-up", "the server was never launched", runner.poll(), c.stray(), [], False
        )
    time.sleep(3)
    c.remember(runner.pid)
    runner.send_signal(signal.SIGINT)
    time.sleep(1)
    runner.send_signal(signal.SIGINT)
    code = runner.wait(timeout=120)
    time.sleep(2)
    out, err = runner.stdout.read(), runner.stderr.read()
    stray, runfiles = c.stray(), c.runfiles()
    # Killed by its own SIGINT (-2 here) is what a shell reports as 130, like exiting with 130.
    ok = code in (exit_codes.INTERRUPTED, -signal.SIGINT) and not stray and not runfiles
    said = " / ".join(line for line in (last_line(out), last_line(err)) if line)
    said = said or " / ".join(out.strip().splitlines()[-2:])  # --json: the last events, as printed
    return Row("double Ctrl-C during start-up", said, code, stray, runfiles, ok)


def case_sighup(c: Case) -> Row:
    runner = c.start("run", "tiny-moe", "--yes", "--json", "--port", str(free_port()))
    ready = c.wait_event(runner, "ready")
    if ready is None:
        return Row("SIGHUP (terminal closed)", "the server never became ready", runner.poll(), c.stray(), [], False)
    runner.send_signal(signal.SIGHUP)
    time.sleep(5)
    ps = c.run("ps").stdout.strip()
    tracked = "tiny-moe" in ps
    answers = _answers(ready["endpoint"])
    stop = c.run("stop", "--all", timeout=300)
    with contextlib.suppress(subprocess.TimeoutExpired):
        runner.wait(timeout=60)
    stray = c.stray()
    # Either the server goes with the terminal, or it keeps running and stays tracked (ps lists it, stop stops it).
    ok = (not answers or tracked) and not stray
    return Row(
        "SIGHUP (terminal closed)",
        ps.splitlines()[0] if ps else "",
        runner.poll(),
        stray,
        c.runfiles(),
        ok,
        f"server still answering after SIGHUP: {answers}; listed by ps: {tracked}; stop rc {stop.returncode}",
    )


def _answer_once_compressed(c: Case) -> subprocess.CompletedProcess:
    """`bigmoe run tiny-moe` on a compressed paging file, answering one short prompt and exiting (20 min at most:
    the first run on a fresh home also prepares the paging file)."""
    return c.run(
        "run",
        "tiny-moe",
        "--yes",
        "--compress",
        "on",
        "--port",
        str(free_port()),
        "--prompt",
        "Hi",
        "--max-tokens",
        "4",
        timeout=1200,
    )


def case_damaged_paging_file(c: Case) -> Row:
    first = _answer_once_compressed(c)
    pages = sorted((c.home / "paging").glob("*.pages"))
    if first.returncode != 0 or not pages:
        return Row(
            "damaged paging file", last_line(first.stderr), first.returncode, c.stray(), [], False, "first run failed"
        )
    middle = pages[0].stat().st_size // 2
    for at in range(middle, middle + (64 << 10), 4096):  # records are zero-padded: hit record bytes, not padding
        _flip(pages[0], at + 100)
    second = _answer_once_compressed(c)
    rebuilt = "state=rebuilding" in second.stdout or '"rebuilding"' in second.stdout
    reason = next((line for line in second.stdout.splitlines() if "rebuilding" in line), "")
    return Row(
        "damaged paging file",
        reason[:200] or last_line(second.stderr),
        second.returncode,
        c.stray(),
        c.partial_files(),
        rebuilt and second.returncode == 0,
        f"second run answered: {second.returncode == 0}",
    )


def case_paging_file_damaged_while_serving(c: Case) -> Row:
    runner = c.start("run", "tiny-moe", "--yes", "--json", "--compress", "on", "--port", str(free_port()))
    ready = c.wait_event(runner, "ready")
    pages = sorted((c.home / "paging").glob("*.pages"))
    if ready is None or not pages:
        return Row("paging file damaged while serving", "never ready", runner.poll(), c.stray(), [], False)
    _flip_every_record(pages[0])
    answered = None
    try:
        r = httpx.post(
            ready["endpoint"] + "/v1/completions",
            timeout=300,
            json={"model": "tiny-moe", "prompt": " ".join(f"word{i}" for i in range(200)), "max_tokens": 8},
        )
        answered = r.status_code
    except httpx.HTTPError as e:
        answered = type(e).__name__
    with contextlib.suppress(subprocess.TimeoutExpired):
        runner.wait(timeout=120)
    err = runner.stderr.read() if runner.poll() is not None else ""
    marked = pages[0].with_name(pages[0].name + ".damaged").exists()
    c.cleanup()
    again = _answer_once_compressed(c)
    rebuilt = "rebuilding" in again.stdout
    msg = next((line for line in err.splitlines() if "crc32" in line or "paging file" in line), last_line(err))
    return Row(
        "paging file damaged while serving",
        msg[:300],
        runner.poll(),
        c.stray(),
        c.partial_files(),
        marked and rebuilt and again.returncode == 0 and str(pages[0]) in msg,
        f"request answered {answered}; marker written: {marked}; next start rebuilt it: {rebuilt}, "
        f"exit {again.returncode}",
    )


def _flip_every_record(path: Path) -> None:
    """Flip one byte in every 4 KiB block past the header, so whichever record the pager reads fails."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        for at in range(1 << 20, size - 8192, 4096):
            f.seek(at + 100)
            b = f.read(1)
            f.seek(at + 100)
            f.write(bytes([b[0] ^ 0xFF]))


def case_truncated_safetensors(c: Case) -> Row:
    model = _tiny_copy(c)
    shard = next(model.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 4096])
    start = time.monotonic()
    res = c.run("run", "tiny-moe", "--yes", "--model-dir", str(model), "--port", str(free_port()), timeout=900)
    took = time.monotonic() - start
    msg = last_line(res.stderr)
    return Row(
        "truncated safetensors",
        msg,
        res.returncode,
        c.stray(),
        c.partial_files(),
        res.returncode != 0 and "truncated" in msg and len(error_lines(res.stderr)) == 1,
        f"{took:.1f} s",
    )


def case_bad_env(c: Case) -> Row:
    start = time.monotonic()
    res = c.run(
        "run",
        "tiny-moe",
        "--yes",
        "--model-dir",
        str(_tiny_copy(c)),
        "--port",
        str(free_port()),
        env={"BIGMOE_READ_RETRIES": "often"},
    )
    msg = last_line(res.stderr)
    return Row(
        "bad BIGMOE_* value",
        msg,
        res.returncode,
        c.stray(),
        c.partial_files(),
        res.returncode != 0 and "BIGMOE_READ_RETRIES" in msg,
        f"{time.monotonic() - start:.1f} s",
    )


def case_bad_settings_file(c: Case) -> Row:
    file = c.home / "pager.toml"
    file.write_text("vram_slot = 4\n")
    res = c.run(
        "run",
        "tiny-moe",
        "--yes",
        "--model-dir",
        str(_tiny_copy(c)),
        "--port",
        str(free_port()),
        env={"BIGMOE_SETTINGS": str(file)},
    )
    msg = last_line(res.stderr)
    return Row(
        "bad BIGMOE_SETTINGS file",
        msg,
        res.returncode,
        c.stray(),
        c.partial_files(),
        res.returncode != 0 and str(file) in msg,
    )


def case_kill_engine_mid_stream(c: Case) -> Row:
    runner = c.start("run", "tiny-moe", "--yes", "--json", "--port", str(free_port()))
    ready = c.wait_event(runner, "ready")
    if ready is None:
        return Row("kill -9 of the engine mid-stream", "never ready", runner.poll(), c.stray(), [], False)
    c.remember(runner.pid)
    engine = next((psutil.Process(p) for p in c.pids if _is_engine(p)), None)
    body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200, "stream": True}
    got = 0
    try:
        with httpx.stream("POST", ready["endpoint"] + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3 and engine is not None:
                    engine.kill()
    except httpx.HTTPError:
        pass
    with contextlib.suppress(subprocess.TimeoutExpired):
        runner.wait(timeout=120)
    err = runner.stderr.read() if runner.poll() is not None else ""
    if runner.poll() is None:
        c.cleanup()
    time.sleep(2)
    stray = c.stray()
    msg = last_line(err)
    return Row(
        "kill -9 of the engine mid-stream",
        msg,
        runner.poll(),
        stray,
        c.runfiles(),
        engine is not None and runner.poll() not in (None, 0) and "oneDNN" not in msg and not stray,
        f"engine pid {engine.pid if engine else None}",
    )


def case_disk_full_fetch(c: Case) -> Row:
    from tests.hubserver import HubServer

    served = _tiny_copy(c, shard_bytes=12 << 20)
    with _tmpfs(c.home / "small", "8m") as small, HubServer(served, "Qwen/Qwen3.8-Flash-Next-FP8") as hub:
        if small is None:
            return Row("disk full during fetch", "cannot mount a small tmpfs (needs root)", None, [], [], False)
        res = c.run("pull", "qwen3.8-flash-next", "--cache-dir", str(small), env={"HF_ENDPOINT": hub.endpoint})
        left = [str(p) for p in small.rglob("*") if p.is_file()]
    msg = last_line(res.stderr)
    return Row(
        "disk full during fetch",
        msg,
        res.returncode,
        c.stray(),
        left,
        res.returncode == exit_codes.NO_SPACE and not left,
    )


def case_disk_full_prepare(c: Case) -> Row:
    with _loop_ext4(c.home / "small", 8) as small:
        if small is None:
            return Row(
                "disk full during prepare",
                "cannot mount a small ext4 image (needs root and loop devices)",
                None,
                [],
                [],
                False,
            )
        res = c.run(
            "run",
            "tiny-moe",
            "--yes",
            "--compress",
            "on",
            "--paging-dir",
            str(small),
            "--port",
            str(free_port()),
            timeout=900,
        )
        left = [str(p) for p in small.rglob("*") if p.is_file() and p.name != "lost+found"]
    msg = last_line(res.stderr)
    return Row(
        "disk full during prepare",
        msg,
        res.returncode,
        c.stray(),
        left,
        res.returncode != 0 and ("disk" in msg or "free" in msg) and not left,
    )


def case_interrupted_download(c: Case) -> Row:
    from tests.hubserver import HubServer

    served = _tiny_copy(c, shard_bytes=12 << 20)
    with HubServer(served, "Qwen/Qwen3.8-Flash-Next-FP8") as hub:
        hub.drop_midway("model-00001-of-00002.safetensors", after_bytes=11 << 20, outage=True)
        env = {"HF_ENDPOINT": hub.endpoint}
        first = c.run("pull", "qwen3.8-flash-next", env=env)
        hub.heal()
        second = c.run("pull", "qwen3.8-flash-next", env=env)
    msg = last_line(first.stderr)
    return Row(
        "interrupted download",
        msg,
        first.returncode,
        c.stray(),
        c.partial_files(),
        first.returncode == exit_codes.NETWORK and "run" in msg and second.returncode == 0,
        f"second pull rc {second.returncode}",
    )


def case_paging_file_of_another_model(c: Case) -> Row:
    from types import SimpleNamespace

    from bigmoe.serve.prepare import prepare

    other = _tiny_copy(c, seed=7)
    path = c.home / "paging" / "tiny-moe-bf16.pages"
    prepare(SimpleNamespace(ssd_source="paging file", paging_file=str(path), compress=True), other)
    res = _answer_once_compressed(c)
    reason = next((line for line in res.stdout.splitlines() if "rebuilding" in line), "")
    return Row(
        "paging file from another model",
        reason[:200] or last_line(res.stderr),
        res.returncode,
        c.stray(),
        c.partial_files(),
        bool(reason) and res.returncode == 0,
    )


def case_odirect_refused(c: Case) -> Row:
    # ramfs refuses O_DIRECT (tmpfs accepts it since Linux 6.6); it reports no free space, so the plan's
    # refusal names both; --force then runs into prepare's own O_DIRECT check.
    with _mounted(c.home / "ramfs", "ramfs") as ramfs:
        if ramfs is None:
            return Row("O_DIRECT refused", "cannot mount a ramfs (needs root)", None, [], [], False)
        args = (
            "run",
            "tiny-moe",
            "--yes",
            "--compress",
            "on",
            "--paging-dir",
            str(ramfs),
            "--prompt",
            "Hi",
            "--max-tokens",
            "4",
        )
        refused = c.run(*args, "--port", str(free_port()), timeout=900)
        forced = c.run(*args, "--force", "--port", str(free_port()), timeout=900)
        left = [str(p) for p in ramfs.rglob("*") if p.is_file()]
    msg = last_line(forced.stderr)
    ok = "O_DIRECT" in last_line(refused.stderr) and forced.returncode != 0 and "O_DIRECT" in msg
    return Row(
        "O_DIRECT refused (paging dir on ramfs)",
        msg,
        forced.returncode,
        c.stray(),
        left,
        ok,
        f"without --force: exit {refused.returncode}, {last_line(refused.stderr)[:160]}",
    )


def case_api_key(c: Case) -> Row:
    key = "sk-fault-matrix-secret"
    # The key given by environment (BIGMOE_API_KEY), so no process of ours has it on its command line.
    runner = c.start("run", "tiny-moe", "--yes", "--json", "--port", str(free_port()), env={"BIGMOE_API_KEY": key})
    ready = c.wait_event(runner, "ready")
    leaks = []
    if ready is None:
        return Row("API key leaks", "never ready", runner.poll(), c.stray(), [], False)
    if key in json.dumps(ready):
        leaks.append("ready event")
    for pid in list(c.pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            if key in " ".join(psutil.Process(pid).cmdline()):
                leaks.append(f"argv of {pid}")
    for path in [*(c.home / "logs").rglob("*"), *(c.home / "run").rglob("*")]:  # what bigmoe writes per run
        if path.is_file():
            mode = stat.S_IMODE(path.stat().st_mode)
            if (path.suffix == ".log" or path.parent.name == "run") and mode & 0o077:
                leaks.append(f"{path.name} mode {oct(mode)}")
            if key in path.read_text(errors="replace"):
                leaks.append(f"key in {path.name}")
    c.run("stop", "--all", timeout=300)
    with contextlib.suppress(subprocess.TimeoutExpired):
        runner.wait(timeout=60)
    # A bad setting stops this run in preflight, after the exposure warning and before vLLM.
    warn = c.run(
        "run", "tiny-moe", "--yes", "--host", "0.0.0.0", "--port", str(free_port()), env={"BIGMOE_READ_RETRIES": "x"}
    )
    warned = "0.0.0.0" in warn.stderr and ("key" in warn.stderr.lower())
    return Row(
        "API key leaks",
        "; ".join(leaks) or "no leak found (ready line, argv, logs, runfiles)",
        runner.poll(),
        c.stray(),
        [],
        not leaks and warned,
        f"--host 0.0.0.0 without a key warns: {warned}",
    )


CASES: dict[str, Callable[[Case], Row]] = {
    "second-run": case_second_run,
    "double-ctrl-c": case_double_ctrl_c,
    "sighup": case_sighup,
    "damaged-paging-file": case_damaged_paging_file,
    "paging-damaged-serving": case_paging_file_damaged_while_serving,
    "truncated-safetensors": case_truncated_safetensors,
    "bad-env": case_bad_env,
    "bad-settings-file": case_bad_settings_file,
    "kill-engine": case_kill_engine_mid_stream,
    "disk-full-fetch": case_disk_full_fetch,
    "disk-full-prepare": case_disk_full_prepare,
    "interrupted-download": case_interrupted_download,
    "paging-file-other-model": case_paging_file_of_another_model,
    "odirect-refused": case_odirect_refused,
    "api-key": case_api_key,
}


# -- helpers ------------------------------------------------------------------------------------------


def _answers(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _is_engine(pid: int) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        p = psutil.Process(pid)
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    return False


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _tiny_copy(c: Case, seed: int = 0, shard_bytes: int | None = None) -> Path:
    from bigmoe.model import presets
    from bigmoe.model.tinymoe.make import TinyShape, make_tiny_moe

    arch = presets.load("tiny-moe").arch
    shape = TinyShape(
        layers=arch.moe_layers,
        experts=arch.experts,
        top_k=arch.top_k,
        hidden=arch.hidden,
        moe_intermediate=arch.moe_intermediate,
        vocab=arch.vocab,
    )
    out = c.home / f"ckpt-{seed}-{shard_bytes}"
    extra = {"shard_bytes": shard_bytes} if shard_bytes else {}
    return make_tiny_moe(out, shape, "bf16", seed, **extra)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    with _mounted(path, "tmpfs", f"size={size}") as mounted:
        yield mounted


@contextlib.contextmanager
def _mounted(path: Path, kind: str, options: str = "defaults"):
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", kind, "-o", options, kind, str(path)]
    if subprocess.run(mount, capture_output=True).returncode:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _loop_ext4(path: Path, mib: int):
    image = path.with_suffix(".img")
    path.mkdir(parents=True, exist_ok=True)
    made = (
        subprocess.run(["truncate", "-s", f"{mib}M", str(image)], capture_output=True).returncode == 0
        and subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True).returncode == 0
        and subprocess.run(["mount", "-o", "loop", str(image), str(path)], capture_output=True).returncode == 0
    )
    if not made:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        image.unlink(missing_ok=True)


def render(rows: list[Row], command: str) -> str:
    lines = [
        "# Fault matrix (issue 17)",
        "",
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        "(CPU build of vLLM, the tiny-moe demo; each case in its own BIGMOE_HOME).",
        "",
        "| case | message the user sees | exit | stray processes | files left | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "clear error, nothing left behind" if r.ok else "NOT OK" + (f" ({r.note})" if r.note else "")
        cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines.append(
            f"| {r.case} | {cell(r.message) or '(none)'} | {r.exit_code} "
            f"| {cell(', '.join(r.stray)) or 'none'} "
            f"| {cell(', '.join(r.files_left)) or 'none'} | {cell(verdict)} |"
        )
    notes = [f"- {r.case}: {r.note}" for r in rows if r.note]
    return "\n".join(lines + ([""] + ["Notes:"] + notes if notes else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), default=None, help="Run these cases only.")
    ap.add_argument("--out", type=Path, default=None, help="Write the table as markdown here.")
    args = ap.parse_args(argv)
    rows = []
    command = ("python scripts/fault_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    with tempfile.TemporaryDirectory(prefix="bigmoe-faults-") as tmp:
        for name in args.only or list(CASES):
            case = Case(Path(tmp), name)
            start = time.monotonic()
            try:
                row = CASES[name](case)
            except Exception as e:  # a case that breaks is reported as such, the others still run
                row = Row(name, f"the case itself failed: {type(e).__name__}: {e}", None, case.stray(), [], False)
            finally:
                case.cleanup()
            print(
                f"{row.case}: {'ok' if row.ok else 'NOT OK'} | {row.message} | exit {row.exit_code} | "
                f"stray {row.stray or 'none'} | left {row.files_left or 'none'} | {time.monotonic() - start:.0f} s",
                flush=True,
            )
            rows.append(row)
            if args.out:  # after every case, so a long matrix stopped midway keeps what it found
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(render(rows, command))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
