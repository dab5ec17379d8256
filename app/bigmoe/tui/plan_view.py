"""The machine and the plan as Rich renderables: every number beside the reason for it.

Pure functions of Hardware and Plan, so the plan screen and its snapshot test show the same thing."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bigmoe.machine.hardware import Hardware, Unknown, known
from bigmoe.plan.planner import Plan
from bigmoe.units import size_text

CHOICE_ORDER = (
    "device",
    "dtype",
    "moe_layers",
    "experts",
    "top_k",
    "expert_bytes",
    "dense_bytes",
    "ngram_table",
    "context",
    "kv_cache",
    "vram_slots",
    "ram_slots",
    "compress",
    "ssd_source",
    "ngram",
    "env",
    "argv",
)
"""Plan.reasons keys in the order a person reads them; keys not listed follow in the plan's order."""


def choice_values(plan: Plan) -> dict[str, str]:
    """Reason key -> the value it explains."""
    on_off = {True: "on", False: "off"}
    return {
        "device": plan.device,
        "dtype": f"{plan.expert_dtype} experts",
        "moe_layers": str(plan.layers),
        "experts": f"{plan.experts} / layer",
        "top_k": str(plan.top_k),
        "expert_bytes": f"{plan.expert_bytes / (1 << 20):.2f} MiB",
        "dense_bytes": size_text(plan.dense_bytes),
        "ngram_table": size_text(plan.ngram_table_bytes),
        "context": f"{plan.context} tokens",
        "kv_cache": size_text(plan.kv_cache_bytes),
        "vram_slots": f"{plan.vram_slots} of {plan.experts} / layer",
        "ram_slots": f"{plan.ram_slots} of {plan.experts} / layer",
        "compress": on_off[plan.compress],
        "ssd_source": plan.ssd_source,
        "ngram": "paged" if plan.ngram else "off",
        "env": f"{len(plan.env)} variables",
        "argv": f"{len(plan.argv)} arguments",
    }


def choices_table(plan: Plan) -> Table:
    table = Table(title="Plan", title_justify="left", expand=True, show_edge=False, pad_edge=False)
    table.add_column("choice", style="bold", no_wrap=True)
    table.add_column("value", style="cyan", no_wrap=True)
    table.add_column("reason", ratio=1, overflow="fold")
    values = choice_values(plan)
    keys = [k for k in CHOICE_ORDER if k in plan.reasons] + [k for k in plan.reasons if k not in CHOICE_ORDER]
    for key in keys:
        table.add_row(key.replace("_", " "), values.get(key, ""), plan.reasons[key])
    return table


def estimate_table(plan: Plan) -> Table:
    est = plan.estimate
    table = Table(
        title="Expected speed (best - worst)", title_justify="left", expand=False, show_edge=False, pad_edge=False
    )
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("range", style="cyan", no_wrap=True)
    table.add_row("TPOT", f"{est.tpot_ms[0]:.1f} - {est.tpot_ms[1]:.1f} ms")
    table.add_row("VRAM hit rate", f"{est.vram_hit[0]:.0%} - {est.vram_hit[1]:.0%}")
    table.add_row("RAM hit rate", f"{est.ram_hit[0]:.0%} - {est.ram_hit[1]:.0%}")
    table.add_row("PCIe per token", f"{est.pcie_mib_per_token[0]:.0f} - {est.pcie_mib_per_token[1]:.0f} MiB")
    table.add_row("SSD per token", f"{est.ssd_mib_per_token[0]:.0f} - {est.ssd_mib_per_token[1]:.0f} MiB")
    return table


def memory_tables(plan: Plan) -> list[Table]:
    out = []
    for mem in plan.memory:
        capacity = "capacity unknown" if mem.capacity_bytes is None else f"of {size_text(mem.capacity_bytes)}"
        fits = {True: "fits", False: "DOES NOT FIT", None: "not checked"}[mem.fits]
        table = Table(
            title=f"{mem.tier}: {size_text(mem.used_bytes)} {capacity} ({fits})",
            title_justify="left",
            title_style="bold red" if mem.fits is False else "bold",
            expand=True,
            show_edge=False,
            pad_edge=False,
        )
        table.add_column("item", no_wrap=True)
        table.add_column("size", style="cyan", justify="right", no_wrap=True)
        table.add_column("reason", ratio=1, overflow="fold")
        for row in mem.rows:
            table.add_row(row.item, size_text(row.bytes), row.reason)
        out.append(table)
    return out


def machine_table(hw: Hardware) -> Table:
    """What the probe found, with what each answer rests on."""
    table = Table(title="Machine", title_justify="left", expand=True, show_edge=False, pad_edge=False)
    table.add_column("part", style="bold", no_wrap=True)
    table.add_column("found", ratio=1)
    gpus = hw.gpus
    if isinstance(gpus, Unknown):
        table.add_row("GPU", str(gpus))
    elif not gpus:
        table.add_row("GPU", "none (NVML sees no NVIDIA GPU)")
    for gpu in () if isinstance(gpus, Unknown) else gpus:
        pcie = (
            f"PCIe Gen{gpu.pcie_gen} x{gpu.pcie_width}"
            if known(gpu.pcie_gen) and known(gpu.pcie_width)
            else f"PCIe {gpu.pcie_gen}"
        )
        stated = " (stated)" if gpu.stated else ""
        table.add_row(
            f"GPU {gpu.index}",
            f"{gpu.name}{stated}: {size_text(gpu.vram_total_bytes)} VRAM, {size_text(gpu.vram_free_bytes)} free, "
            f"compute {gpu.compute_capability}, {pcie}; host-to-device {_rate(gpu.h2d_gbps)}",
        )
    table.add_row(
        "RAM",
        f"{size_text(hw.ram_available_bytes)} available of {size_text(hw.ram_total_bytes)}"
        + (" (stated)" if hw.ram_stated else ""),
    )
    amx = (
        {True: "with AMX", False: "no AMX"}.get(hw.cpu_amx, f"AMX {hw.cpu_amx}")
        if known(hw.cpu_amx)
        else f"AMX {hw.cpu_amx}"
    )
    table.add_row(
        "CPU", f"{hw.cpu_cores} cores, {amx}; one thread expands compressed experts at {_rate(hw.cpu_expand_gbps)}"
    )
    table.add_row("WSL2", f"{yes_no(hw.wsl2)} ({hw.wsl2_basis})")
    table.add_row("pinned limit", "unlimited" if hw.memlock_bytes is None else size_text(hw.memlock_bytes))
    for disk in hw.disks:
        o_direct = (
            {True: "works", False: "fails"}.get(disk.o_direct, str(disk.o_direct))
            if known(disk.o_direct)
            else str(disk.o_direct)
        )
        table.add_row(
            f"disk {disk.path}",
            f"{disk.kind} ({disk.kind_basis}), {disk.filesystem}, {size_text(disk.free_bytes)} free; "
            f"O_DIRECT {o_direct} ({disk.o_direct_basis}); reads {_rate(disk.read_gbps)}",
        )
    return table


def yes_no(value) -> str:
    """A probed bool as yes/no; an Unknown as its reason."""
    return {True: "yes", False: "no"}[value] if isinstance(value, bool) else str(value)


def _rate(gbps) -> str:
    return f"{gbps:.2f} GB/s (measured)" if isinstance(gbps, float) else "not measured"


def machine_lines(hw: Hardware) -> Text:
    """The machine in a few short lines, for the narrow column beside the form."""
    gpu = hw.gpu()
    gpu_text = (
        f"{gpu.name}, {size_text(gpu.vram_total_bytes)}"
        if gpu
        else ("none" if not isinstance(hw.gpus, Unknown) else "unknown")
    )
    lines = [
        f"GPU   {gpu_text}",
        f"RAM   {size_text(hw.ram_available_bytes)} free of {size_text(hw.ram_total_bytes)}",
        f"CPU   {hw.cpu_cores} cores",
        f"WSL2  {yes_no(hw.wsl2)}",
    ]
    lines += [f"disk  {d.path}: {d.kind}, {size_text(d.free_bytes)} free" for d in _distinct_disks(hw)]
    return Text("\n".join(lines))


def _distinct_disks(hw: Hardware):
    seen = set()
    for disk in hw.disks:
        if disk.path not in seen:
            seen.add(disk.path)
            yield disk


def verdict(plan: Plan) -> Text:
    """One line on top: refused (and whether forced), or the expected TPOT."""
    if plan.refusals and not plan.forced:
        return Text("REFUSED: " + plan.refusal, style="bold red")
    if plan.refusals:
        return Text("FORCED despite: " + plan.refusal, style="bold yellow")
    low, high = plan.estimate.tpot_ms
    return Text(f"Safe to launch; expected TPOT {low:.1f} - {high:.1f} ms", style="bold green")


def plan_renderable(plan: Plan) -> RenderableType:
    """Everything about a plan, top to bottom: verdict, notes, choices, speed, memory, machine, command."""
    parts: list[RenderableType] = [verdict(plan)]
    parts += [Text("note: " + note, style="yellow") for note in plan.notes]
    parts += [Text(""), choices_table(plan), Text(""), estimate_table(plan)]
    parts += [Text("  measured: " + m) for m in plan.measured]
    parts += [Text("  assumed: " + a, style="dim") for a in plan.assumptions]
    for table in memory_tables(plan):
        parts += [Text(""), table]
    parts += [Text(""), machine_table(plan.hardware), Text(""), Text("Command", style="bold")]
    parts.append(Text(" ".join(f"{k}={v}" for k, v in sorted(plan.env.items()))))
    parts.append(Text(" ".join(plan.argv)))
    return Group(*parts)
