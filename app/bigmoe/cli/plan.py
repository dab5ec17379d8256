"""`bigmoe probe` and `bigmoe plan`: the machine report and the estimator on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bigmoe import exit_codes
from bigmoe.cli.options import GIB, plan_options
from bigmoe.cli.render import render_hardware, render_plan
from bigmoe.machine.hardware import DISK_KINDS
from bigmoe.machine.probe import probe as probe_machine
from bigmoe.model import presets
from bigmoe.plan import build
from bigmoe.plan.inputs import PlanError, default_model_dir, default_paging_dir

EXIT_REFUSED = exit_codes.PLAN_REFUSED
"""Exit code of `bigmoe plan` when the plan is refused (matches `bigmoe run`)."""


class PlanRefused(click.ClickException):
    """The estimator refused the plan; --force records the refusal and runs it anyway."""

    exit_code = EXIT_REFUSED


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--path",
    "paths",
    multiple=True,
    type=click.Path(),
    help="Judge the disk of this path (repeatable); default: the model and paging directories.",
)
@click.option(
    "--remeasure",
    is_flag=True,
    help="Measure link speeds (PCIe copies, disk reads) again instead of using the cached ones.",
)
@click.option("--no-measure", is_flag=True, help="Skip link speeds (neither cached nor measured).")
@click.option(
    "--root",
    type=click.Path(exists=True, file_okay=False),
    default="/",
    hidden=True,
    help="Probe a fixture tree instead of /.",
)
def probe(as_json: bool, paths: tuple[str, ...], remeasure: bool, no_measure: bool, root: str) -> None:
    """Report this machine's GPUs, RAM, CPU, WSL2, pinned-memory limit, disks and measured link speeds."""
    if remeasure and no_measure:
        raise click.UsageError("--remeasure and --no-measure contradict each other")
    chosen = [Path(p) for p in paths] or [Path(p) for p in _default_probe_paths()]
    hw = probe_machine(Path(root), chosen, measure=not no_measure, remeasure=remeasure)
    click.echo(json.dumps(hw.to_dict(), indent=2) if as_json else render_hardware(hw))


@click.command()
@click.argument("model")
@plan_options
@click.option(
    "--disk",
    type=click.Choice(DISK_KINDS),
    default=None,
    help="Plan for one disk of this kind (replaces the probed disks).",
)
@click.option("--disk-gib", type=GIB, default=None, help="Free space of the stated disk (GiB).")
@click.option("--gpu", default=None, help="Name of the stated GPU, e.g. 'RTX 4090' (VRAM looked up unless --vram-gib).")
@click.option("--wsl2/--no-wsl2", default=None, help="Plan for (or not for) a WSL2 machine.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--root",
    type=click.Path(exists=True, file_okay=False),
    default="/",
    hidden=True,
    help="Probe a fixture tree instead of /.",
)
def plan(model: str, as_json: bool, root: str, model_dir: str | None, **options) -> None:
    """Plan how MODEL runs here (or on the machine the options state), with a reason per choice.
    The vLLM command it prints is the one `bigmoe run` with the same options executes."""
    try:
        preset, model_dir = build.load(model, model_dir)
        overrides = build.stated(model_dir=model_dir, **options)
        result = build.build(build.probe_for(preset, overrides, Path(root)), preset, overrides)
    except (presets.PresetError, PlanError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_plan(result))
    if result.refusals and not result.forced:
        raise PlanRefused(f"plan refused: {result.refusal} (rerun with --force to accept it)")


@click.command("presets")
def list_presets() -> None:
    """List the models bigmoe knows (the MODEL of run, plan and pull)."""
    for name in presets.names():
        preset = presets.load(name)
        source = "made on this machine" if preset.synthetic else f"{preset.hub_id}@{preset.revision or 'main'}"
        click.echo(f"{name:<22} {source:<40} {preset.description}")


def _default_probe_paths() -> list[str]:
    return [default_model_dir(synthetic=True), default_model_dir(synthetic=False), default_paging_dir()]
