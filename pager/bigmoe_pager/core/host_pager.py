"""The pager driven from the host, for engines that do not capture the step in a
CUDA graph (vLLM's CPU build, eager mode).

One layer's experts live in three tiers: S slots the MoE kernel reads (the
caller owns their tensors and installs records into them through a callback,
because the kernel may want its own weight layout), R records in RAM, and the
ExpertStore on SSD. Both caches are LRU and never evict an expert the current
step needs. Decisions are plain Python over a few ids per step; the GPU pager
(slots.py, ram_tier.py) makes the same decisions on the device.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.paging_file import ChecksumError

CHECKSUM_READS = 2
"""Reads of a record before a crc32 mismatch fails the step: one more may clear a glitch on the way,
and a paging file whose record fails twice marks itself damaged (paging_file.py)."""

InstallSlot = Callable[[int, dict[str, torch.Tensor]], None]
"""Called with (slot, component views of the expert's record) to fill one kernel slot."""


class PagerError(RuntimeError):
    """The pager cannot produce an expert's weights; the step must not run."""


class RecordSource(Protocol):
    """Where experts not in RAM come from (the SSD tier)."""

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        """Fill dst (uint8, >= layout.record_bytes) with the expert's raw record or raise."""


@dataclass(frozen=True)
class TierSizes:
    """Capacity of each tier for one layer."""

    experts: int
    """Experts of the layer."""
    vram: int
    """Slots the kernel reads."""
    ram: int
    """Records in (pinned) host RAM; == experts means no SSD tier."""

    def __post_init__(self):
        if not 1 <= self.vram <= self.experts:
            raise ValueError(f"VRAM slots must be in [1, {self.experts}], got {self.vram}")
        if not self.vram <= self.ram <= self.experts:
            raise ValueError(f"RAM slots must be in [{self.vram}, {self.experts}], got {self.ram}")


@dataclass
class TierCounters:
    """Counters of one tier (monotonic)."""

    lookups: int = 0
    """Experts asked of this tier."""
    hits: int = 0
    """Of those, experts it held."""
    bytes_moved: int = 0
    """Bytes copied out of this tier into the tier above."""
    read_seconds: float = 0.0
    """Time spent reading from this tier (s)."""
    errors: int = 0
    """Reads that failed."""
    prefetched: int = 0
    """Experts copied into this tier ahead of need (next-layer prefetch into VRAM, SSD read-ahead into RAM)."""
    prefetch_used: int = 0
    """Of those, experts the step they were fetched for needed (counted when the next prefetch round settles)."""
    prefetch_wasted_bytes: int = 0
    """Bytes of the others (copied for nothing)."""
    prefetch_late: int = 0
    """Needed experts whose prefetch copy had not landed when their step reached them, so the step waited for it
    (VRAM, joinless forwards only: elsewhere a join waits for the whole round and lateness is not seen)."""
    hurried: int = 0
    """Reads ahead a step came to wait for before an I/O worker had started them, moved ahead of the other reads
    ahead (SSD tier, device-driven layers)."""

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


def token_ranges(rows: list[list[int]], slots: int) -> list[slice]:
    """Consecutive token ranges whose distinct expert ids (>= 0) each number at most `slots`.

    Each token's row must itself fit (top-k <= slots). Splitting by tokens keeps every
    token's arithmetic whole, so a chunked step computes exactly what one call would.
    """
    chunks, start, seen = [], 0, set()
    for i, row in enumerate(rows):
        experts = {e for e in row if e >= 0}
        if len(seen | experts) > slots:
            chunks.append(slice(start, i))
            start, seen = i, set()
        seen |= experts
    chunks.append(slice(start, len(rows)))
    return chunks


class HostPager:
    """One MoE layer's tiers, driven from the host."""

    def __init__(
        self,
        layout: ExpertLayout,
        sizes: TierSizes,
        source: RecordSource | None,
        pin: bool = False,
        warm_order: list[int] | None = None,
    ):
        if sizes.ram < sizes.experts and source is None:
            raise PagerError(f"{sizes.experts - sizes.ram} experts have no RAM slot and there is no SSD source")
        self.layout = layout
        self.sizes = sizes
        self.source = source
        self.ram = torch.zeros((sizes.ram, layout.pitch), dtype=torch.uint8, pin_memory=pin)
        order = list(warm_order or range(sizes.experts))[: sizes.ram]
        self.ram_of: OrderedDict[int, int] = OrderedDict((e, r) for r, e in enumerate(order))
        self.vram_of: OrderedDict[int, int] = OrderedDict()
        self.free_vram = list(range(sizes.vram))
        self.slot_table = torch.full((sizes.experts,), -1, dtype=torch.int64)
        self.loaded: dict[int, set[str]] = {}
        self.stats = {"vram": TierCounters(), "ram": TierCounters(), "ssd": TierCounters()}
        self._checked = False

    # ---- loading ---------------------------------------------------------------

    def ram_slot_for_load(self, expert: int) -> int | None:
        """The RAM record an expert's weights go to while the engine loads, or None (stays on SSD)."""
        return self.ram_of.get(expert)

    def mark_loaded(self, expert: int, component: str) -> None:
        self.loaded.setdefault(expert, set()).add(component)

    def ram_views(self) -> dict[str, torch.Tensor]:
        """Each component over all RAM records: [R, *shape] strided views of the RAM buffer."""
        return self.layout.rows_views(self.ram)

    def check_loaded(self) -> None:
        """Every expert given a RAM record at load must have had every component loaded."""
        wanted = {c.name for c in self.layout.components}
        for expert in self.ram_of:
            missing = wanted - self.loaded.get(expert, set())
            if missing:
                raise PagerError(f"expert {expert}: the checkpoint did not provide {sorted(missing)}")
        self._checked = True

    # ---- stepping --------------------------------------------------------------

    def token_chunks(self, topk_ids: torch.Tensor) -> list[slice]:
        """Consecutive token ranges whose distinct experts each fit in the slots (one range when all fit)."""
        return token_ranges(topk_ids.tolist(), self.sizes.vram)

    def prepare(self, topk_ids: torch.Tensor, install: InstallSlot) -> torch.Tensor:
        """Make every expert in topk_ids resident in a slot; return the ids remapped to slots (-1 kept)."""
        if not self._checked:
            self.check_loaded()
        needed = list(dict.fromkeys(e for e in topk_ids.flatten().tolist() if e >= 0))
        if len(needed) > self.sizes.vram:
            raise PagerError(
                f"{len(needed)} distinct experts in one chunk but only {self.sizes.vram} slots; split with token_chunks"
            )
        for e in needed:
            if not 0 <= e < self.sizes.experts:
                raise PagerError(f"expert id {e} out of range [0, {self.sizes.experts})")
        vram = self.stats["vram"]
        vram.lookups += len(needed)
        keep = set(needed)
        for e in needed:
            if e in self.vram_of:
                vram.hits += 1
                self.vram_of.move_to_end(e)
        for e in needed:
            if e not in self.vram_of:
                slot = self._take_vram_slot(keep)
                try:
                    install(slot, self.layout.views(self._ram_record(e, keep)))
                except Exception:
                    self.free_vram.append(slot)
                    raise
                self.vram_of[e] = slot
                self.slot_table[e] = slot
        for e in needed:  # one step's experts are equally recent; keep them in the order they were asked
            self.vram_of.move_to_end(e)
        ids = topk_ids.to(torch.int64)
        return torch.where(ids >= 0, self.slot_table[ids.clamp(min=0)], ids)

    def _take_vram_slot(self, keep: set[int]) -> int:
        if self.free_vram:
            return self.free_vram.pop(0)
        for victim in self.vram_of:  # oldest first
            if victim not in keep:
                slot = self.vram_of.pop(victim)
                self.slot_table[victim] = -1
                return slot
        raise PagerError("no VRAM slot can be freed: every slot holds an expert this step needs")

    def _ram_record(self, expert: int, keep: set[int]) -> torch.Tensor:
        ram = self.stats["ram"]
        ram.lookups += 1
        if expert in self.ram_of:
            ram.hits += 1
            self.ram_of.move_to_end(expert)
        else:
            self.ram_of[expert] = self._take_ram_slot(keep)
            self._read_from_ssd(expert, self.ram[self.ram_of[expert]])
        ram.bytes_moved += self.layout.record_bytes
        return self.ram[self.ram_of[expert]]

    def _take_ram_slot(self, keep: set[int]) -> int:
        if len(self.ram_of) < self.sizes.ram:
            used = set(self.ram_of.values())
            return next(r for r in range(self.sizes.ram) if r not in used)
        for victim in self.ram_of:
            # An expert resident in a kernel slot can leave RAM: the slot keeps its own copy.
            if victim not in keep:
                return self.ram_of.pop(victim)
        raise PagerError("no RAM slot can be freed")

    def _read_from_ssd(self, expert: int, dst: torch.Tensor) -> None:
        ssd = self.stats["ssd"]
        ssd.lookups += 1
        start = time.perf_counter()
        try:
            for attempt in range(CHECKSUM_READS):
                try:
                    self.source.read_record(expert, dst)
                    break
                except ChecksumError:
                    if attempt + 1 == CHECKSUM_READS:
                        raise
        except Exception as e:
            ssd.errors += 1
            # The record is half-written: forget it so no later step uses it.
            self.ram_of.pop(expert, None)
            raise PagerError(f"expert {expert}: SSD read failed: {e}") from e
        ssd.read_seconds += time.perf_counter() - start
        ssd.hits += 1
        ssd.bytes_moved += self.layout.record_bytes
