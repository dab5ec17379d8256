"""One MoE layer paged from the device, for engines that replay decode in CUDA graphs.

The engine's MoE kernel reads S slot buffers that the engine owns (its layer
parameters, sized for S experts). Behind them a RamTier keeps R pinned records
(all E when R == E; otherwise an SSD service fills its misses). Lifecycle:

    layer = DeviceLayerPager(layout, sizes, device, layer=i, stats=stats)
    for each checkpoint tensor: write it into layer.ram_views()[name][layer.ram_slot_for_load(e)]
    layer.start(buffers, ssd)            # after loading: check, attach the SSD tier, warm VRAM
    remapped = layer.step(topk_ids)      # a step whose ids fit the slots: capturable (no host sync in a capture)
    layer.prefetch(predicted_ids, side)  # optional, while the layer before computes: next step's likely experts
    layer.read_ahead(predicted_ids, side)  # optional, any number of layers ahead: post their SSD reads only

With read_ahead=True (BIGMOE_SSD_READ_AHEAD) over a partial RAM tier, `prefetch` also posts SSD
reads of the predicted experts neither VRAM nor RAM holds (RamTier.read_ahead): the GPU waits for
none of them there; the step that needs one waits for the rest of that read only.

A step with more ids than slots (prefill, big batches) runs outside graphs, either
cut into token ranges (`token_chunks(topk_ids)` reads the ids on the host and cuts
consecutive ranges whose distinct experts fit; each range is then a step of its own)
or whole, over a buffer of all E experts that `fill_layer_buffer` fills.
"""

from __future__ import annotations

import torch
from bigmoe_pager.core.copy_kernel import copy_records
from bigmoe_pager.core.host_pager import TierCounters, TierSizes, token_ranges
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager, PagerError
from bigmoe_pager.core.prefetch_chain import ChainSignal
from bigmoe_pager.core.ram_tier import RamTier, SsdFetch
from bigmoe_pager.core.stats import (
    BYTES,
    ERRORS,
    HITS,
    HURRIED,
    LOOKUPS,
    MISSES,
    PREFETCH_LATE,
    PREFETCH_USED,
    PREFETCH_WASTED_BYTES,
    PREFETCHED,
    RAM,
    READ_NS,
    SSD,
    VRAM,
    PagerStats,
)
from bigmoe_pager.core.step_kernel import MAX_IDS


class DeviceLayerPager:
    """A layer's RAM records, the pager that moves them into the engine's slots, and its counters."""

    def __init__(
        self,
        layout: ExpertLayout,
        sizes: TierSizes,
        device: torch.device | str,
        *,
        layer: int,
        stats: PagerStats,
        warm_order: list[int] | None = None,
        policy: str = "lru",
        pin: bool | None = None,
        read_ahead: bool = False,
        read_ahead_layers: int = 1,
        prefetch_gate: int | None = None,
        prefetch_budget: int | None = None,
    ):
        self.layout = layout
        self.sizes = sizes
        self.device = torch.device(device)
        self.layer = layer
        """Row of `stats` (the MoE layer's index)."""
        self.stats_table = stats
        self.buffers: dict[str, torch.Tensor] = {}
        self.policy = policy
        self.prefetch_gate = prefetch_gate
        """The VRAM prefetch gate's threshold, percent (None: slots.MIN_USED_PERCENT)."""
        self.prefetch_budget = prefetch_budget
        """Experts one VRAM prefetch round copies at most, the most used first (0: no limit; None:
        slots.PREFETCH_BUDGET)."""
        self.ram = RamTier(
            layout,
            sizes.experts,
            sizes.ram,
            self.device,
            pin=pin,
            policy=policy,
            read_ahead=read_ahead,
            read_ahead_layers=read_ahead_layers,
        )
        hottest = [e for e in dict.fromkeys(warm_order or []) if 0 <= e < sizes.experts]
        self.order = hottest + [e for e in range(sizes.experts) if e not in set(hottest)]
        """Every expert, hottest first: the first R get RAM records at load, the first S VRAM slots at start."""
        if self.ram.full:
            self._row_of = {e: e for e in range(sizes.experts)}
        else:
            rows = self.ram.table.place(torch.tensor(self.order[: sizes.ram], dtype=torch.int64)).tolist()
            self._row_of = dict(zip(self.order[: sizes.ram], rows))
        self.loaded: dict[int, set[str]] = {}
        self.pager: ExpertPager | None = None
        self.read_ahead_ssd = read_ahead
        """`prefetch` also posts SSD reads of predicted experts (a partial RAM tier over SsdService(read_ahead))."""
        self._side_streams: list = []
        """Side streams of prefetches and read-aheads the next step must wait for (empty: nothing pending)."""

    # ---- loading -------------------------------------------------------------------------

    def ram_slot_for_load(self, expert: int) -> int | None:
        """The RAM record an expert's weights go to while the engine loads, or None (it stays on SSD)."""
        return self._row_of.get(expert)

    def mark_loaded(self, expert: int, component: str) -> None:
        self.loaded.setdefault(expert, set()).add(component)

    def ram_views(self) -> dict[str, torch.Tensor]:
        """Each component over all RAM records: [R, *shape] strided views of the pinned records."""
        return self.layout.rows_views(self.ram.records)

    def start(self, buffers: dict[str, torch.Tensor], ssd: SsdFetch | None = None) -> None:
        """After loading: every record given at load must be whole; then attach the slots and the SSD tier, warm VRAM.

        buffers: the kernel's slot tensors as they are after the engine's post-load processing.
        """
        wanted = {c.name for c in self.layout.components}
        for expert in self._row_of:
            missing = wanted - self.loaded.get(expert, set())
            if missing:
                raise PagerError(
                    f"layer {self.layer}, expert {expert}: the checkpoint did not provide {sorted(missing)}"
                )
        if self.ram.full:
            self.ram.mark_filled()
        elif ssd is None:
            raise PagerError(
                f"layer {self.layer}: {self.sizes.experts - self.sizes.ram} experts live only on SSD "
                "and no SSD tier was attached"
            )
        else:
            self.ram.attach_ssd(ssd)
            if self.read_ahead_ssd:
                self.ram.check_can_post()
        self.buffers = buffers
        self.pager = ExpertPager(
            self.layout,
            self.sizes.experts,
            self.sizes.vram,
            self.ram,
            device=self.device,
            layer=self.layer,
            stats=self.stats_table,
            buffers=buffers,
            policy=self.policy,
            prefetch_gate=self.prefetch_gate,
            prefetch_budget=self.prefetch_budget,
        )
        self.pager.warm_vram(torch.tensor(self.order[: self.sizes.vram], dtype=torch.int64))

    @property
    def started(self) -> bool:
        return self.pager is not None

    def warm_kernels(self, id_dtypes: tuple[torch.dtype, ...], predict_width: int = 0) -> int:
        """Before serving: compile every kernel variant an eager step of any size launches; returns the steps run.

        Triton compiles a kernel once per variant: block sizes that follow a step's size (its id vector up to
        step_kernel.MAX_IDS, the SSD requests of up to `sizes.vram` misses), the ids' dtype, its arguments'
        alignment. CUDA graph captures compile the decode sizes; an eager step (a prefill, a batch past the
        captured sizes) of a new variant would compile in the middle of a request, a pause that vLLM's JIT monitor
        reports. So one step of each size with variants of its own (`warm_step_sizes`) runs here, in each of
        `id_dtypes`, with every id -1: such a step selects no expert (nothing is copied, read or counted) and only
        advances the tables' step counts. predict_width: ids per token of the predictor's proposals (0: none),
        whose prefetch (and SSD read-ahead) rounds are warmed alike for 1..16 tokens.
        """
        sizes = warm_step_sizes(self.sizes.vram)
        steps = 0
        for dtype in dict.fromkeys(id_dtypes):
            for n in sizes:
                self.step(torch.full((1, n), -1, dtype=dtype, device=self.device))
                steps += 1
        for tokens in range(1, 17) if predict_width else ():
            nothing = torch.full((tokens, predict_width), -1, dtype=torch.int64, device=self.device)
            self.prefetch(nothing)  # with read-ahead on, its SSD posts too
            self.step(torch.full((tokens, 1), -1, dtype=torch.int64, device=self.device))  # settles the round
            steps += 1
        self._wait(self.device)
        return steps

    # ---- stepping ------------------------------------------------------------------------

    def fits(self, topk_ids: torch.Tensor) -> bool:
        """Whether a step of this shape is served by `step` alone (decided by shape: capturable)."""
        return topk_ids.numel() <= self.sizes.vram

    def publishes(self, num_ids: int) -> bool:
        """Whether a step of `num_ids` ids can publish itself to a prefetch chain (core.prefetch_chain)."""
        return self.pager is not None and num_ids <= self.sizes.vram and self.pager.publishes(num_ids)

    def step(self, topk_ids: torch.Tensor, chain: ChainSignal | None = None) -> torch.Tensor:
        """Make the step's experts resident; topk_ids remapped to slots, in their dtype.

        The step's distinct experts must fit in the slots: true when `fits`, and for every
        range `token_chunks` returns. Captured into a CUDA graph: no host sync. Run outside
        one over a partial RAM tier: it returns once the GPU has finished it (`settle`).
        chain: the step, once done, publishes itself to the forward's chained prefetch rounds (where `publishes`).
        """
        if self.pager is None:
            raise PagerError(f"layer {self.layer}: step before start(); the engine must finish loading first")
        for side in self._side_streams:  # a late prefetch copy (or read-ahead post) is waited for, never skipped
            torch.cuda.current_stream(self.device).wait_stream(side)
        self._side_streams = []
        remapped = self.pager.prepare(topk_ids, chain).to(topk_ids.dtype)
        if not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.settle()
        return remapped

    def prefetch(self, predicted_ids: torch.Tensor, stream=None, chain_flags: torch.Tensor | None = None) -> None:
        """Copy the experts a predictor proposes for this layer's next step into free or cold VRAM slots.

        predicted_ids: integer [P] or [tokens, P], -1 padded (fixed shape). Rule (SlotTable.admit):
        never evict an expert this layer's latest step used or another predicted one. The router keeps
        the final say: the next `step` decides from its own ids, so a wrong prediction costs a copy.
        With read_ahead on, the predicted experts only SSD holds have their reads posted too.
        stream: a CUDA side stream to run on, so the copies overlap the layer before's compute; it
        first waits for the current stream (this layer's latest step is done with its slots), and
        the next `step` waits for it (a late copy is waited for). Event waits only: capturable.
        chain_flags: a joinless chained forward's round (core.round_sync; run on the stream current now, stream
        None): the next step settles it and waits for the copies it needs on the device, not by a join.
        """
        if chain_flags is not None:
            self.pager_started().prefetch(predicted_ids, chain_flags)
            return
        self._on_side(predicted_ids, stream, self._prefetch_now)

    def read_ahead(self, predicted_ids: torch.Tensor, stream=None, depth: int = 1) -> None:
        """Post SSD reads of predicted experts for this layer's next step (ExpertPager.read_ahead); no wait.

        For callers that predict several layers ahead (depth: how many; each depth's reads are judged and gated
        on their own, up to read_ahead_layers); the same stream rules as `prefetch`. Over a full RAM tier it does
        nothing; over a partial one the layer must be built with read_ahead=True and its SSD tier be
        SsdService(read_ahead=True).
        """
        pager = self.pager_started()
        self._on_side(predicted_ids, stream, lambda ids: pager.read_ahead(ids, depth))

    def _prefetch_now(self, predicted_ids: torch.Tensor) -> None:
        pager = self.pager_started()
        if self.read_ahead_ssd and not self.ram.full:
            pager.read_ahead(predicted_ids)  # first: its rows are then left out of the VRAM copies below
        pager.prefetch(predicted_ids)

    def _on_side(self, predicted_ids: torch.Tensor, stream, work) -> None:
        """Run work(predicted_ids) now, or on a CUDA side stream ordered after this layer's work so far."""
        self.pager_started()
        if stream is None or self.device.type != "cuda":
            work(predicted_ids)
            return
        if not torch.cuda.is_current_stream_capturing():  # a graph keeps its own tensors alive
            predicted_ids.record_stream(stream)  # the allocator must not reuse them before the side stream is done
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for side in self._side_streams:  # one layer's side work runs in order: its tables are not shared safely
            if side is not stream:
                stream.wait_stream(side)
        with torch.cuda.stream(stream):
            work(predicted_ids)
        self._side_streams = [stream]

    def pager_started(self) -> ExpertPager:
        """The layer's ExpertPager; PagerError before start()."""
        if self.pager is None:
            raise PagerError(f"layer {self.layer}: prefetch before start(); the engine must finish loading first")
        return self.pager

    def fill_layer_buffer(self, topk_ids: torch.Tensor, layer_buffers: dict[str, torch.Tensor]) -> None:
        """Copy every expert the step needs into `layer_buffers` at row = expert id.

        layer_buffers: component buffers for all E experts (`layout.slot_buffers(E, device)`). The
        engine's kernel then runs the whole step over them with the router's own ids, exactly as
        the unpaged layer would, loading each needed expert once instead of once per token range.
        Over a full RAM tier: one copy kernel, no host sync. Over a partial one: the needed
        experts pass through the VRAM slots S at a time (reading the ids: one host sync).
        """
        if self.pager is None:
            raise PagerError(f"layer {self.layer}: step before start(); the engine must finish loading first")
        if self.ram.full:
            self._fill_from_ram(topk_ids, layer_buffers)
        else:
            self._fill_through_slots(topk_ids, layer_buffers)

    def _fill_from_ram(self, topk_ids: torch.Tensor, layer_buffers: dict[str, torch.Tensor]) -> None:
        experts = self.sizes.experts
        ids = topk_ids.reshape(-1).long()
        valid = (ids >= 0) & (ids < experts)
        need = torch.zeros(experts + 1, dtype=torch.bool, device=ids.device)
        need[torch.where(valid, ids, experts)] = True  # row `experts` is a sink for invalid ids
        rows = torch.where(need[:experts], torch.arange(experts, device=ids.device), -1)
        copy_records(self.ram.records, rows, rows, self.layout, layer_buffers)
        count = need[:experts].sum()
        # Counted as misses served by RAM: the buffer is refilled whatever the slots hold.
        self.stats_table.tier(self.layer, "vram").add(
            lookups=count, misses=count, bytes=count * self.layout.record_bytes
        )
        self.stats_table.tier(self.layer, "ram").add(lookups=count, hits=count)

    def _fill_through_slots(self, topk_ids: torch.Tensor, layer_buffers: dict[str, torch.Tensor]) -> None:
        """Each needed expert is made resident once (RAM or SSD), then copied from its slot into the buffer.

        Experts already in VRAM go first, then those in RAM, then those only on SSD: the SSD reads
        come last, so the records they evict from RAM are ones this step has already copied.
        """
        self._wait(topk_ids.device)
        ids = topk_ids.reshape(-1).long()
        needed = torch.unique(ids[(ids >= 0) & (ids < self.sizes.experts)])
        in_vram = self.pager.vram.expert_slot[needed] >= 0
        in_ram = self.ram.table.expert_slot[needed] >= 0
        needed = needed[torch.argsort(2 - in_vram.long() - in_ram.long(), stable=True)]
        for group in needed.split(self.sizes.vram):
            slots = self.step(group.view(1, -1)).view(-1)
            for name, slot_buffer in self.buffers.items():
                # as bytes: index_copy_ has no FP8 kernel on every device
                layer_buffers[name].view(torch.uint8).index_copy_(
                    0, group, slot_buffer.view(torch.uint8).index_select(0, slots)
                )

    def token_chunks(self, topk_ids: torch.Tensor) -> list[slice]:
        """Consecutive token ranges whose distinct experts fit in the slots (reads the ids: one host sync)."""
        self._wait(topk_ids.device)  # the ids are ready once the stream is; then reading them blocks nothing
        return token_ranges(topk_ids.tolist(), self.sizes.vram)

    def settle(self) -> None:
        """After a step outside graphs over a partial RAM tier: wait until the GPU has finished it.

        Its SSD reads are answered by host threads, which need the GIL. The engine's
        next call (vLLM's MoE kernel, a launch into a full queue, a device-to-host copy)
        can block on the GPU while holding the GIL, and the GPU waits for those threads:
        a stall until the SSD deadline (seen at 40 layers on the H200). This wait, with
        the GIL released, lets them run first. `step` calls it outside graph captures.
        """
        if not self.ram.full:
            self._wait(self.device)

    @staticmethod
    def _wait(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # releases the GIL while it waits

    # ---- counters ------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, TierCounters]:
        """Counters per tier, read now (one sync), as HostPager.stats has them."""
        return self.counters()

    def counters(self, counts=None) -> dict[str, TierCounters]:
        """This layer's counters in HostPager's terms (bytes_moved: out of a tier into the one above).

        counts: a PagerStats.read() array to take them from (one sync for many layers); None reads now.
        """
        c = self.stats_table.read() if counts is None else counts
        vram, ram, ssd = (c[self.layer, t] for t in (VRAM, RAM, SSD))
        ssd_reads = int(ram[MISSES]) + int(ram[PREFETCHED])  # demand reads and read-ahead reads

        def ahead(row) -> dict[str, int]:  # what was brought into the tier ahead of need, and what came of it
            return {
                "prefetched": int(row[PREFETCHED]),
                "prefetch_used": int(row[PREFETCH_USED]),
                "prefetch_wasted_bytes": int(row[PREFETCH_WASTED_BYTES]),
                "prefetch_late": int(row[PREFETCH_LATE]),
            }

        return {
            "vram": TierCounters(lookups=int(vram[LOOKUPS]), hits=int(vram[HITS]), **ahead(vram)),
            "ram": TierCounters(
                lookups=int(ram[LOOKUPS]), hits=int(ram[HITS]), bytes_moved=int(vram[BYTES]), **ahead(ram)
            ),
            "ssd": TierCounters(
                lookups=ssd_reads,
                hits=max(0, ssd_reads - int(ssd[ERRORS])),
                bytes_moved=int(ram[BYTES]),
                read_seconds=int(ssd[READ_NS]) / 1e9,
                errors=int(ssd[ERRORS]),
                hurried=int(ssd[HURRIED]),
            ),
        }


def warm_step_sizes(vram_slots: int) -> list[int]:
    """Step sizes (ids) whose eager steps compile every kernel variant a step of up to vram_slots + 1 ids launches.

    Up to step_kernel.MAX_IDS + 1 every size: the fused step's id block and the unfused path's start. Past it the
    step-size arguments are compiled unspecialized and only the power-of-two block of an id or miss list
    (ssd_mailbox's request BLOCK) makes a new variant, so one size a block (2**k + 1) up to the slots will do, and
    one size past the slots (the token-range path). 67 sizes at 130 slots, 69 at 1,024, instead of every size.
    """
    every = range(1, MAX_IDS + 2)
    blocks = [2**k + 1 for k in range(MAX_IDS.bit_length(), vram_slots.bit_length()) if 2**k + 1 <= vram_slots]
    return sorted({*every, *blocks, vram_slots + 1})
