"""Load test: concurrent streaming chat clients against a bigmoe server on localhost.

    python scripts/load_test.py [--minutes 10] [--clients 16] [--max-tokens 32] [--out docs/bench/load_test.json]
    python scripts/load_test.py --endpoint http://127.0.0.1:8000 --model tiny-moe   # a server already running

Without --endpoint it starts `bigmoe run tiny-moe --yes --json` (the paged demo: device slots, RAM
slots and an SSD tier on this machine's plan) on a free port in a private BIGMOE_HOME, waits for it,
runs the clients, then stops it with SIGINT. Each client sends one streaming chat request after
another (greedy, `max_tokens`), for the whole run. It reports requests started, completed, failed
(HTTP error, broken stream, no tokens) and lost (started, never finished within --grace-s after the
end), latency and TTFT percentiles, tokens, and the server's RSS over time (the process tree's resident
set, every --sample-s seconds, psutil). A benchmark script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

PROMPTS = [
    "Tell me about the sea.",
    "Write a short note about the river.",
    "Count from one to ten.",
    "Describe an old house near a green tree.",
    "What do boats carry?",
    "Say something about rivers.",
]


@dataclass
class Tally:
    """What the clients saw."""

    started: int = 0
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.failed += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_request(
    client: httpx.AsyncClient, endpoint: str, model: str, prompt: str, max_tokens: int, tally: Tally
) -> None:
    tally.started += 1
    start = time.monotonic()
    first = None
    chunks = 0
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    try:
        async with client.stream("POST", f"{endpoint}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                tally.error(f"HTTP {response.status_code}")
                return
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    tally.error("error event in stream")
                    return
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    chunks += 1
                    first = first or time.monotonic()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        tally.error(type(e).__name__)
        return
    if not done or chunks == 0:
        tally.error("stream ended without [DONE]" if not done else "no tokens")
        return
    tally.completed += 1
    tally.tokens += chunks
    tally.latency_s.append(time.monotonic() - start)
    tally.ttft_s.append(first - start)


async def client_loop(i: int, endpoint: str, model: str, max_tokens: int, until: float, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        n = 0
        while time.monotonic() < until:
            await one_request(client, endpoint, model, PROMPTS[(i + n) % len(PROMPTS)], max_tokens, tally)
            n += 1


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


async def sample_rss(
    pid: int | None, every_s: float, until: float, samples: list[tuple[float, int]], t0: float
) -> None:
    while pid and time.monotonic() < until:
        samples.append((round(time.monotonic() - t0, 1), tree_rss(pid)))
        await asyncio.sleep(every_s)


async def run_load(
    endpoint: str,
    model: str,
    clients: int,
    seconds: float,
    max_tokens: int,
    server_pid: int | None,
    sample_s: float,
    grace_s: float,
) -> dict:
    tally, samples = Tally(), []
    t0 = time.monotonic()
    until = t0 + seconds
    sampler = asyncio.create_task(sample_rss(server_pid, sample_s, until + grace_s, samples, t0))
    tasks = [asyncio.create_task(client_loop(i, endpoint, model, max_tokens, until, tally)) for i in range(clients)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + grace_s)
    for task in pending:
        task.cancel()
    sampler.cancel()
    lost = tally.started - tally.completed - tally.failed
    elapsed = time.monotonic() - t0
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "max_tokens": max_tokens,
        "requests": tally.started,
        "completed": tally.completed,
        "errors": tally.failed,
        "error_kinds": tally.errors,
        "lost": lost,
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 2),
        "latency_s": _percentiles(tally.latency_s),
        "ttft_s": _percentiles(tally.ttft_s),
        "rss_mib": [(t, round(b / 2**20, 1)) for t, b in samples],
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100) if len(values) > 1 else [values[0]] * 99
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3), "max": round(max(values), 3)}


def start_server(model: str, port: int, home: Path) -> tuple[subprocess.Popen, str, int]:
    """`bigmoe run MODEL --yes --json` in its own session; returns (runner, endpoint, vLLM pid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")} | {"BIGMOE_HOME": str(home)}
    argv = [sys.executable, "-m", "bigmoe.cli", "run", model, "--yes", "--json", "--port", str(port)]
    runner = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    pid = None
    for line in runner.stdout:
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "launch":
            pid = int(event["pid"])
        if event.get("event") == "ready":
            return runner, event["endpoint"], pid or runner.pid
        if event.get("event") in ("error", "stopped"):
            break
    raise SystemExit(f"load_test: the server did not become ready: {line.strip()}")


def stop_server(runner: subprocess.Popen) -> None:
    os.killpg(runner.pid, signal.SIGINT)
    try:
        runner.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)


def rss_summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    """First, last and peak RSS after the first sample, and the growth from the first to the last quarter."""
    values = [v for _, v in samples if v > 0]
    if len(values) < 4:
        return {}
    quarter = max(1, len(values) // 4)
    first, last = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
    return {
        "first_mib": values[0],
        "last_mib": values[-1],
        "peak_mib": max(values),
        "growth_first_to_last_quarter_pct": round(100 * (last - first) / first, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="How long the clients run (default 10).")
    ap.add_argument("--clients", type=int, default=16, help="Concurrent streaming clients (default 16).")
    ap.add_argument("--max-tokens", type=int, default=32, help="Tokens per answer (default 32).")
    ap.add_argument("--endpoint", default=None, help="A running server (default: start the paged tiny-moe demo).")
    ap.add_argument("--model", default="tiny-moe", help="Preset to start, or served model name with --endpoint.")
    ap.add_argument("--sample-s", type=float, default=10.0, help="Seconds between RSS samples (default 10).")
    ap.add_argument("--grace-s", type=float, default=120.0, help="Seconds requests in flight at the end may take.")
    ap.add_argument("--out", type=Path, default=None, help="Write the result as JSON here.")
    args = ap.parse_args(argv)
    runner = None
    with tempfile.TemporaryDirectory(prefix="bigmoe-load-") as home:
        if args.endpoint:
            endpoint, pid = args.endpoint.rstrip("/"), None
        else:
            from bigmoe.serve.launch import free_port

            runner, endpoint, pid = start_server(args.model, free_port(), Path(home))
        try:
            result = asyncio.run(
                run_load(
                    endpoint,
                    args.model,
                    args.clients,
                    args.minutes * 60,
                    args.max_tokens,
                    pid,
                    args.sample_s,
                    args.grace_s,
                )
            )
        finally:
            if runner is not None:
                stop_server(runner)
    result["rss"] = rss_summary(result["rss_mib"])
    result["command"] = "python scripts/load_test.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}))
    return 0 if result["errors"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
