"""The expert pager of one MoE layer: VRAM slots fed from the RAM tier (and SSD).

Per step the engine's adapter calls, for each paged layer:

    remapped = pager.prepare(topk_ids)     # every needed expert now sits in a VRAM slot
    out = moe_kernel(x, pager.buffers, topk_weights, remapped)

A step that can need more distinct experts than slots (`pager.fits(topk_ids)` is
False: prefill, large batches) is cut by the adapter (DeviceLayerPager.token_chunks),
or streamed through `work_slots` slots per chunk by the benchmark's models
(bigmoe_bench.streaming).
"""

from __future__ import annotations

import torch
from bigmoe_pager.core import step_kernel
from bigmoe_pager.core.copy_kernel import copy_records, record_blocks
from bigmoe_pager.core.host_rounds import publish_admitted
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prefetch_chain import ChainSignal
from bigmoe_pager.core.ram_tier import ExpertReader, RamTier
from bigmoe_pager.core.slots import (
    MIN_USED_PERCENT,
    PREFETCH_BUDGET,
    Acquired,
    Admitted,
    SlotTable,
    acquired_from_kernel,
)
from bigmoe_pager.core.stats import COUNTERS, PagerStats

# Copy programs per prefetched expert (0: one per 8 KiB block, which fills every SM while it copies). On the H200
# (scripts/gpu_overlap_probe.py, run 7 in docs/benchmarks.md) 16 was best or within 2% of 8 and 32 on the standard,
# topic-shift and near-uniform families at recalls 0, 0.8 and 1, and beat 0 and 4 everywhere: at recall 1, 5.47 and
# 6.05 ms a token (standard, topic-shift) against 6.39 and 7.76 with one program per block, 6.49 and 8.44 without.
PREFETCH_PROGRAMS_PER_RECORD = 16


class PagerError(ValueError):
    """A pager was built with sizes or buffers it cannot serve."""


class ExpertPager:
    """VRAM slots of one layer, the RAM tier behind them, and the decisions that move experts."""

    def __init__(
        self,
        layout: ExpertLayout,
        num_experts: int,
        vram_slots: int,
        ram: RamTier,
        *,
        device: torch.device | str = "cpu",
        layer: int = 0,
        stats: PagerStats | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
        work_slots: int = 0,
        policy: str = "lru",
        decay: int | None = None,
        fused: bool | None = None,
        step_programs: int = 0,
        prefetch_programs: int = PREFETCH_PROGRAMS_PER_RECORD,
        prefetch_gate: int | None = None,
        prefetch_budget: int | None = None,
    ) -> None:
        if not 1 <= vram_slots <= num_experts:
            raise PagerError(f"layer {layer}: VRAM slots must be in [1, {num_experts}], got {vram_slots}")
        if ram.num_slots < vram_slots:
            raise PagerError(
                f"layer {layer}: {ram.num_slots} RAM slots < {vram_slots} VRAM slots; "
                "RAM must hold at least the VRAM slots"
            )
        if ram.num_experts != num_experts or ram.layout != layout:
            raise PagerError(f"layer {layer}: RAM tier was built for another layout or expert count")
        ram.check_ready()
        if work_slots > vram_slots:
            raise PagerError(
                f"layer {layer}: {work_slots} working slots exceed the {vram_slots} VRAM slots they stream through"
            )
        self.layout = layout
        self.num_experts = num_experts
        self.num_slots = vram_slots
        self.device = torch.device(device)
        self.layer = layer
        self.ram = ram
        gate = MIN_USED_PERCENT if prefetch_gate is None else prefetch_gate  # percent of judged prefetches used
        self.vram = SlotTable(
            num_experts,
            vram_slots,
            self.device,
            policy=policy,
            decay=decay,
            min_used_percent=gate,
            # experts one prefetch round copies at most (0: no limit)
            prefetch_budget=PREFETCH_BUDGET if prefetch_budget is None else prefetch_budget,
        )
        self.buffers = buffers if buffers is not None else layout.slot_buffers(vram_slots, self.device)
        _check_buffers(layout, vram_slots, self.buffers, self.device)
        self.work_slots = work_slots or vram_slots
        """Distinct experts per chunk when a step is streamed."""
        self._rows = {t: None if stats is None else stats.row(layer, t) for t in ("vram", "ram", "ssd")}
        self._private_rows: dict[str, torch.Tensor] = {}  # stats_row's, for a pager built without stats
        self.fused = self.vram.use_kernel if fused is None else fused
        """Serve decode-sized steps over a full RAM tier with step_kernel's single launch (GPU default)."""
        self.step_programs = step_programs or step_kernel.default_programs(self.device)
        """Programs of that launch (default: two per SM)."""
        self.prefetch_programs = prefetch_programs
        """Copy programs per prefetched expert (copy_records' programs_per_record; 0: one per block): a prefetch
        runs beside the layer before's compute, which its programs would otherwise crowd off the SMs."""
        self.mailbox: torch.Tensor | None = None
        """BIGMOE_PREFETCH_HOST_COPIER: where a joinless round's decided list goes for core.host_copier's thread, which
        then copies it (int64 [host_copier.mailbox_words(slots)], pinned; set by the adapter; None: the round copies
        with a kernel)."""
        self.sync_max_spins: int | None = None
        """Polls a joinless step makes before it gives up on a round (core.round_sync; None: step_kernel's default,
        about a second on a GPU, one in the interpreter). Tests lower it."""

    # ---- one step --------------------------------------------------------------------

    def fits(self, topk_ids: torch.Tensor) -> bool:
        """True when no step of this shape can need more distinct experts than slots (decided by shape alone)."""
        return topk_ids.numel() <= self.num_slots

    def prepare(self, topk_ids: torch.Tensor, chain: ChainSignal | None = None) -> torch.Tensor:
        """Bring every expert of `topk_ids` into VRAM; returns the ids remapped to slots (-1 stays -1).

        No host sync; capturable in a CUDA graph. If the step needs more distinct
        experts than slots, the lowest-id misses that do not fit remap to -1 and
        `acquire(...).overflow` says so: use `chunks()` for such shapes.
        chain: the step then publishes itself to chained prefetch rounds (only where `publishes`).
        """
        return self.acquire(topk_ids, chain).remapped

    def acquire(self, topk_ids: torch.Tensor, chain: ChainSignal | None = None) -> Acquired:
        """`prepare` with the full decision (miss list, counts, overflow) returned."""
        rows = self._rows
        below = rows["ram"] if self.ram.full else None  # a full RAM tier hits every expert VRAM loads
        if self._fused_step(topk_ids.numel()):
            return self._acquire_fused(topk_ids, rows["vram"], below, chain)
        if chain is not None:
            raise PagerError(f"layer {self.layer}: only a fused step publishes to a prefetch chain (see `publishes`)")
        got = self.vram.acquire(topk_ids, rows["vram"], below, self.layout.record_bytes)
        src = self.ram.locate(got.miss_experts, rows["ram"], rows["ssd"], needed=topk_ids)
        copy_records(self.ram.records, src, got.miss_slots, self.layout, self.buffers)
        return got

    def publishes(self, num_ids: int) -> bool:
        """Whether a step of `num_ids` ids can publish itself to a prefetch chain (it runs as one fused launch)."""
        return self._fused_step(num_ids)

    def _fused_step(self, num_ids: int) -> bool:
        lfu = self.vram.lfu
        return (
            self.fused
            and self.ram.full
            and step_kernel.fits(self.num_experts, self.num_slots, num_ids, self.layout, lfu)
        )

    def _acquire_fused(self, topk_ids: torch.Tensor, vram_row, ram_row, chain: ChainSignal | None) -> Acquired:
        """Decide, copy and count in one launch (the RAM tier is full: record row = expert id)."""
        self.ram.check_filled()
        table = self.vram
        out = step_kernel.launch_step(
            table.kernel_state(),
            topk_ids.to(self.device),
            self.num_experts,
            self.num_slots,
            table.miss_capacity(topk_ids.numel()),
            self.ram.records,
            self.layout,
            self.buffers,
            programs=self.step_programs,
            stats_row=vram_row,
            aux_row=ram_row,
            chain=chain,
            max_spins=self.sync_max_spins,
            **table.kernel_policy(),
        )
        return acquired_from_kernel(out)

    # ---- prefetch ----------------------------------------------------------------------

    def stats_row(self, tier: str) -> torch.Tensor:
        """The int64 stats.COUNTERS row this pager adds `tier`'s counts to (a private one when built without stats,
        made once, so kernels that always count have somewhere to)."""
        if self._rows[tier] is not None:
            return self._rows[tier]
        if tier not in self._private_rows:
            self._private_rows[tier] = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        return self._private_rows[tier]

    def prefetch(self, predicted_ids: torch.Tensor, chain_flags: torch.Tensor | None = None) -> Admitted:
        """Copy predicted experts of the next step into VRAM now (SlotTable.admit's rule); no host sync.

        Only experts whose RAM records are whole are prefetched (RamTier.complete's rule, checked by the
        decision itself from RamTier.source_rows: an SSD read, even a posted one, is the step's business):
        a row's demand read was waited for by an earlier step of this layer, ordered before this call,
        and a row with an unconfirmed posted read is left out.
        The next `acquire` still decides from its real ids: a wrong prediction costs a copy, never a token.
        chain_flags: a joinless chained forward's round (core.round_sync): decided and copied in two launches, it
        claims the table first and counts its copy's progress per slot, which the next fused step waits on. With a
        `mailbox` the second launch publishes the list instead, and the host copier copies it and moves the progress.
        """
        source = self.ram.source_rows()  # a partial tier's rows: the decision also checks and maps them
        blocks = record_blocks(self.layout)
        got = self.vram.admit(
            predicted_ids,
            None,
            self._rows["vram"],
            self.layout.record_bytes,
            source=source,
            chain_flags=chain_flags,
            record_blocks=blocks,
        )
        if chain_flags is not None and self.mailbox is not None:
            publish_admitted(self.mailbox, chain_flags, got.rows, got.slots, self.vram.kernel_state()["target"])
            return got
        copy_records(
            self.ram.records,
            got.rows,
            got.slots,
            self.layout,
            self.buffers,
            programs_per_record=self.prefetch_programs,
            copied=None if chain_flags is None else self.vram.kernel_state()["copied"],
        )
        return got

    def read_ahead(self, predicted_ids: torch.Tensor, depth: int = 1) -> None:
        """Post SSD reads of predicted experts that neither VRAM nor RAM holds (RamTier.read_ahead); no wait.

        A later step that needs one waits only for the rest of its read; a wrong one costs a read.
        depth: layers ahead the proposal was made (its reads are judged and gated with that depth's).
        """
        self.ram.read_ahead(predicted_ids, self.vram.expert_slot >= 0, self._rows["ram"], depth)

    # ---- start-up ----------------------------------------------------------------------

    def warm(self, experts: torch.Tensor, read: ExpertReader | None = None) -> None:
        """Warm the tiers with experts hottest first.

        The first VRAM-slots of them go into VRAM, the first RAM-slots into RAM.

        A partial RAM tier reads its share with `read`; VRAM is copied from RAM.
        """
        experts = experts.reshape(-1).long()
        if not self.ram.full:
            if read is None:
                raise PagerError("warming a partial RAM tier needs a reader for the experts it loads")
            self.ram.warm(experts, read)
        self.warm_vram(experts)

    def warm_vram(self, experts: torch.Tensor) -> None:
        """Copy the first VRAM-slots of `experts` (hottest first) into an empty VRAM tier; RAM must hold them."""
        top = experts.reshape(-1).long()[: self.num_slots].to(self.device)
        if not self.ram.full and bool((self.ram.table.expert_slot[top] < 0).any()):
            raise PagerError("warm_vram: some of the experts are not in the RAM tier")
        slots = self.vram.place(top)
        src = top if self.ram.full else self.ram.table.expert_slot[top]
        copy_records(self.ram.records, src, slots, self.layout, self.buffers)


def _check_buffers(layout: ExpertLayout, slots: int, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    for c in layout.components:
        buf = buffers.get(c.name)
        want = (slots, *c.shape)
        if buf is None or tuple(buf.shape) != want or buf.dtype != c.dtype or buf.device.type != device.type:
            got = "missing" if buf is None else f"{tuple(buf.shape)} {buf.dtype} on {buf.device}"
            raise PagerError(f"slot buffer {c.name} must be {want} {c.dtype} on {device}, got {got}")
