"""Start-up of the paged vLLM with bad settings fails with one clear line; a paging
file built from the checkpoint serves the same tokens; one built for another model is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bigmoe_pager.core.paging_build import build_paging_file

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

from vllm_runs import greedy_run  # noqa: E402


def run(model: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("BIGMOE_")}
    full.update(env)
    return greedy_run(model, 8, ["The sea is calm and"], full)


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    tiny = sys.modules["make_tiny_moe"]
    return (
        tiny_checkpoint(tiny.TinyShape(), "bf16", seed=3),
        tiny_checkpoint(tiny.TinyShape(layers=2, experts=24, top_k=6, hidden=128, moe_intermediate=64), "bf16", seed=3),
    )


@pytest.mark.parametrize(
    "env,message",
    [
        ({"BIGMOE_VRAM_SLOTS": "6", "BIGMOE_RAM_SLOTS": "4"}, "RAM slots must be >= VRAM slots"),
        ({"BIGMOE_VRAM_SLOTS": "0"}, "each layer needs at least 1"),
        ({"BIGMOE_VRAM_SLOTS": "4,4,4"}, "lists 3 values but the model has 4 MoE layers"),
        ({"BIGMOE_VRAM_SLOTS": "four"}, "BIGMOE_VRAM_SLOTS='four' is not valid"),
    ],
)
def test_bad_slot_settings_fail_startup_with_one_clear_line(models, env, message):
    proc = run(models[0], {"BIGMOE_PAGER": "1", **env})
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "TOKENS" not in proc.stdout


@pytest.fixture(scope="module")
def plain(models):
    """The unpaged model's run, made once for both paging files."""
    return run(models[0], {})


@pytest.mark.parametrize("compress", ["off", "on"])
def test_paging_file_serves_the_same_tokens_and_refuses_another_model(models, plain, tmp_path, compress):
    model, other = models
    paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=compress == "on")
    paged = run(
        model,
        {
            "BIGMOE_PAGER": "1",
            "BIGMOE_VRAM_SLOTS": "5",
            "BIGMOE_RAM_SLOTS": "8",
            "BIGMOE_PAGING_FILE": str(paging),
            "BIGMOE_COMPRESS": compress,
        },
    )
    assert paged.returncode == 0, paged.stderr[-2000:]
    assert [l for l in paged.stdout.splitlines() if l.startswith("TOKENS")] == [
        l for l in plain.stdout.splitlines() if l.startswith("TOKENS")
    ]
    foreign = run(
        other,
        {
            "BIGMOE_PAGER": "1",
            "BIGMOE_VRAM_SLOTS": "6",
            "BIGMOE_RAM_SLOTS": "8",
            "BIGMOE_PAGING_FILE": str(paging),
            "BIGMOE_COMPRESS": compress,
        },
    )
    assert foreign.returncode != 0
    assert "BIGMOE_PAGING_FILE" in foreign.stderr
