"""`bigmoe run --vram-gib/--ram-gib` plans as `bigmoe plan` does for the same budgets: fewer VRAM slots for less
VRAM, fewer RAM slots (so an SSD tier) for less RAM, and a budget that is no number is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bigmoe import run as sequence
from bigmoe.cli import main
from bigmoe.machine.hardware import Hardware
from bigmoe.model import presets
from bigmoe.plan.inputs import PlanError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"


@pytest.fixture
def h200(monkeypatch, tmp_path):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    return Hardware.from_dict(json.loads((FIXTURES / "h200.json").read_text()))


@pytest.mark.parametrize("model, vram_gib, ram_gib", [("qwen3.6-35b-a3b", 16, 24), ("qwen3.8-flash-next", 24, 64)])
def test_budgets_shrink_the_tiers_of_the_run_plan(h200, model, vram_gib, ram_gib):
    preset = presets.load(model)
    whole = sequence.make_plan(h200, preset, sequence.RunOptions(model=model))
    small = sequence.make_plan(h200, preset, sequence.RunOptions(model=model, vram_gib=vram_gib, ram_gib=ram_gib))
    assert small.vram_slots < whole.vram_slots
    assert small.vram_slots <= small.ram_slots < small.experts  # all three tiers
    assert small.argv[small.argv.index("--max-cudagraph-capture-size") + 1] == str(small.vram_slots // small.top_k)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_budget_that_is_no_number_is_refused(h200, value):
    preset = presets.load("qwen3.6-35b-a3b")
    with pytest.raises(PlanError):
        sequence.make_plan(h200, preset, sequence.RunOptions(model="qwen3.6-35b-a3b", vram_gib=value))


def test_run_takes_the_budget_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "tiny-moe", "--yes", "--vram-gib", "-1"])
    assert exit_.value.code == 2
    assert "--vram-gib" in capsys.readouterr().err
