"""plan_draft: the estimator's steps. A Draft is a plan being made: choose the device and
dtype, size VRAM (slots after dense weights, KV cache, activations and reserves), size RAM
(pinned slots after OS, vLLM, n-gram page cache and headroom; the codec when RAM cannot hold
every expert), then the disks; each step records its reasons, notes and refusals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bigmoe_pager.settings import host_driven as settings_rule_host_driven

from bigmoe.machine.hardware import Gpu, Hardware, Unknown
from bigmoe.model.checkpoint_arch import ArchFacts
from bigmoe.model.presets import Preset
from bigmoe.paths import paging_file_name
from bigmoe.plan.disks import disk_tables
from bigmoe.plan.inputs import Overrides, default_dirs
from bigmoe.plan.memory import (
    CODEC_RATIO,
    CUDA_CONTEXT_BYTES,
    NGRAM_PAGE_CACHE_BYTES,
    RAM_HEADROOM,
    VLLM_HOST_BYTES,
    VRAM_MARGIN,
    WSL2_DESKTOP_VRAM_BYTES,
    MemoryRow,
    MemoryTable,
    activation_bytes,
    activation_reason,
    batch_tokens,
    default_context,
    kv_cache_bytes,
    kv_reason,
    os_reserve_bytes,
)
from bigmoe.plan.spec import capture_reason, graph_tokens, mtp_layers
from bigmoe.plan.spec import refusal as spec_refusal
from bigmoe.plan.speed import estimate, speeds_for
from bigmoe.plan.ssd_choice import choose as choose_ssd
from bigmoe.plan.storage import Storage
from bigmoe.plan.vllm_command import launch_argv, launch_env, max_seqs_of, memory_utilization, pager_settings
from bigmoe.units import MIB, size_text

ARCH_REASONS = {
    "moe_layers": "moe_layers",
    "experts": "experts",
    "top_k": "top_k",
    "expert_bytes": "expert_bytes_{dtype}",
    "dense_bytes": "dense_bytes",
    "ngram_table": "ngram_table_bytes",
}
"""Plan.reasons key -> the Arch field whose origin it gives ({dtype} = the planned expert dtype)."""
MIN_COMPUTE_CAPABILITY_FP8 = 8.0
"""vLLM runs FP8 checkpoints from Ampere (8.0) on: weight-only Marlin below 8.9, FP8 tensor cores from 8.9."""


@dataclass
class Draft:
    """A plan being made: the steps fill it in order."""

    hw: Hardware
    preset: Preset
    ov: Overrides
    facts: ArchFacts
    reasons: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    memory: list[MemoryTable] = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "bf16"
    vram_slots: int = 0
    ram_slots: int = 0
    paging: bool = False
    compress: bool = False
    prefill_buffer: bool = False

    def __post_init__(self) -> None:
        arch = self.preset.arch
        for line in self.facts.mismatches:
            self.notes.append(f"{self.facts.config_path}: {line}")
        self.context = self.ov.context or default_context(arch)
        self.reasons["context"] = (
            "set by --context"
            if self.ov.context
            else f"default {self.context} tokens (the model allows {arch.max_context})"
        )
        self.kv = kv_cache_bytes(arch, self.context)
        self.reasons["kv_cache"] = kv_reason(arch, self.context)
        self.ngram = arch.ngram_table_bytes > 0
        self.reasons["ngram"] = (
            f"the {size_text(arch.ngram_table_bytes)} n-gram table is never loaded: each token's rows are read "
            "from the checkpoint on SSD, with the OS page cache as its RAM tier"
            if self.ngram
            else "the model has no n-gram table"
        )

    @property
    def eb(self) -> int:
        """Bytes of one expert as the kernel reads it."""
        return self.preset.expert_bytes(self.dtype)

    @property
    def pager(self) -> bool:
        return self.vram_slots < self.preset.arch.experts

    def choose_device(self) -> None:
        gpu = self.hw.gpu()
        if gpu is None:
            self._choose_cpu()
            return
        self.device, self.dtype = "cuda", self.preset.dtype_gpu
        self.reasons["device"] = f"GPU 0: {gpu.name}" + (" (stated)" if gpu.stated else "")
        self.reasons["dtype"] = f"{self.dtype} experts: the preset's GPU dtype"
        cc = gpu.compute_capability
        if self.dtype == "fp8" and isinstance(cc, str):
            if float(cc) < MIN_COMPUTE_CAPABILITY_FP8:
                self.refusals.append(
                    f"{gpu.name} has compute capability {cc}; vLLM runs FP8 checkpoints from 8.0 (Ampere) on"
                )
            elif float(cc) < 8.9:
                self.notes.append(
                    f"compute capability {cc} has no FP8 tensor cores: vLLM uses weight-only FP8 (Marlin) kernels"
                )

    def _choose_cpu(self) -> None:
        why = str(self.hw.gpus) if isinstance(self.hw.gpus, Unknown) else "NVML sees no GPU"
        self.device, self.dtype = "cpu", self.preset.dtype_cpu
        self.reasons["device"] = f"cpu: no NVIDIA GPU ({why}), so vLLM's CPU build runs the model"
        amx = {True: "this CPU has AMX", False: "this CPU has no AMX"}.get(self.hw.cpu_amx, "AMX unknown")  # type: ignore[arg-type]
        if self.dtype == "bf16":
            self.reasons["dtype"] = (
                f"bf16 experts on CPU, as the preset says: vLLM's CPU build runs FP8 MoE only with "
                f"Intel AMX, bf16 on every CPU ({amx})"
            )
        else:
            self.reasons["dtype"] = f"fp8 experts on CPU, as the preset says ({amx})"
            if self.hw.cpu_amx is False:
                self.refusals.append("vLLM's CPU build runs FP8 MoE only with Intel AMX, and this CPU has none")
        if not self.preset.synthetic:
            total = self.preset.total_expert_bytes("fp8")
            self.refusals.append(
                f"no GPU ({why}): {self.preset.name}'s {size_text(total)} of FP8 experts need an NVIDIA GPU; "
                "plan for one with --vram-gib"
            )

    def size_vram(self) -> None:
        arch, gpu = self.preset.arch, self.hw.gpu()
        assert gpu is not None
        total = gpu.vram_total_bytes if isinstance(gpu.vram_total_bytes, int) else 0
        if not total:
            self.refusals.append(f"VRAM size unknown ({gpu.vram_total_bytes}); state it with --vram-gib")
        rows = [
            self._vram_others(gpu, total),
            MemoryRow("CUDA context", CUDA_CONTEXT_BYTES, "CUDA context and library workspaces (assumed)"),
            MemoryRow("dense weights", arch.dense_bytes, "attention, embeddings, norms, shared experts, head (preset)"),
            MemoryRow("KV cache", self.kv, self.reasons["kv_cache"]),
            self._activations("cuda"),
            MemoryRow("safety margin", int(total * VRAM_MARGIN), f"{VRAM_MARGIN:.0%} of VRAM for fragmentation"),
        ]
        left = total - sum(r.bytes for r in rows)
        per_slot = self.paged_layers * self.eb
        self._choose_ssd(self._planned_ram_slots(self._ram_raw_fit()))  # RAM and the disks alone: before VRAM slots
        self.prefill_buffer, self.reasons["prefill_buffer"] = self._choose_prefill_buffer(left, per_slot)
        if self.prefill_buffer:
            rows.append(
                MemoryRow(
                    "prefill buffer",
                    arch.experts * self.eb,
                    f"one layer's {arch.experts} experts x {self.eb / MIB:.2f} MiB, shared by every layer",
                )
            )
            left -= arch.experts * self.eb
        fit = max(0, min(arch.experts, left // per_slot))
        self.vram_slots, why = self._pick(fit, self.ov.vram_slots, "--vram-slots", left, "VRAM")
        if self.ov.vram_slots is None and self.ov.ram_slots is not None and self.ov.ram_slots < self.vram_slots:
            self.vram_slots, why = (
                self.ov.ram_slots,
                f"lowered to --ram-slots {self.ov.ram_slots} (RAM slots must be >= VRAM slots)",
            )
        self.reasons["vram_slots"] = why
        if total and left < 0:
            self.refusals.append(
                f"too little VRAM for the dense weights: {size_text(arch.dense_bytes)} of them plus KV cache, "
                f"activations and reserves need {size_text(total - left)}, the GPU has {size_text(total)}"
            )
        elif total and left < arch.top_k * per_slot:
            self.refusals.append(
                f"too little VRAM for expert slots: {size_text(left)} is left after the dense weights, KV cache "
                f"and reserves; {arch.top_k} slots per layer (one token's experts) "
                f"need {size_text(arch.top_k * per_slot)}"
            )
        elif self.vram_slots * per_slot > left:
            self.refusals.append(
                f"out of VRAM: {self.vram_slots} slots per layer need {size_text(self.vram_slots * per_slot)}, "
                f"{size_text(left)} is left after dense weights, KV cache and reserves"
            )
        rows.append(
            MemoryRow(
                "expert slots",
                self.vram_slots * per_slot,
                f"{self.vram_slots} slots x {self.paged_layers} layers x {self.eb / MIB:.2f} MiB",
            )
        )
        self.memory.append(MemoryTable("VRAM", total, tuple(rows)))

    @property
    def host_driven(self) -> bool:
        """Which pager pages the experts on CUDA, decided here only: the host-driven one (eager, no CUDA graphs)
        when --eager asks for it; the device-driven one in CUDA graphs otherwise."""
        return settings_rule_host_driven(self.ov.cuda_graphs)

    @property
    def host_driven_because(self) -> str:
        """Why the pager is host-driven, in a few words (only meaningful when host_driven)."""
        return "--eager"

    def _choose_prefill_buffer(self, left: int, per_slot: int) -> tuple[bool, str]:
        """Whether the device-driven pager gets a whole-layer VRAM buffer for big steps (left: VRAM for experts)."""
        arch = self.preset.arch
        slots = self.ov.vram_slots if self.ov.vram_slots is not None else min(arch.experts, max(0, left) // per_slot)
        buffer = arch.experts * self.eb
        if slots >= arch.experts:
            return False, "off: every expert is resident in VRAM, nothing is paged"
        if self.host_driven:
            return False, f"off: the host-driven pager ({self.host_driven_because}) runs big steps in token ranges"
        if self.ov.prefill_buffer is not None:
            return self.ov.prefill_buffer, f"set by --{'' if self.ov.prefill_buffer else 'no-'}prefill-buffer"
        if (left - buffer) // per_slot < 2 * arch.top_k:
            return False, (
                f"off: its {size_text(buffer)} would leave fewer than {2 * arch.top_k} VRAM slots per layer; "
                "big steps run in token ranges through the slots"
            )
        return True, (
            f"on: {size_text(buffer)} of VRAM ({buffer / per_slot:.1f} slots per layer) lets a prefill load each "
            "expert once per layer instead of once per token range (7x lower TTFT on the H200, docs/benchmarks.md; "
            "--no-prefill-buffer gives the slots back)"
        )

    def _memory_utilization(self) -> float | None:
        """--gpu-memory-utilization: the card's share this plan may use (the VRAM budget less other users)."""
        vram = next((t for t in self.memory if t.tier == "VRAM"), None)
        gpu = self.hw.gpu()
        if vram is None or gpu is None or not vram.capacity_bytes:
            return None
        others = sum(r.bytes for r in vram.rows if r.item in ("other processes", "Windows desktop"))
        card = gpu.card_bytes or vram.capacity_bytes
        util = memory_utilization(vram.capacity_bytes - others, card)
        self.reasons["argv"] += (
            f"; --gpu-memory-utilization {util:.2f}: the {size_text(vram.capacity_bytes - others)} this plan "
            f"may use of the card's {size_text(card)} (vLLM refuses to start when less than that share is free; "
            "its KV cache is sized by --kv-cache-memory-bytes)"
        )
        return util

    def _vram_others(self, gpu: Gpu, total: int) -> MemoryRow:
        if not gpu.stated and isinstance(gpu.vram_free_bytes, int):
            return MemoryRow("other processes", max(0, total - gpu.vram_free_bytes), "VRAM in use at probe time")
        if self.hw.wsl2 is True:
            return MemoryRow(
                "Windows desktop", WSL2_DESKTOP_VRAM_BYTES, "the Windows desktop keeps VRAM on a WSL2 machine (assumed)"
            )
        return MemoryRow("other processes", 0, "a stated GPU is planned as unused by others")

    def _pick(self, fit: int, override: int | None, flag: str, left: int, tier: str) -> tuple[int, str]:
        arch = self.preset.arch
        if override is not None:
            return override, f"set by {flag}"
        if fit >= arch.experts:
            return (
                arch.experts,
                f"{tier} holds all {arch.experts} experts of every layer ({size_text(left)} left for experts)",
            )
        if fit < arch.top_k:
            return (
                arch.top_k,
                f"{tier} fits only {fit} slots per layer; planned at top-k {arch.top_k}, the least a token needs",
            )
        return fit, f"{size_text(left)} of {tier} left for experts holds {fit} slots per layer"

    def _activations(self, device: str) -> MemoryRow:
        seqs = max_seqs_of(self.preset)
        batch = batch_tokens(seqs, self.context)
        return MemoryRow(
            "activations",
            activation_bytes(self.preset.arch, device, seqs, batch),
            activation_reason(device, seqs, batch),
        )

    def size_ram(self) -> None:
        arch, hw = self.preset.arch, self.hw
        total, rows = self._ram_rows()
        if not total:
            self.refusals.append(f"RAM size unknown ({hw.ram_total_bytes}); state it with --ram-gib")
        left = total - sum(r.bytes for r in rows)
        if self.pager:
            self._size_ram_tier(rows, left)
        else:
            self.ram_slots = 0 if self.device == "cuda" else arch.experts
            self.reasons["ram_slots"] = (
                "no RAM tier: every expert is resident in VRAM"
                if self.device == "cuda"
                else "every expert is resident in RAM, the CPU's device memory"
            )
            self.paging, self.compress = False, False
            self.reasons["compress"] = "off: every expert is resident, nothing is paged"
            if left < 0:
                self.refusals.append(
                    f"out of memory: RAM needs {size_text(total - left)}, the machine has {size_text(total)}"
                )
        self.memory.append(MemoryTable("RAM", total, tuple(rows)))

    def _ram_raw_fit(self) -> int:
        """Raw expert slots per layer that RAM holds (what the compression choice starts from;
        CUDA plans: no side effects)."""
        total, rows = self._ram_rows()
        left = total - sum(r.bytes for r in rows)
        return max(0, min(self.preset.arch.experts, left // (self.paged_layers * self.eb)))

    def _ram_rows(self) -> tuple[int, list[MemoryRow]]:
        """RAM's size and every use of it but the expert RAM tier."""
        arch, hw = self.preset.arch, self.hw
        total = hw.ram_total_bytes if isinstance(hw.ram_total_bytes, int) else 0
        if not hw.ram_stated and isinstance(hw.ram_available_bytes, int):
            rows = [
                MemoryRow("OS and other programs", max(0, total - hw.ram_available_bytes), "RAM in use at probe time")
            ]
        else:
            rows = [
                MemoryRow(
                    "OS and other programs",
                    os_reserve_bytes(total),
                    "planned share of a stated machine's RAM (assumed)",
                )
            ]
        rows.append(
            MemoryRow(
                "vLLM processes", VLLM_HOST_BYTES[self.device], "API server, engine and worker processes (assumed)"
            )
        )
        if self.device == "cpu":
            self._cpu_device_rows(rows)
        if self.ngram:
            rows.append(
                MemoryRow(
                    "n-gram page cache",
                    min(arch.ngram_table_bytes, NGRAM_PAGE_CACHE_BYTES),
                    "OS page cache for the n-gram table's hot rows (assumed hot set)",
                )
            )
        rows.append(MemoryRow("headroom", int(total * RAM_HEADROOM), f"{RAM_HEADROOM:.0%} of RAM kept free"))
        return total, rows

    def _cpu_device_rows(self, rows: list[MemoryRow]) -> None:
        arch = self.preset.arch
        demo = self._cpu_demo()
        if demo:
            self.vram_slots = demo[0]
            self.reasons["vram_slots"] = (
                f"the preset pages on a CPU to show the pager: {demo[0]} of {arch.experts} "
                f"device slots (--vram-slots {arch.experts} keeps every expert resident)"
            )
        elif not self.ov.vram_slots:
            self.vram_slots = arch.experts
            self.reasons["vram_slots"] = "every expert is resident in RAM: the expert pager is off"
            if self.ov.ram_slots is not None:
                self.notes.append("--ram-slots has no effect on a CPU run unless --vram-slots turns the pager on")
        else:
            self.vram_slots = self.ov.vram_slots
            self.reasons["vram_slots"] = "set by --vram-slots (device slots live in RAM on a CPU)"
        rows += [
            MemoryRow("dense weights", arch.dense_bytes, "attention, embeddings, norms, head (preset)"),
            MemoryRow(
                "expert slots" if self.pager else "experts",
                self.vram_slots * self.paged_layers * self.eb,
                f"{self.vram_slots} x {self.paged_layers} layers x {self.eb / MIB:.2f} MiB ({self.dtype})",
            ),
            MemoryRow("KV cache", self.kv, self.reasons["kv_cache"]),
            self._activations("cpu"),
        ]

    def _size_ram_tier(self, rows: list[MemoryRow], left: int) -> None:
        arch = self.preset.arch
        # RAM holds raw records: both pagers expand a compressed record as it enters RAM.
        fit = max(0, min(arch.experts, left // (self.paged_layers * self.eb)))
        if self.device == "cpu":  # on CUDA size_vram has chosen it
            self._choose_ssd(self._planned_ram_slots(fit))
        stored = self.eb
        self.ram_slots, why = self._pick(fit, self.ov.ram_slots, "--ram-slots", left, "RAM")
        demo = self._cpu_demo() if self.ov.ram_slots is None else None
        if demo and demo[1] <= fit:
            self.ram_slots, why = (
                demo[1],
                f"the preset's demo: the other {arch.experts - demo[1]} experts are read from SSD",
            )
        if self.ov.ram_slots is None and self.ram_slots < self.vram_slots:
            self.ram_slots = self.vram_slots
            self.refusals.append(
                f"out of memory: RAM holds {fit} expert slots per layer, fewer than the {self.vram_slots} VRAM slots"
            )
        elif self.ram_slots * self.paged_layers * stored > left:
            self.refusals.append(
                f"out of memory: {self.ram_slots} RAM slots per layer need "
                f"{size_text(self.ram_slots * self.paged_layers * stored)}, {size_text(max(left, 0))} is left"
            )
        self.reasons["ram_slots"] = why + (" (pinned)" if self.device == "cuda" else "")
        pinned = self.ram_slots * self.paged_layers * stored
        rows.append(
            MemoryRow(
                "expert RAM slots",
                pinned,
                f"{self.ram_slots} x {self.paged_layers} layers x "
                f"{stored / MIB:.2f} MiB"
                + (" (compressed records are expanded as they enter RAM)" if self.compress else ""),
            )
        )
        limit = self.hw.memlock_bytes
        if self.device == "cuda" and isinstance(limit, int) and limit < pinned:
            self.notes.append(
                f"ulimit -l is {limit // 1024} KiB, below the {size_text(pinned)} pinned RAM tier: CUDA pins through "
                "its driver without this limit, but raise it (ulimit -l unlimited) if pinning fails"
            )

    def _planned_ram_slots(self, fit: int) -> int:
        """RAM slots per layer the plan will give (fit: raw experts RAM holds): --ram-slots, else a CPU preset's
        demo where RAM holds it, else fit. Fewer than the experts means an SSD tier, whatever RAM could hold."""
        if self.ov.ram_slots is not None:
            return self.ov.ram_slots
        demo = self._cpu_demo()
        return demo[1] if demo and demo[1] <= fit else fit

    def _cpu_demo(self) -> tuple[int, int] | None:
        """(device slots, RAM slots) a preset pages at on a CPU to show the pager, unless --vram-slots is given."""
        return self.preset.cpu_paging if self.device == "cpu" and not self.ov.vram_slots else None

    def _choose_ssd(self, ram_slots: int) -> None:
        """Where the SSD tier reads experts from (ram_slots: raw expert slots per layer in RAM): plan/ssd_choice."""
        choice = choose_ssd(self.storage, self.hw, self.ov.compress, self.dtype == "fp8", ram_slots)
        self.paging, self.compress, self.reasons["compress"] = choice.paging, choice.compress, choice.reason

    @property
    def ssd_record_bytes(self) -> int:
        """Bytes of one expert as the SSD tier holds it (RAM always holds it raw)."""
        return math.ceil(self.eb * CODEC_RATIO) if self.compress else self.eb

    @property
    def storage(self) -> Storage:
        """Where the checkpoint and the paging file go, for the planned expert dtype."""
        model_dir, paging_dir = (self.ov.model_dir, self.ov.paging_dir)
        if model_dir is None or paging_dir is None:
            default_model, default_paging = default_dirs(self.preset)
            model_dir, paging_dir = model_dir or default_model, paging_dir or default_paging
        arch = self.preset.arch
        return Storage(
            model_dir=model_dir,
            paging_dir=paging_dir,
            model_disk=self.hw.disk_for(model_dir),
            paging_disk=self.hw.disk_for(paging_dir),
            checkpoint_bytes=self.checkpoint_bytes,
            checkpoint_origin=self._checkpoint_origin(),
            model_on_disk=self.ov.model_on_disk,
            layer_experts=arch.experts,
            moe_layers=arch.moe_layers,
            expert_bytes=self.eb,
        )

    def _checkpoint_origin(self) -> str:
        if self.ov.model_on_disk:
            return "already on disk"
        if self.preset.synthetic:
            return f"made locally ({self.dtype} experts)"
        return f"downloaded from {self.preset.hub_id}: dense weights, FP8 experts, n-gram table"

    @property
    def checkpoint_bytes(self) -> int:
        arch = self.preset.arch
        return arch.dense_bytes + self.preset.total_expert_bytes(self.dtype) + arch.ngram_table_bytes

    @property
    def paged_layers(self) -> int:
        """MoE layers whose experts get slots: the model's, plus the MTP drafter's with speculative decoding."""
        return self.preset.arch.moe_layers + mtp_layers(self.ov.speculative_tokens, self.preset.arch.mtp_layers)

    @property
    def ssd_source(self) -> str:
        if not self.pager or self.ram_slots >= self.preset.arch.experts:
            return "none"
        return "paging file" if self.paging else "checkpoint"

    def size_disks(self) -> None:
        check = disk_tables(self.storage, self.paging, self.compress, self.ssd_source, self.ngram)
        self.memory += check.tables
        self.refusals += check.refusals
        self.notes += check.notes

    def record_arch(self) -> None:
        """A reason per architecture number: where it came from, and what the preset says when that differs."""
        for key, field_name in ARCH_REASONS.items():
            field_name = field_name.format(dtype=self.dtype)
            self.reasons[key] = self.facts.origins[field_name] + next(
                (
                    f"; {line.split(', ', 1)[1]}"
                    for line in self.facts.mismatches
                    if line.startswith(f"{field_name} is ")
                ),
                "",
            )

    def finish(self) -> dict:
        """The fields of the finished Plan."""
        self.record_arch()
        arch, gpu = self.preset.arch, self.hw.gpu() if self.device == "cuda" else None
        storage = self.storage
        paging_file = (
            str(Path(storage.paging_dir) / paging_file_name(self.preset.name, self.dtype)) if self.paging else None
        )
        model_path = self.ov.model_path or self._default_model_path()
        graphs = self.pager and self.device == "cuda" and not self.host_driven
        settings = pager_settings(
            self.pager,
            self.vram_slots,
            self.ram_slots,
            arch.experts,
            paging_file,
            self.compress,
            self.ngram,
            host_driven=self.pager and self.device == "cuda" and not graphs,
            prefill_buffer=self.prefill_buffer or not graphs,
        )  # read by the device-driven pager only
        speeds = speeds_for(
            gpu,
            storage.ssd_disk(self.ssd_source) or storage.model_disk,
            self.compress,
            self.hw.cpu_expand_gbps,
            self.hw.cpu_cores,
        )
        expected = estimate(
            speeds,
            self.device,
            layers=arch.moe_layers,
            experts=arch.experts,
            top_k=arch.top_k,
            resident_bytes=arch.dense_bytes + arch.moe_layers * arch.top_k * self.eb,
            record_bytes=self.eb,
            ssd_record_bytes=self.ssd_record_bytes,
            eager=self.pager and not graphs,
            compressed=self.compress,
            vram_slots=self.vram_slots,
            ram_slots=self.ram_slots if self.pager else arch.experts,
        )
        wsl2 = self.device == "cuda" and self.hw.wsl2 is True
        self.reasons["ssd_source"] = {
            "none": "no SSD tier: the device and RAM hold every expert",
            "checkpoint": "the SSD tier reads the checkpoint's safetensors in place (uncompressed, no second copy)",
            "paging file": f"the SSD tier reads {'compressed' if self.compress else 'raw'} records from the paging "
            f"file {paging_file}",
        }[self.ssd_source]
        self.reasons["env"] = (
            "VLLM_PLUGINS loads bigmoe's plugins only; BIGMOE_* carry the pager settings; the preset's variables"
            + ("; VLLM_WSL2_ENABLE_PIN_MEMORY=1 because WSL2 disables pinned memory otherwise" if wsl2 else "")
        )
        argv = self._launch_argv(model_path, graphs)
        return dict(
            model=self.preset.name,
            model_path=model_path,
            device=self.device,
            expert_dtype=self.dtype,
            context=self.context,
            kv_cache_bytes=self.kv,
            pager=self.pager,
            layers=arch.moe_layers,
            experts=arch.experts,
            top_k=arch.top_k,
            expert_bytes=self.eb,
            dense_bytes=arch.dense_bytes,
            ngram_table_bytes=arch.ngram_table_bytes,
            config_path=self.facts.config_path,
            vram_slots=self.vram_slots,
            ram_slots=self.ram_slots,
            compress=self.compress,
            ssd_source=self.ssd_source,
            paging_file=paging_file,
            ngram=self.ngram,
            settings=settings,
            argv=argv,
            env=launch_env(settings, self.preset, wsl2),
            memory=tuple(self.memory),
            estimate=expected,
            measured=speeds.measured,
            assumptions=speeds.assumptions,
            reasons=dict(self.reasons),
            notes=tuple(self.notes),
            refusals=tuple(self.refusals),
            forced=self.ov.force,
            hardware=self.hw,
        )

    def _launch_argv(self, model_path: str, graphs: bool) -> tuple[str, ...]:
        """vLLM's command line (plan/vllm_command renders it) and its reason; graphs: the device-driven pager in CUDA
        graphs pages the experts."""
        arch, spec = self.preset.arch, self.ov.speculative_tokens
        self.reasons["argv"] = (
            "vLLM's OpenAI server with the preset's flags, the planned context, KV-cache bytes and batch size"
        )
        share = self._memory_utilization() if self.device == "cuda" else None
        if why := spec_refusal(spec, self.preset.name, arch.mtp_layers, self.vram_slots, arch.top_k, graphs):
            self.refusals.append(why)
        capture = None
        eager = False
        if graphs:
            # Every batch vLLM captures must fit the slots: tokens x top-k <= VRAM slots (docs/pager.md); vLLM counts a
            # verification step's speculative tokens among the batch's tokens (plan/spec.py).
            capture = graph_tokens(self.vram_slots, arch.top_k)
            self.reasons["argv"] += (
                f"; --max-cudagraph-capture-size {capture} so every batch vLLM captures in a CUDA "
                f"graph ({self.vram_slots} slots / top-{arch.top_k}) fits the slots of the "
                "device-driven pager" + capture_reason(spec, self.vram_slots, arch.top_k)
            )
        elif self.pager and self.device == "cuda":
            # The host-driven pager reads each step's ids on the host; it refuses CUDA graphs (docs/pager.md).
            eager = True
            self.reasons["argv"] += (
                "; --enforce-eager because the host-driven expert pager reads each step's ids on the host, "
                "which CUDA graphs cannot replay" + f" ({self.host_driven_because})"
            )
        argv = launch_argv(
            self.preset,
            model_path,
            self.ov.host,
            self.ov.port,
            self.context,
            self.kv,
            batch_tokens(max_seqs_of(self.preset), self.context),
            gpu_share=share,
            speculative_tokens=spec,
            capture_size=capture,
            enforce_eager=eager,
        )
        return tuple(argv)

    def _default_model_path(self) -> str:
        if self.facts.config_path:  # the checkpoint on disk whose numbers the plan read
            return str(Path(self.facts.config_path).parent)
        if self.preset.synthetic:
            return str(Path(self.storage.model_dir) / f"{self.preset.name}-{self.dtype}")
        return self.preset.hub_id
