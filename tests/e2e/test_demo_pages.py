"""The demo shows the product: `bigmoe run tiny-moe` pages by default on a CPU too (fewer device
slots than experts, fewer RAM slots than experts, the rest read from the checkpoint on SSD), and its
greedy tokens equal the resident model's. (A served run's per-tier series in /metrics:
test_app_run.test_served_model_is_watched_listed_logged_and_stopped.)"""

from __future__ import annotations

import pytest
from bigmoe.model import presets
from bigmoe.run import RunOptions, make_plan, probe_machine

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

from tests.e2e.test_pager_vllm import greedy  # noqa: E402


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
