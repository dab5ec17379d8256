"""Small things a new user meets first: plain `bigmoe`, unknown commands, listing the presets,
nonsense numbers for --vram-gib/--context, and the machine shown as words, not Python values."""

from __future__ import annotations

import pytest
from bigmoe.cli import main
from bigmoe.model import presets
from bigmoe.plan.inputs import MIN_CONTEXT, Overrides, PlanError, check_overrides


def test_plain_bigmoe_prints_the_help_and_succeeds(bigmoe):
    code, out, err = bigmoe()
    assert code == 0 and out.startswith("Usage: bigmoe") and "run" in out and err == ""


@pytest.mark.parametrize(
    "args, hint",
    [
        (("bogus",), "'bigmoe --help'"),
        (("run",), "'bigmoe run --help'"),
        (("plan", "tiny-moe", "--bogus"), "'bigmoe plan --help'"),
    ],
)
def test_usage_errors_point_to_a_help_that_exists(bigmoe, args, hint):
    code, _, err = bigmoe(*args)
    assert code == 2 and err.count("\n") == 1 and hint in err and "bigmoe cli" not in err
    hinted = hint.strip("'").split()[1:]
    assert bigmoe(*hinted)[0] == 0


def test_presets_are_listed(bigmoe):
    code, out, _ = bigmoe("presets")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == presets.names()
    assert "made on this machine" in out and "Qwen/Qwen3.8-Flash-Next-FP8" in out


@pytest.mark.parametrize("field", ["vram_gib", "ram_gib", "disk_gib"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 0.0])
def test_gib_must_be_positive_and_finite(field, value):
    with pytest.raises(PlanError, match="positive, finite number of GiB"):
        check_overrides(presets.load("tiny-moe"), Overrides(**{field: value}))


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_vram_gib_nonsense_is_one_line_on_the_command_line(bigmoe, value):
    code, _, err = bigmoe("plan", "tiny-moe", "--vram-gib", value)
    assert code != 0 and err.count("\n") == 1 and err.startswith("bigmoe: ") and "--vram-gib" in err


@pytest.mark.parametrize("context, ok", [(1, False), (MIN_CONTEXT - 1, False), (MIN_CONTEXT, True)])
def test_plan_accepts_the_contexts_run_accepts(bigmoe, context, ok):
    from bigmoe.cli.commands import run

    run_min = next(p for p in run.params if p.name == "context").type.min
    assert run_min == MIN_CONTEXT
    if ok:
        check_overrides(presets.load("tiny-moe"), Overrides(context=context))
    else:
        with pytest.raises(PlanError, match=f"outside {MIN_CONTEXT}"):
            check_overrides(presets.load("tiny-moe"), Overrides(context=context))
        code, _, err = bigmoe("plan", "tiny-moe", "--context", str(context))
        assert code == 2 and "x>=128" in err


@pytest.mark.parametrize("wsl2, shown", [(True, "WSL2  yes"), (False, "WSL2  no")])
def test_the_tui_shows_wsl2_as_yes_or_no(wsl2, shown):
    import dataclasses

    from bigmoe.tui.plan_view import machine_lines

    from tests.unit.test_plan import machine

    hw = dataclasses.replace(machine("cpu-laptop"), wsl2=wsl2)
    assert shown in machine_lines(hw).plain


@pytest.mark.parametrize("command", [["plan"], ["run", "--yes"], ["pull"], ["verify"]])
def test_an_unknown_model_is_one_line_and_the_tables_error_in_every_command(bigmoe, command, tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path))
    code, _, err = bigmoe(command[0], "no-such-model", *command[1:])
    assert code == 1 and "unknown model" in err and len(err.strip().splitlines()) == 1
