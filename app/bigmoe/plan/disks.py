"""plan_disks: the disk side of a plan: space for the checkpoint and paging file, and
whether the disk the SSD tier reads can serve it (no HDD, no Windows drive, O_DIRECT works)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigmoe.machine.hardware import Disk, Unknown
from bigmoe.plan.memory import DISK_HEADROOM_BYTES, MemoryRow, MemoryTable
from bigmoe.plan.ssd_choice import paging_file_bytes
from bigmoe.units import MIB, size_text

if TYPE_CHECKING:
    from bigmoe.plan.draft import Draft


def disk_tables(d: "Draft") -> None:
    """Add one memory table per disk the plan writes to, and the refusals and notes they imply."""
    model_dir, paging_dir = d.dirs()
    model_disk, paging_disk = d.model_disk(), d.paging_disk()
    checkpoint = MemoryRow("checkpoint", d.checkpoint_bytes, _checkpoint_reason(d))
    groups: list[tuple[Disk | None, str, list[MemoryRow]]] = [(model_disk, model_dir, [checkpoint])]
    if d.paging:
        arch = d.preset.arch
        paging = MemoryRow(
            "paging file",
            paging_file_bytes(d, d.compress),
            f"{arch.experts} x {arch.moe_layers} experts x {d.eb / MIB:.2f} MiB"
            + (" x codec ratio (assumed)" if d.compress else " (raw records)"),
        )
        if d.same_disk(model_disk, paging_disk) is True:
            groups[0][2].append(paging)
        else:
            groups.append((paging_disk, paging_dir, [paging]))
    for disk, path, rows in groups:
        rows.append(MemoryRow("headroom", DISK_HEADROOM_BYTES, "logs and temporary files"))
        table = MemoryTable(f"disk {path}", _capacity(d, disk, path, checkpoint in rows), tuple(rows))
        if table.fits is False:
            items = " + ".join(f"{r.item} {size_text(r.bytes)}" for r in rows)
            d.refusals.append(
                f"disk full: {path} needs {size_text(table.used_bytes)} ({items}) "
                f"but has {size_text(table.capacity_bytes)} for it"
            )
        d.memory.append(table)
    _check_safety(d, model_disk, paging_disk)


def ssd_disk(d: "Draft") -> Disk | None:
    """The disk the SSD tier reads, None when there is no SSD tier or it was not probed."""
    source = d.ssd_source
    if source == "paging file":
        return d.paging_disk()
    if source == "checkpoint":
        return d.model_disk()
    return None


def _checkpoint_reason(d: "Draft") -> str:
    if d.ov.model_on_disk:
        return "already on disk"
    if d.preset.synthetic:
        return f"made locally ({d.dtype} experts)"
    return f"downloaded from {d.preset.hub_id}: dense weights, FP8 experts, n-gram table"


def _capacity(d: "Draft", disk: Disk | None, path: str, holds_checkpoint: bool) -> int | None:
    if disk is None:
        d.notes.append(f"the disk of {path} was not probed: its free space is not checked")
        return None
    if not isinstance(disk.free_bytes, int):
        d.notes.append(f"free space of {path} is {disk.free_bytes}: not checked (--disk-gib states it)")
        return None
    present = d.checkpoint_bytes if holds_checkpoint and d.ov.model_on_disk else 0
    return disk.free_bytes + present


def _check_safety(d: "Draft", model_disk: Disk | None, paging_disk: Disk | None) -> None:
    model_dir, paging_dir = d.dirs()
    for disk, path, what in (
        (model_disk, model_dir, "model"),
        (paging_disk if d.paging else None, paging_dir, "paging"),
    ):
        if disk is not None and disk.windows_drive is True:
            d.refusals.append(
                f"the {what} directory {path} is on a Windows drive seen through WSL ({disk.filesystem}): "
                "slow, and O_DIRECT does not work; use a directory in the Linux filesystem"
            )
    source = ssd_disk(d)
    if d.ssd_source != "none":
        where = d.dirs()[1] if d.ssd_source == "paging file" else model_dir
        if source is None:
            d.notes.append(f"the disk of {where} was not probed: the SSD tier's speed and O_DIRECT are not checked")
        elif source.kind == "hdd":
            d.refusals.append(
                f"the SSD tier would read experts from an HDD ({where}: {source.kind_basis}); "
                "put the model (or the paging directory) on an SSD"
            )
        elif source.o_direct is False:
            d.refusals.append(
                f"O_DIRECT reads do not work on {where} ({source.o_direct_basis}); the SSD tier needs them"
            )
        else:
            for value in (source.kind, source.o_direct):
                if isinstance(value, Unknown):
                    d.notes.append(f"SSD tier at {where}: {value}")
    if d.ngram and model_disk is not None and model_disk.kind == "hdd":
        d.refusals.append(
            f"the n-gram table is read row by row at random from the checkpoint; {model_dir} is on an HDD"
        )
