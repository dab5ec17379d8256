"""The reference job's app path on a GPU machine: `bigmoe run DIR --yes` with memory budgets that force every tier.

    python3 scripts/gpu_app_run.py --model DIR --budgets 8:14,6:12,5:10 --out $OUT/app-run.json

DIR is a Qwen4Exp checkpoint (scripts/make_qwen4exp.py). The steps are the ones a person takes, each through the
`bigmoe` command itself (`python3 -m bigmoe.cli`, since the device machine has no console script):
1. `bigmoe plan DIR --json` with each VRAM:RAM budget pair (GiB) in turn until one pages through every tier
   (VRAM slots < RAM slots < experts) with the n-gram table on SSD; the plan's memory table decides, so the
   pair that does depends on the checkpoint;
2. `bigmoe run DIR --yes --json` with the same budgets, in its own session, until its `ready` event;
3. one chat request to the endpoint it printed (the answer and its wall time);
4. `/metrics`: the pager's `bigmoe_` series, hit rate per tier;
5. `bigmoe ps`, then `bigmoe stop`: the run must end, its record go and no process of its session stay.
The JSON (--out) has each step's result and `passed`. Nothing is faked: a step that fails says so and ends the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Tell me about the sea."


def bigmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "bigmoe.cli", *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    path = [str(REPO / "pager"), str(REPO / "app")] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env.update(PYTHONPATH=":".join(path), PYTHONUNBUFFERED="1")
    return env


def plan_step(args) -> dict:
    """The first budget pair whose plan pages through all three tiers; args.vram_gib/ram_gib become that pair."""
    tried = []
    for vram, ram in args.budgets:
        args.vram_gib, args.ram_gib = vram, ram
        proc = subprocess.run(
            bigmoe("plan", str(args.model), "--json", *budgets(args)),
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            tried.append(f"{vram}:{ram} GiB: plan exited {proc.returncode}: {proc.stderr.strip()[-200:]}")
            continue
        plan = json.loads(proc.stdout)
        tiers = {
            "vram_gib": vram,
            "ram_gib": ram,
            "experts": plan["experts"],
            "vram_slots": plan["vram_slots"],
            "ram_slots": plan["ram_slots"],
            "ngram": plan["ngram"],
            "argv": plan["argv"],
            "env": plan["env"],
        }
        if plan["vram_slots"] < plan["ram_slots"] < plan["experts"]:
            return {**tiers, "budgets_tried": tried}
        slots = f"{plan['vram_slots']} VRAM / {plan['ram_slots']} RAM slots of {plan['experts']}"
        tried.append(f"{vram}:{ram} GiB: {slots}")
    raise StepFailed("no budget pair forces every tier: " + "; ".join(tried))


def budgets(args) -> list[str]:
    return ["--vram-gib", str(args.vram_gib), "--ram-gib", str(args.ram_gib)]


class StepFailed(RuntimeError):
    """One step of the app path failed; the message is one line."""


def start_run(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        bigmoe(
            "run",
            str(args.model),
            "--yes",
            "--json",
            "--port",
            str(args.port),
            "--start-timeout",
            str(args.start_timeout),
            *budgets(args),
        ),
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),
        text=True,
        start_new_session=True,
    )


def wait_ready(run: subprocess.Popen, timeout_s: float, events: list[dict]) -> dict:
    deadline = time.monotonic() + timeout_s
    for line in run.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        events.append(event)
        if event.get("event") == "ready":
            return event
        if time.monotonic() > deadline:
            break
    raise StepFailed(f"bigmoe run ended or timed out before `ready` (exit {run.poll()}); see its log")


def chat(endpoint: str, model: str) -> dict:
    started = time.monotonic()
    r = httpx.post(
        f"{endpoint}/v1/chat/completions",
        timeout=300,
        json={"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0},
    )
    r.raise_for_status()
    body = r.json()
    return {
        "seconds": round(time.monotonic() - started, 3),
        "answer": body["choices"][0]["message"]["content"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }


def pager_metrics(endpoint: str) -> dict:
    text = httpx.get(f"{endpoint}/metrics", timeout=30).text
    lookups: dict[str, float] = {}
    hits: dict[str, float] = {}
    names = set()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("bigmoe_"):
            continue
        names.add(family.name)
        for sample in family.samples:
            tier = sample.labels.get("tier")
            if sample.name == "bigmoe_expert_lookups_total":
                lookups[tier] = lookups.get(tier, 0) + sample.value
            elif sample.name == "bigmoe_expert_hits_total":
                hits[tier] = hits.get(tier, 0) + sample.value
    rates = {t: round(hits.get(t, 0) / n, 4) for t, n in lookups.items() if n}
    if not rates:
        raise StepFailed(f"/metrics has no pager hit counts (bigmoe_ series: {sorted(names)})")
    return {"series": sorted(names), "lookups": lookups, "hit_rate": rates}


def leftovers(session: int) -> tuple[list[str], list[str]]:
    """Processes still in a session (the `bigmoe run` one, or vLLM's own: bigmoe starts vLLM in a new session):
    (running, exited). An exited one is a zombie awaiting its parent's reap: vLLM's multiprocessing resource
    tracker ignores SIGTERM, ends after its server, and is then the init process's to reap (the H200's first
    app run, session 8, saw one such, pid with no command line, gone seconds later). Running ones fail the run."""
    running, exited = [], []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(proc.pid) != session:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        line = f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}".strip()
        (exited if proc.info["status"] == psutil.STATUS_ZOMBIE else running).append(line)
    return running, exited


def still_running(sessions: list[int], settle_s: float = 10.0) -> tuple[list[str], list[str]]:
    """leftovers() of every session, asked again for up to settle_s while some still run (their exit in flight)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = [leftovers(s) for s in sessions]
        running = [line for r, _ in found for line in r]
        exited = [line for _, e in found for line in e]
        if not running or time.monotonic() >= deadline:
            return running, exited
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument(
        "--budgets",
        type=lambda v: [tuple(float(x) for x in pair.split(":")) for pair in v.split(",")],
        required=True,
        help="VRAM:RAM GiB pairs to try in order, e.g. 8:14,6:12",
    )
    p.add_argument("--port", type=int, default=8011)
    # bigmoe run's own default (run.RunOptions.start_timeout, 900 s): a first start on the H200 JIT-compiles
    # DeepGEMM kernels, and 420 s stopped one there while other engines compiled beside it
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    report: dict = {"command": " ".join(sys.argv), "steps": {}, "passed": False}
    log = args.out.with_suffix(".run.log")
    run = None
    try:
        report["steps"]["plan"] = plan_step(args)
        run = start_run(args, log)
        events: list[dict] = []
        ready = wait_ready(run, args.start_timeout + 60, events)
        report["steps"]["ready"] = {
            "endpoint": ready["endpoint"],
            "stages": [e.get("stage") for e in events if e.get("event") == "stage"],
        }
        report["steps"]["chat"] = chat(ready["endpoint"], ready["model"])
        report["steps"]["metrics"] = pager_metrics(ready["endpoint"])
        ps = subprocess.run(bigmoe("ps"), env=child_env(), capture_output=True, text=True, timeout=60)
        report["steps"]["ps"] = ps.stdout.strip()
        stop = subprocess.run(bigmoe("stop", "--all"), env=child_env(), capture_output=True, text=True, timeout=120)
        report["steps"]["stop"] = {"exit": stop.returncode, "output": (stop.stdout + stop.stderr).strip()}
        run.wait(timeout=120)
        report["steps"]["run_exit"] = run.returncode
        server_pid = next((e["pid"] for e in events if e.get("event") == "launch"), None)
        left, exited = still_running([run.pid] + ([server_pid] if server_pid else []))
        ps_after = subprocess.run(bigmoe("ps"), env=child_env(), capture_output=True, text=True, timeout=60)
        report["steps"]["after_stop"] = {
            "processes_left": left,
            "exited_unreaped": exited,
            "ps": ps_after.stdout.strip(),
        }
        report["passed"] = stop.returncode == 0 and not left and "no bigmoe server" in ps_after.stdout
    except (StepFailed, httpx.HTTPError, subprocess.TimeoutExpired) as e:
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
