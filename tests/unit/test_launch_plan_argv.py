"""The command `bigmoe run` executes is the plan's argv: a plan made before the checkpoint was on disk
(a download lands where no plan could name it) is made again for the checkpoint, and start_server runs
Plan.argv unchanged, with the API key in the environment only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bigmoe import run as sequence
from bigmoe.machine.hardware import Hardware
from bigmoe.model import presets
from bigmoe.model.synthetic import ensure_tiny_model
from bigmoe.serve import launch

HARDWARE = Path(__file__).resolve().parents[1] / "fixtures" / "hardware" / "cpu-laptop.json"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    preset = presets.load("tiny-moe")
    return preset, ensure_tiny_model(preset, "bf16")


def test_a_plan_is_made_again_for_a_checkpoint_that_arrived_after_it(tiny, tmp_path):
    preset, made = tiny
    hardware = Hardware.from_dict(json.loads(HARDWARE.read_text()))
    opts = sequence.RunOptions(model="tiny-moe", port=8123)
    first = sequence.make_plan(hardware, preset, opts)
    assert first.argv[first.argv.index("--model") + 1] == str(made)
    assert sequence.plan_for_checkpoint(first, preset, made, opts) is first
    landed = tmp_path / "snapshot"
    shutil.copytree(made, landed)
    again = sequence.plan_for_checkpoint(first, preset, landed, opts)
    assert again.argv[again.argv.index("--model") + 1] == str(landed)
    assert [a for a in again.argv if a != str(landed)] == [a for a in first.argv if a != str(made)]


def test_start_server_runs_the_plan_argv_unchanged_with_the_key_in_the_environment(tiny, monkeypatch):
    preset, made = tiny
    hardware = Hardware.from_dict(json.loads(HARDWARE.read_text()))
    opts = sequence.RunOptions(model="tiny-moe", port=8123, api_key="sk-secret")
    the_plan = sequence.make_plan(hardware, preset, opts)
    seen = {}
    monkeypatch.setattr(
        launch, "start", lambda argv, env, info, secrets: seen.update(argv=argv, env=env, secrets=secrets)
    )
    sequence.start_server(preset, the_plan, made, opts)
    assert seen["argv"] == list(the_plan.argv) and seen["env"] == the_plan.env
    assert seen["secrets"] == {"VLLM_API_KEY": "sk-secret"} and "sk-secret" not in " ".join(seen["argv"])
