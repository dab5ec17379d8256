"""The text `bigmoe probe` and `bigmoe plan` print: the machine report and the plan, a reason per line."""

from __future__ import annotations

from bigmoe.machine.hardware import Hardware, Unknown
from bigmoe.plan.planner import Plan
from bigmoe.units import size_text


def render_hardware(hw: Hardware) -> str:
    lines = []
    if isinstance(hw.gpus, Unknown) or not hw.gpus:
        lines.append(f"GPU        {hw.gpus if isinstance(hw.gpus, Unknown) else 'none (NVML sees no GPU)'}")
    else:
        for g in hw.gpus:
            free = f" ({size_text(g.vram_free_bytes)} free)" if isinstance(g.vram_free_bytes, int) else ""
            lines.append(
                f"GPU {g.index}      {g.name}: {_size(g.vram_total_bytes)} VRAM{free}, compute {g.compute_capability}, "
                f"PCIe Gen{g.pcie_gen} x{g.pcie_width} (max)"
            )
            lines.append(f"    host-to-device {_rate(g.h2d_gbps, g.h2d_basis)}")
    lines += [
        f"RAM        {_size(hw.ram_total_bytes)} total, {_size(hw.ram_available_bytes)} available",
        f"CPU        {hw.cpu_cores} logical CPUs, AMX {_yes(hw.cpu_amx)}",
        f"    one thread expands compressed experts at {_rate(hw.cpu_expand_gbps, hw.cpu_expand_basis)}",
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
        f"  dense        {size_text(p.dense_bytes)}: {r['dense_bytes']}",
        f"  n-gram table {size_text(p.ngram_table_bytes)}: {r['ngram_table']}",
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
        capacity = "capacity unknown" if table.capacity_bytes is None else f"of {size_text(table.capacity_bytes)}"
        verdict = {True: "fits", False: "DOES NOT FIT", None: "not checked"}[table.fits]
        lines.append(f"{table.tier}: {size_text(table.used_bytes)} {capacity} ({verdict})")
        lines += [f"  {row.item:<22} {size_text(row.bytes):>10}  {row.reason}" for row in table.rows]
    lines.append("vLLM: " + " ".join(_quote(a) for a in p.argv))
    lines += [f"  {k}={v}" for k, v in p.env.items()]
    lines += ["measured: " + m for m in p.measured]
    lines += ["assumed: " + a for a in p.assumptions]
    lines += ["note: " + n for n in p.notes]
    if p.refusals:
        lines += [("forced despite: " if p.forced else "refused: ") + x for x in p.refusals]
    return "\n".join(lines)


def _size(value: int | Unknown) -> str:
    return size_text(value, smallest="MiB")


def _rate(gbps: float | Unknown, basis: str) -> str:
    return f"{gbps:.2f} GB/s measured ({basis})" if isinstance(gbps, float) else f"not measured: {gbps}"


def _yes(value: bool | Unknown) -> str:
    return {True: "yes", False: "no"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in ' {}"') else arg
