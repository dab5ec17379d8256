"""plan_disks: the disk side of a plan: space for the checkpoint and paging file, and
whether the disk the SSD tier reads can serve it (no HDD, no Windows drive, O_DIRECT works)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigmoe.machine.hardware import Disk, Unknown
from bigmoe.plan.memory import DISK_HEADROOM_BYTES, MemoryRow, MemoryTable
from bigmoe.plan.storage import Storage
from bigmoe.units import MIB, size_text


@dataclass
class DiskCheck:
    """What the disks add to a plan."""

    tables: list[MemoryTable] = field(default_factory=list)
    """One memory table per disk the plan writes to."""
    refusals: list[str] = field(default_factory=list)
    """Why the plan cannot run on these disks (full, an HDD or a Windows drive for the SSD tier, no O_DIRECT)."""
    notes: list[str] = field(default_factory=list)
    """What was not checked, and why."""


def disk_tables(storage: Storage, paging: bool, compress: bool, ssd_source: str, ngram: bool) -> DiskCheck:
    """The disk tables of a plan that makes a paging file (paging, compressed or not) or not, whose SSD tier reads
    `ssd_source` (Plan.ssd_source), and whose model has an n-gram table (ngram); with their refusals and notes."""
    out = DiskCheck()
    checkpoint = MemoryRow("checkpoint", storage.checkpoint_bytes, storage.checkpoint_origin)
    groups: list[tuple[Disk | None, str, list[MemoryRow]]] = [(storage.model_disk, storage.model_dir, [checkpoint])]
    if paging:
        paging_row = MemoryRow(
            "paging file",
            storage.paging_file_bytes(compress),
            f"{storage.layer_experts} x {storage.moe_layers} experts x {storage.expert_bytes / MIB:.2f} MiB"
            + (" x codec ratio (assumed)" if compress else " (raw records)"),
        )
        if storage.same_disk is True:
            groups[0][2].append(paging_row)
        else:
            groups.append((storage.paging_disk, storage.paging_dir, [paging_row]))
    for disk, path, rows in groups:
        rows.append(MemoryRow("headroom", DISK_HEADROOM_BYTES, "logs and temporary files"))
        table = MemoryTable(f"disk {path}", _capacity(storage, out, disk, path, checkpoint in rows), tuple(rows))
        if table.fits is False:
            items = " + ".join(f"{r.item} {size_text(r.bytes)}" for r in rows)
            out.refusals.append(
                f"disk full: {path} needs {size_text(table.used_bytes)} ({items}) "
                f"but has {size_text(table.capacity_bytes)} for it"
            )
        out.tables.append(table)
    _check_safety(storage, out, paging, ssd_source, ngram)
    return out


def _capacity(storage: Storage, out: DiskCheck, disk: Disk | None, path: str, holds_checkpoint: bool) -> int | None:
    if disk is None:
        out.notes.append(f"the disk of {path} was not probed: its free space is not checked")
        return None
    if not isinstance(disk.free_bytes, int):
        out.notes.append(f"free space of {path} is {disk.free_bytes}: not checked (--disk-gib states it)")
        return None
    present = storage.checkpoint_bytes if holds_checkpoint and storage.model_on_disk else 0
    return disk.free_bytes + present


def _check_safety(storage: Storage, out: DiskCheck, paging: bool, ssd_source: str, ngram: bool) -> None:
    model_dir, paging_dir = storage.model_dir, storage.paging_dir
    for disk, path, what in (
        (storage.model_disk, model_dir, "model"),
        (storage.paging_disk if paging else None, paging_dir, "paging"),
    ):
        if disk is not None and disk.windows_drive is True:
            out.refusals.append(
                f"the {what} directory {path} is on a Windows drive seen through WSL ({disk.filesystem}): "
                "slow, and O_DIRECT does not work; use a directory in the Linux filesystem"
            )
    source = storage.ssd_disk(ssd_source)
    if ssd_source != "none":
        where = paging_dir if ssd_source == "paging file" else model_dir
        if source is None:
            out.notes.append(f"the disk of {where} was not probed: the SSD tier's speed and O_DIRECT are not checked")
        elif source.kind == "hdd":
            out.refusals.append(
                f"the SSD tier would read experts from an HDD ({where}: {source.kind_basis}); "
                "put the model (or the paging directory) on an SSD"
            )
        elif source.o_direct is False:
            out.refusals.append(
                f"O_DIRECT reads do not work on {where} ({source.o_direct_basis}); the SSD tier needs them"
            )
        else:
            for value in (source.kind, source.o_direct):
                if isinstance(value, Unknown):
                    out.notes.append(f"SSD tier at {where}: {value}")
    if ngram and storage.model_disk is not None and storage.model_disk.kind == "hdd":
        out.refusals.append(
            f"the n-gram table is read row by row at random from the checkpoint; {model_dir} is on an HDD"
        )
