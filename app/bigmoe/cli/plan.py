"""`bigmoe probe` and `bigmoe plan`: the machine report and the estimator on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bigmoe.cli import exit_codes
from bigmoe.machine.hardware import DISK_KINDS, Hardware, Unknown
from bigmoe.machine.probe import probe as probe_machine
from bigmoe.model import presets
from bigmoe.model.checkpoint_arch import facts_for, find_checkpoint
from bigmoe.plan.inputs import MIN_CONTEXT, default_model_dir, default_paging_dir
from bigmoe.plan.memory import gib
from bigmoe.plan.planner import Overrides, Plan, PlanError, default_dirs
from bigmoe.plan.planner import plan as make_plan

EXIT_REFUSED = exit_codes.PLAN_REFUSED
"""Exit code of `bigmoe plan` when the plan is refused (matches `bigmoe run`)."""

_GIB = click.FloatRange(min=0, min_open=True)


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
@click.option("--vram-gib", type=_GIB, default=None, help="Plan for a GPU with this much VRAM (GiB).")
@click.option("--ram-gib", type=_GIB, default=None, help="Plan for this much RAM (GiB).")
@click.option(
    "--disk",
    type=click.Choice(DISK_KINDS),
    default=None,
    help="Plan for one disk of this kind (replaces the probed disks).",
)
@click.option("--disk-gib", type=_GIB, default=None, help="Free space of the stated disk (GiB).")
@click.option("--gpu", default=None, help="Name of the stated GPU, e.g. 'RTX 4090' (VRAM looked up unless --vram-gib).")
@click.option("--wsl2/--no-wsl2", default=None, help="Plan for (or not for) a WSL2 machine.")
@click.option("--context", type=click.IntRange(MIN_CONTEXT), default=None, help="Context length (tokens).")
@click.option("--vram-slots", type=click.IntRange(1), default=None, help="VRAM expert slots per layer.")
@click.option("--ram-slots", type=click.IntRange(1), default=None, help="Pinned RAM expert slots per layer.")
@click.option(
    "--compress",
    type=click.Choice(["on", "off", "auto"]),
    default=None,
    help="Lossless FP8 codec for the SSD tier's paging file (records are expanded as they enter RAM).",
)
@click.option("--paging-dir", type=click.Path(file_okay=False), default=None, help="Directory of the paging file.")
@click.option(
    "--model-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Plan for this checkpoint directory (its config.json gives the architecture numbers).",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address the server binds (as `bigmoe run --host`)."
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the API (as `bigmoe run --port`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--force", is_flag=True, help="Accept a refused plan (the refusal stays recorded).")
@click.option(
    "--cuda-graphs/--eager",
    default=True,
    show_default=True,
    help="CUDA: the device-driven pager with decode in CUDA graphs, or the host-driven one in eager mode.",
)
@click.option(
    "--prefill-buffer/--no-prefill-buffer",
    default=None,
    help=(
        "CUDA, device-driven pager: prefill over a VRAM buffer of one whole layer's experts "
        "(default: when VRAM allows)."
    ),
)
@click.option(
    "--speculative-tokens",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="Speculative decoding with the model's MTP head: draft tokens per step (0 = off).",
)
@click.option(
    "--root",
    type=click.Path(exists=True, file_okay=False),
    default="/",
    hidden=True,
    help="Probe a fixture tree instead of /.",
)
def plan(model: str, as_json: bool, root: str, **options) -> None:
    """Plan how MODEL runs here (or on the machine the options state), with a reason per choice."""
    try:
        preset = presets.load(model)
        model_dir, paging_dir = default_dirs(preset)
        if not options["model_dir"] and presets.is_checkpoint_dir(model):
            options["model_dir"] = model  # MODEL is a checkpoint directory: plan for it
        given = str(Path(options["model_dir"]).expanduser()) if options["model_dir"] else None
        overrides = Overrides(
            model_dir=given or model_dir,
            model_path=given,
            model_on_disk=given is not None,
            paging_dir=options["paging_dir"] or paging_dir,
            compress=None if options["compress"] == "auto" else options["compress"],
            **{k: v for k, v in options.items() if k not in ("paging_dir", "compress", "model_dir")},
        )
        stated_disk = overrides.disk is not None or overrides.disk_gib is not None
        paths = [] if stated_disk else [Path(overrides.model_dir), Path(overrides.paging_dir)]
        hw = probe_machine(Path(root), paths, measure=True)
        dtypes = (
            (preset.dtype_gpu, preset.dtype_cpu)
            if hw.gpu() is not None or overrides.vram_gib or overrides.gpu
            else (preset.dtype_cpu, preset.dtype_gpu)
        )
        checkpoint, why_not = find_checkpoint(preset, given, dtypes)
        if given and checkpoint is None:
            raise PlanError(f"--model-dir {given}: {why_not}")
        result = make_plan(hw, preset, overrides, facts_for(preset, str(checkpoint) if checkpoint else None, why_not))
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


# ---- text rendering -------------------------------------------------------------------------


def render_hardware(hw: Hardware) -> str:
    lines = []
    if isinstance(hw.gpus, Unknown) or not hw.gpus:
        lines.append(f"GPU        {hw.gpus if isinstance(hw.gpus, Unknown) else 'none (NVML sees no GPU)'}")
    else:
        for g in hw.gpus:
            free = f" ({gib(g.vram_free_bytes)} free)" if isinstance(g.vram_free_bytes, int) else ""
            lines.append(
                f"GPU {g.index}      {g.name}: {_size(g.vram_total_bytes)} VRAM{free}, compute {g.compute_capability}, "
                f"PCIe Gen{g.pcie_gen} x{g.pcie_width} (max)"
            )
            lines.append(f"    host-to-device {_rate(g.h2d_gbps, g.h2d_basis)}")
    lines += [
        f"RAM        {_size(hw.ram_total_bytes)} total, {_size(hw.ram_available_bytes)} available",
        f"CPU        {hw.cpu_cores} logical CPUs, AMX {_yes(hw.cpu_amx)}",
        f"WSL2       {_yes(hw.wsl2)} ({hw.wsl2_basis})",
        f"ulimit -l  {'unlimited' if hw.memlock_bytes is None else _size(hw.memlock_bytes)}",
    ]
    for d in hw.disks:
        lines.append(f"disk {d.path}")
        lines.append(f"    kind {d.kind} ({d.kind_basis}); device {d.device}")
        lines.append(
            f"    filesystem {d.filesystem} at {d.mount_point}; Windows drive {_yes(d.windows_drive)}; "
            f"{_size(d.free_bytes)} free"
        )
        lines.append(f"    O_DIRECT {_yes(d.o_direct)} ({d.o_direct_basis})")
        lines.append(f"    reads {_rate(d.read_gbps, d.read_basis)}")
    return "\n".join(lines)


def render_plan(p: Plan) -> str:
    r = p.reasons
    lines = [
        f"plan for {p.model} on {p.device} ({p.expert_dtype} experts)",
        f"  device       {r['device']}",
        f"  dtype        {r['dtype']}",
        f"  MoE layers   {p.layers}: {r['moe_layers']}",
        f"  experts      {p.experts} per layer: {r['experts']}",
        f"  top-k        {p.top_k}: {r['top_k']}",
        f"  expert size  {p.expert_bytes / (1 << 20):.2f} MiB: {r['expert_bytes']}",
        f"  dense        {gib(p.dense_bytes)}: {r['dense_bytes']}",
        f"  n-gram table {gib(p.ngram_table_bytes)}: {r['ngram_table']}",
        f"  context      {p.context} tokens: {r['context']}",
        f"  VRAM slots   {p.vram_slots} of {p.experts} per layer: {r['vram_slots']}",
        f"  RAM slots    {p.ram_slots} of {p.experts} per layer: {r['ram_slots']}",
        f"  compression  {r['compress']}",
        *([f"  prefill      {r['prefill_buffer']}"] if "prefill_buffer" in r else []),  # CUDA plans only
        f"  SSD tier     {p.ssd_source}: {r['ssd_source']}",
        f"  n-gram       {'paged' if p.ngram else 'none'}: {r['ngram']}",
        f"  TPOT         {p.estimate.tpot_ms[0]:.1f} to {p.estimate.tpot_ms[1]:.1f} ms expected "
        f"(VRAM hit {p.estimate.vram_hit[1]:.0%}-{p.estimate.vram_hit[0]:.0%}, "
        f"RAM or better {p.estimate.ram_hit[1]:.0%}-{p.estimate.ram_hit[0]:.0%})",
    ]
    for table in p.memory:
        capacity = "capacity unknown" if table.capacity_bytes is None else f"of {gib(table.capacity_bytes)}"
        verdict = {True: "fits", False: "DOES NOT FIT", None: "not checked"}[table.fits]
        lines.append(f"{table.tier}: {gib(table.used_bytes)} {capacity} ({verdict})")
        lines += [f"  {row.item:<22} {gib(row.bytes):>10}  {row.reason}" for row in table.rows]
    lines.append("vLLM: " + " ".join(_quote(a) for a in p.argv))
    lines += [f"  {k}={v}" for k, v in p.env.items()]
    lines += ["measured: " + m for m in p.measured]
    lines += ["assumed: " + a for a in p.assumptions]
    lines += ["note: " + n for n in p.notes]
    if p.refusals:
        lines += [("forced despite: " if p.forced else "refused: ") + x for x in p.refusals]
    return "\n".join(lines)


def _size(value: int | Unknown) -> str:
    if not isinstance(value, int):
        return str(value)
    return gib(value) if value >= 1 << 30 else f"{value / (1 << 20):.1f} MiB"


def _rate(gbps: float | Unknown, basis: str) -> str:
    return f"{gbps:.2f} GB/s measured ({basis})" if isinstance(gbps, float) else f"not measured: {gbps}"


def _yes(value: bool | Unknown) -> str:
    return {True: "yes", False: "no"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in ' {}"') else arg
