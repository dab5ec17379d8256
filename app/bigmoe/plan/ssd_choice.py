"""ssd_choice: where the SSD tier reads experts from, and in which form: the checkpoint in place, a paging file of
raw records, or one of compressed records.

Each is priced at what a GB of experts costs the SSD tier (plan/speed.ssd_ms_per_gb, the estimate's own model):
raw records at their disk's read rate, compressed ones at 0.86 of the bytes plus their expansion on the CPU. A paging
file is a second copy of every expert and takes a while to build, so it is made only where it is clearly cheaper
than the checkpoint in place (the checkpoint on a slow disk, the paging directory on a fast one), and only where its
disk has room and can serve it. `--compress on` asks for a compressed paging file whatever the prices; `--compress
off` for no compression (a raw paging file may still pay).
"""

from __future__ import annotations

from dataclasses import dataclass

from bigmoe.machine.hardware import Hardware
from bigmoe.plan.memory import CODEC_RATIO, DISK_HEADROOM_BYTES
from bigmoe.plan.speed import disk_read_gbps, expand_rate, expand_threads, ssd_ms_per_gb
from bigmoe.plan.storage import Storage
from bigmoe.units import size_text

PAGING_MARGIN = 0.2
"""A paging file is made only when a GB of experts costs the SSD tier this share less from it than from the
checkpoint in place."""
COMPRESS_MARGIN = 0.05
"""Between the two paging files, compressed records are chosen only when this share cheaper than raw ones."""


@dataclass(frozen=True)
class SsdChoice:
    """Where the SSD tier reads experts from."""

    paging: bool
    """A paging file in the paging directory (else the checkpoint's safetensors in place)."""
    compress: bool
    """Its records are compressed (only with a paging file)."""
    reason: str
    """Why, one line: the plan's `compress` reason."""


def choose(storage: Storage, hw: Hardware, option: str, fp8: bool, raw_fit: int) -> SsdChoice:
    """The SSD tier's source for a plan whose RAM holds raw_fit experts a layer (every one: no SSD tier).
    option: --compress (on, off or auto); fp8: the planned experts are FP8 (the codec's only input)."""
    if option == "on":
        return SsdChoice(True, True, "set by --compress on")
    if raw_fit >= storage.layer_experts:
        return SsdChoice(False, False, "off: RAM holds every expert, so nothing is read from SSD")
    checkpoint, raw, packed = _prices(storage, hw)
    compress = fp8 and option != "off" and packed.ms < raw.ms * (1 - COMPRESS_MARGIN)
    paging = packed if compress else raw
    prices = "; ".join(p.words for p in (checkpoint, raw, packed) if p is not packed or fp8)
    prices += "" if fp8 else "; the codec compresses FP8 experts only"
    prices += "; compression off (--compress off)" if option == "off" else ""
    if paging.ms > checkpoint.ms * (1 - PAGING_MARGIN):
        return SsdChoice(False, False, f"off, the checkpoint in place: {prices}")
    unfit = _paging_dir_unfit(storage, compress)
    if unfit:
        return SsdChoice(False, False, f"off, the checkpoint in place: {unfit}; {prices}")
    form = "compressed" if compress else "raw"
    return SsdChoice(True, compress, f"{'on' if compress else 'off'}, a {form} paging file: {prices}")


@dataclass(frozen=True)
class _Price:
    ms: float
    """ms the SSD tier spends per GB of experts from this source."""
    words: str
    """The same, and what it rests on, for the reason."""


def _prices(storage: Storage, hw: Hardware) -> tuple[_Price, _Price, _Price]:
    """The checkpoint in place, a raw paging file and a compressed one."""
    model_gbps, model_measured = disk_read_gbps(storage.model_disk)
    paging_gbps, paging_measured = disk_read_gbps(storage.paging_disk)
    expand_gbps, expand_measured = expand_rate(hw.cpu_expand_gbps)
    threads = expand_threads(hw.cpu_cores)
    how = {True: "measured", False: "assumed"}
    checkpoint, raw = ssd_ms_per_gb(model_gbps), ssd_ms_per_gb(paging_gbps)
    packed = ssd_ms_per_gb(paging_gbps, CODEC_RATIO, expand_gbps, threads)
    return (
        _Price(checkpoint, f"the checkpoint at {model_gbps:g} GB/s ({how[model_measured]}) costs {checkpoint:.0f} ms "
               "per GB of experts"),
        _Price(raw, f"a raw paging file at {paging_gbps:g} GB/s ({how[paging_measured]}) {raw:.0f} ms"),
        _Price(packed, f"a compressed one (ratio {CODEC_RATIO}, assumed; expanded at {expand_gbps:g} GB/s x "
               f"{threads} CPU threads, {how[expand_measured]}) {packed:.0f} ms"),
    )  # fmt: skip


def _paging_dir_unfit(storage: Storage, compress: bool) -> str:
    """Why the paging directory cannot hold or serve the paging file, or ""."""
    paging = storage.paging_disk
    if paging is None:
        return ""
    size = storage.paging_file_bytes(compress)
    need = size + (0 if storage.same_disk is False else storage.checkpoint_new_bytes)
    if isinstance(paging.free_bytes, int) and need + DISK_HEADROOM_BYTES > paging.free_bytes:
        return f"no room for a {size_text(size)} paging file on {paging.path}"
    if paging.windows_drive is True or paging.kind == "hdd":
        return f"the paging directory is on {'a Windows drive' if paging.windows_drive is True else 'an HDD'}"
    return ""
