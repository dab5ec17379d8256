"""The demo shows the product: `bigmoe run tiny-moe` pages by default on a CPU too (fewer device
slots than experts, fewer RAM slots than experts, the rest read from the checkpoint on SSD), its
/metrics carry the pager's per-tier series, and its greedy tokens equal the resident model's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from bigmoe.model import presets
from bigmoe.run import RunOptions, make_plan, probe_machine
from bigmoe.serve import launch
from bigmoe.serve.watch import Watcher

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

from tests.e2e.test_pager_vllm import PROMPTS, greedy  # noqa: E402

BIGMOE = [sys.executable, "-m", "bigmoe.cli"]


@pytest.fixture(scope="module")
def home(tmp_path_factory, monkeypatch_module):
    path = tmp_path_factory.mktemp("bigmoe-home")
    monkeypatch_module.setenv("BIGMOE_HOME", str(path))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_demo_plan_pages_with_an_ssd_tier_and_gives_the_resident_tokens(home):
    from bigmoe.model.synthetic import ensure_tiny_model

    preset = presets.load("tiny-moe")
    plan = make_plan(probe_machine(preset, RunOptions(model="tiny-moe")), preset, RunOptions(model="tiny-moe"))
    assert plan.device == "cpu" and plan.pager and plan.ssd_source == "checkpoint"
    assert plan.vram_slots < plan.ram_slots < plan.experts
    model = ensure_tiny_model(preset, plan.expert_dtype)
    pager_env = {k: v for k, v in plan.env.items() if k.startswith("BIGMOE_")}
    paged, _ = greedy(model, pager_env, max_tokens=48)
    resident, _ = greedy(model, {}, max_tokens=48)
    assert paged == resident


def test_bigmoe_run_demo_shows_every_tiers_hit_rate_in_metrics(home):
    port = launch.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")} | {"BIGMOE_HOME": str(home)}
    runner = subprocess.Popen(
        [*BIGMOE, "run", "tiny-moe", "--yes", "--json", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ready = _wait_for(runner, "ready", timeout=1500)  # a loaded 2-core machine takes minutes
        endpoint = ready["endpoint"]
        watcher = Watcher(endpoint)
        watcher.poll()
        for prompt in PROMPTS:
            httpx.post(
                f"{endpoint}/v1/completions",
                json={"model": "tiny-moe", "prompt": prompt, "max_tokens": 16, "temperature": 0},
                timeout=120,
            ).raise_for_status()
        window = watcher.poll()
        assert {"vram", "ram", "ssd"} <= set(window.hit_rate), window.hit_rate
        assert 0 < window.hit_rate["vram"] < 1, "fewer slots than experts: some lookups miss"
        metrics = httpx.get(endpoint + "/metrics").text
        assert "bigmoe_expert_lookups_total{" in metrics and 'tier="ssd"' in metrics
    finally:
        os.killpg(runner.pid, signal.SIGINT)
        try:
            runner.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(runner.pid, signal.SIGKILL)


def _wait_for(proc: subprocess.Popen, name: str, timeout: float) -> dict:
    import selectors
    import time

    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                return event
    raise AssertionError(f"no {name!r} event; stderr:\n{proc.stderr.read()[-3000:] if proc.poll() is not None else ''}")
