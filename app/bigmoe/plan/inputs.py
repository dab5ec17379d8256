"""plan_inputs: what a person may state to the planner (Overrides), their checks, and the
machine they describe (the probed one with the stated parts put in)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bigmoe_pager.settings import COMPRESS_CHOICES

from bigmoe.errors import BigmoeError
from bigmoe.machine.hardware import DISK_KINDS, Disk, Gpu, Hardware, Unknown
from bigmoe.model.presets import Preset
from bigmoe.plan.speed import gpu_spec
from bigmoe.units import GIB

MIN_CONTEXT = 128
"""Shortest context (tokens) `plan` and `run` accept: below it a chat template alone does not fit."""
MAX_GIB = float(1 << 20)
"""Largest size in GiB (1 PiB) --vram-gib, --ram-gib and --disk-gib accept: beyond any machine, and far below
where a size in bytes stops fitting a float."""


class PlanError(BigmoeError):
    """An override makes no sense for this model or machine; the message is one line."""


@dataclass(frozen=True)
class Overrides:
    """What the person stated; each field beats the probe or the estimator when set."""

    vram_gib: float | None = None
    """Plan for a GPU with this much VRAM (GiB) instead of the probed one."""
    ram_gib: float | None = None
    """Plan for this much RAM (GiB) instead of the probed amount."""
    disk: str | None = None
    """Plan for one disk of this kind (nvme/sata/hdd/virtual) instead of the probed disks."""
    disk_gib: float | None = None
    """Free space (GiB) of the stated disk."""
    gpu: str | None = None
    """Name of the stated GPU (its VRAM is looked up when --vram-gib is not given)."""
    wsl2: bool | None = None
    """Plan for a WSL2 machine."""
    context: int | None = None
    """Context length in tokens."""
    vram_slots: int | None = None
    """VRAM expert slots per MoE layer."""
    ram_slots: int | None = None
    """Pinned RAM expert slots per MoE layer."""
    compress: str | None = None
    """on / off / auto for the lossless FP8 codec."""
    paging_dir: str | None = None
    """Directory of the paging file."""
    model_dir: str | None = None
    """Directory the checkpoint is (or will be) stored under."""
    model_path: str | None = None
    """Checkpoint directory vLLM serves; None = hub id (vLLM finds it in the cache) or the synthetic model's path."""
    model_on_disk: bool = False
    """The checkpoint is already stored, so its bytes need no new space."""
    host: str = "127.0.0.1"
    """Address vLLM binds."""
    port: int = 8000
    """Port of the OpenAI-compatible API."""
    force: bool = False
    """Keep a refused plan runnable; the refusal stays recorded."""
    cuda_graphs: bool = True
    """On CUDA: the device-driven pager with decode in CUDA graphs (False: the host-driven one in eager mode)."""
    prefill_buffer: bool | None = None
    """On CUDA, device-driven: a VRAM buffer of one whole layer's experts for prefill (None = when VRAM allows it)."""
    speculative_tokens: int = 0
    """Draft tokens per step from the model's MTP head (vLLM speculative decoding); 0 = off."""


def check_overrides(preset: Preset, ov: Overrides) -> None:
    arch = preset.arch
    for name in ("vram_gib", "ram_gib", "disk_gib"):
        value = getattr(ov, name)
        if value is not None and not 0 < value <= MAX_GIB:  # nan fails both comparisons
            raise PlanError(
                f"--{name.replace('_', '-')} {value} must be a positive, finite number of GiB (at most {MAX_GIB:.0f})"
            )
    if ov.disk is not None and ov.disk not in DISK_KINDS:
        raise PlanError(f"--disk {ov.disk!r} is not one of {', '.join(DISK_KINDS)}")
    if ov.compress is not None and ov.compress not in COMPRESS_CHOICES:
        raise PlanError(f"--compress {ov.compress!r} is not one of {', '.join(COMPRESS_CHOICES)}")
    if ov.gpu is not None and ov.vram_gib is None and gpu_spec(ov.gpu) is None:
        raise PlanError(f"--gpu {ov.gpu!r} is not a GPU bigmoe knows the VRAM of; add --vram-gib")
    if ov.context is not None and not MIN_CONTEXT <= ov.context <= arch.max_context:
        raise PlanError(
            f"--context {ov.context} is outside {MIN_CONTEXT}..{arch.max_context}, the limit of {preset.name}"
        )
    for name in ("vram_slots", "ram_slots"):
        value = getattr(ov, name)
        if value is not None and not arch.top_k <= value <= arch.experts:
            raise PlanError(
                f"--{name.replace('_', '-')} {value} must be between top-k {arch.top_k} "
                f"(one token's experts) and the {arch.experts} experts per layer"
            )
    if ov.vram_slots is not None and ov.ram_slots is not None and ov.ram_slots < ov.vram_slots:
        raise PlanError(
            f"--ram-slots {ov.ram_slots} is below --vram-slots {ov.vram_slots}; RAM slots must be >= VRAM slots"
        )


def stated_machine(hw: Hardware, ov: Overrides) -> Hardware:
    """The probed machine with the stated parts put in place of the probed ones."""
    changes: dict = {}
    if ov.vram_gib is not None or ov.gpu is not None:
        vram = int((ov.vram_gib if ov.vram_gib is not None else gpu_spec(ov.gpu)[0]) * GIB)
        name = ov.gpu or f"GPU with {vram / GIB:g} GiB"
        not_probed = Unknown("the GPU was stated on the command line, not probed")
        probed = hw.gpu()
        card = probed.vram_total_bytes if probed is not None and isinstance(probed.vram_total_bytes, int) else None
        changes["gpus"] = (
            Gpu(
                0,
                name,
                vram,
                vram,
                not_probed,
                not_probed,
                not_probed,
                stated=True,
                h2d_gbps=not_probed,
                card_bytes=card,
            ),
        )
    if ov.ram_gib is not None:
        ram = int(ov.ram_gib * GIB)
        changes.update(ram_total_bytes=ram, ram_available_bytes=ram, ram_stated=True)
    if ov.disk is not None or ov.disk_gib is not None:
        stated = Unknown("the disk was stated on the command line, not probed")
        changes["disks"] = (
            Disk(
                path="/",
                device=stated,
                kind=ov.disk or Unknown("--disk-gib was given without --disk"),
                kind_basis="stated with --disk",
                mount_point=stated,
                filesystem=stated,
                windows_drive=False,
                free_bytes=int(ov.disk_gib * GIB) if ov.disk_gib is not None else Unknown("no --disk-gib was given"),
                o_direct=stated,
                o_direct_basis="not tested on a stated disk",
                stated=True,
                read_gbps=stated,
            ),
        )
    if ov.wsl2 is not None:
        changes.update(wsl2=ov.wsl2, wsl2_basis="stated with --wsl2")
    return dataclasses.replace(hw, **changes)


def default_dirs(preset: Preset) -> tuple[str, str]:
    """(model directory, paging directory) when not given."""
    return default_model_dir(preset.synthetic), default_paging_dir()


def default_model_dir(synthetic: bool) -> str:
    """bigmoe's cache for models it makes; the Hugging Face hub cache for downloaded ones."""
    if synthetic:
        from bigmoe.paths import cache_root

        return str(cache_root() / "models")
    from huggingface_hub.constants import HF_HUB_CACHE

    return str(HF_HUB_CACHE)


def default_paging_dir() -> str:
    from bigmoe.paths import cache_root

    return str(cache_root() / "paging")
