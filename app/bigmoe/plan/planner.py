"""plan: the one estimator. (Hardware, Preset, Overrides) -> Plan: where every expert lives
(VRAM slots, pinned RAM slots, SSD), whether records are compressed, where the SSD tier reads
from, the exact vLLM argv and environment, a memory table, an expected TPOT range, a reason for
every choice, and refusals (each overridable with --force, which the plan then records).
The steps live in plan_draft; this module holds the result and the entry point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from bigmoe_pager.settings import PagerSettings

from bigmoe.machine.hardware import Hardware
from bigmoe.model.checkpoint_arch import ArchFacts, preset_facts, with_facts
from bigmoe.model.presets import Preset
from bigmoe.plan.draft import Draft
from bigmoe.plan.inputs import Overrides, PlanError, check_overrides, default_dirs, stated_machine
from bigmoe.plan.memory import CODEC_RATIO, MemoryRow, MemoryTable
from bigmoe.plan.speed import Estimate

__all__ = [
    "CODEC_RATIO",
    "MemoryRow",
    "MemoryTable",
    "Overrides",
    "Plan",
    "PlanError",
    "default_dirs",
    "plan",
    "stated_machine",
]


@dataclass(frozen=True)
class Plan:
    """Everything `bigmoe run` needs to start vLLM for one model on one machine."""

    model: str
    """Preset name."""
    model_path: str
    """What vLLM serves: a checkpoint directory or a hub id."""
    device: str
    """"cuda" or "cpu"."""
    expert_dtype: str
    """"fp8" or "bf16"."""
    context: int
    """--max-model-len in tokens."""
    kv_cache_bytes: int
    """--kv-cache-memory-bytes."""
    pager: bool
    """Whether the expert pager runs (False when every expert stays resident)."""
    layers: int
    """MoE layers."""
    experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts per token per layer."""
    expert_bytes: int
    """Bytes of one routed expert as the kernel reads it (expert_dtype, scales included)."""
    dense_bytes: int
    """Bytes of every non-routed weight."""
    ngram_table_bytes: int
    """Bytes of the n-gram table (0 when the model has none)."""
    config_path: str | None
    """The checkpoint's config.json the architecture numbers were read from; None = the preset's numbers."""
    vram_slots: int
    """Device expert slots per layer (= experts when all are resident)."""
    ram_slots: int
    """Pinned RAM slots per layer (= experts when RAM holds them all; 0 when the pager is off)."""
    compress: bool
    """Expert records in RAM and on SSD are compressed."""
    ssd_source: str
    """"none", "checkpoint" or "paging file": what the SSD tier reads."""
    paging_file: str | None
    """Path of the paging file (when compressed)."""
    ngram: bool
    """The n-gram pager serves the model's n-gram table from SSD."""
    settings: PagerSettings
    """What the plugins read (their environment is settings.to_env())."""
    argv: tuple[str, ...]
    """The command `bigmoe run` executes, exactly (python -m vllm.entrypoints.openai.api_server ...)."""
    env: dict[str, str]
    """Environment variables to add for vLLM."""
    memory: tuple[MemoryTable, ...]
    """VRAM, RAM and disk tables."""
    estimate: Estimate
    """Expected TPOT range and tier hit rates."""
    measured: tuple[str, ...]
    """Measured link speeds behind the estimate, one line each."""
    assumptions: tuple[str, ...]
    """Assumed numbers behind the estimate and the tables."""
    reasons: dict[str, str]
    """Choice -> why, one line each."""
    notes: tuple[str, ...]
    """Warnings that do not stop the plan."""
    refusals: tuple[str, ...]
    """Why the plan is unsafe; empty when it is safe."""
    forced: bool
    """--force was given: the plan runs despite its refusals."""
    hardware: Hardware
    """The machine planned for (probe plus stated values)."""

    @property
    def refusal(self) -> str:
        """All refusals in one line ("" when none)."""
        return "; ".join(self.refusals)

    @property
    def runnable(self) -> bool:
        return not self.refusals or self.forced

    def summary(self) -> dict[str, str]:
        """Short strings for a progress line."""
        return {
            "device": self.device,
            "dtype": self.expert_dtype,
            "context": str(self.context),
            "vram_slots": str(self.vram_slots),
            "ram_slots": str(self.ram_slots),
            "compress": "on" if self.compress else "off",
            "ssd": self.ssd_source,
            "tpot_ms": f"{self.estimate.tpot_ms[0]:.0f}-{self.estimate.tpot_ms[1]:.0f}",
            "refused": self.refusal or "no",
        }

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            settings={k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self.settings).items()},
            argv=list(self.argv),
            memory=[t.to_dict() for t in self.memory],
            estimate=dataclasses.asdict(self.estimate),
            assumptions=list(self.assumptions),
            measured=list(self.measured),
            notes=list(self.notes),
            refusals=list(self.refusals),
            hardware=self.hardware.to_dict(),
            refusal=self.refusal,
            runnable=self.runnable,
        )
        return out


def plan(hw: Hardware, preset: Preset, overrides: Overrides = Overrides(), facts: ArchFacts | None = None) -> Plan:
    """The plan for `preset` on `hw` with `overrides`; PlanError for overrides that make no sense.
    `facts` are the architecture numbers to plan with (checkpoint_arch.facts_for); None = the preset's."""
    facts = facts or preset_facts(preset, "no checkpoint was read")
    preset = with_facts(preset, facts)
    check_overrides(preset, overrides)
    draft = Draft(stated_machine(hw, overrides), preset, overrides, facts)
    draft.choose_device()
    if draft.device == "cuda":
        draft.size_vram()
    draft.size_ram()
    draft.size_disks()
    return Plan(**draft.finish())
