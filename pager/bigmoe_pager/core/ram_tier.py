"""The RAM tier of one layer: expert records in pinned host memory.

Records are rows of a uint8 [R, pitch] buffer, pinned when the model runs on a
GPU so the copy kernel reads them over PCIe directly. When R equals the number
of experts the tier holds every expert at row = expert id and needs no table;
otherwise a SlotTable on the model's device decides which experts stay, and
the SSD tier fills the rows it misses.

Read-ahead (`read_ahead`, a partial tier over an SSD tier that can post): predicted
experts get rows now (SlotTable.admit: never a row the latest step used, a predicted
one, or one whose posted read is unconfirmed) and their reads are posted without a
wait. `posted[row]` keeps the seq of a row's unconfirmed read; `locate` then has the
SSD tier wait for exactly the posted reads of the rows it returns, and the VRAM
prefetch takes only `complete()` rows. Rows a step takes for its misses drop their
posted read (the SSD service supersedes it: its bytes never land).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from bigmoe_pager.core.admit_kernel import SourceRows
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pinned import pinned_empty
from bigmoe_pager.core.slots import READ_AHEAD_MIN_USED_PERCENT, SlotTable


class RamTierError(ValueError):
    """The RAM tier was built or filled in a way it cannot serve."""


class SsdFetch(Protocol):
    """What the RAM tier needs from the SSD tier (the SSD helper's service implements it)."""

    def fetch(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        """On the current stream: read every expert >= 0 into RAM record `slots[i]`.

        experts, slots: int64 [M] on the model's device, -1 padded. Later work on the
        stream sees the bytes. The wait is bounded; a failed or late read must be
        reported (SsdService: check() after the step's sync raises SsdError and the
        step's outputs are discarded), never silently computed with.
        """


class SsdReadAhead(SsdFetch, Protocol):
    """An SSD tier that can also start reads without waiting (SsdService with read_ahead=True)."""

    def fetch(
        self,
        experts: torch.Tensor,
        slots: torch.Tensor,
        wait_rows: torch.Tensor | None = None,
        posted: torch.Tensor | None = None,
    ) -> None:
        """SsdFetch.fetch; also wait for the posted reads of `wait_rows` (posted[row] != 0), then confirm them."""

    def post(self, experts: torch.Tensor, slots: torch.Tensor, posted: torch.Tensor) -> None:
        """On the current stream: start reading experts >= 0 into rows `slots`, set posted[slot] = seq; no wait."""

    def settle(self, posted: torch.Tensor) -> None:
        """On the current stream: clear posted[row] of reads that are done; no wait."""

    @property
    def can_post(self) -> bool:
        """Whether `post` works (checked before a read-ahead changes any table)."""


class ServiceFetch:
    """SsdFetch for one layer of an SSD service that serves every layer (`request(layer, experts, slots)`)."""

    def __init__(self, service, layer: int) -> None:
        self.service = service
        self.layer = layer

    def fetch(
        self,
        experts: torch.Tensor,
        slots: torch.Tensor,
        wait_rows: torch.Tensor | None = None,
        posted: torch.Tensor | None = None,
    ) -> None:
        self.service.request(self.layer, experts, slots, wait_rows, posted)

    def post(self, experts: torch.Tensor, slots: torch.Tensor, posted: torch.Tensor) -> None:
        self.service.post(self.layer, experts, slots, posted)

    def settle(self, posted: torch.Tensor) -> None:
        self.service.settle(self.layer, posted)

    @property
    def can_post(self) -> bool:
        return bool(getattr(self.service, "read_ahead", False))


ExpertReader = Callable[[int, torch.Tensor], None]
"""read(expert, dst): fill dst (uint8 [pitch]) with the expert's record."""


class RamTier:
    """Pinned host records of one layer and (when partial) their slot table."""

    def __init__(
        self,
        layout: ExpertLayout,
        num_experts: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        *,
        ssd: SsdFetch | None = None,
        pin: bool | None = None,
        policy: str = "lru",
        decay: int | None = None,
        read_ahead: bool = False,
        read_ahead_layers: int = 1,
    ) -> None:
        """read_ahead_layers: depths of reads ahead the table judges and gates apart (SlotTable `gates`)."""
        if not 1 <= num_slots <= num_experts:
            raise RamTierError(f"RAM slots must be in [1, {num_experts}], got {num_slots}")
        self.layout = layout
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.ssd = ssd
        pin = self.device.type == "cuda" if pin is None else pin
        # Not zeroed (tens of GiB at start): a full tier refuses steps until fill_all() ran,
        # and a partial tier only points at rows its SSD tier or warm() has written.
        self.records = pinned_empty((num_slots, layout.pitch), torch.uint8, pin=pin)
        self.table = (
            None
            if self.full
            else SlotTable(
                num_experts,
                num_slots,
                self.device,
                policy=policy,
                decay=decay,
                min_used_percent=READ_AHEAD_MIN_USED_PERCENT,
                prefetch_budget=0,  # a round of SSD reads ahead is not bounded: the disk queue wants depth
                gates=max(1, read_ahead_layers) if read_ahead else 1,
            )
        )
        self._filled = not self.full
        self.posted = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        """Per record row: seq of its posted (read-ahead) read not yet confirmed, 0 = none; row R is a sink."""
        self.reading_ahead = read_ahead
        """`read_ahead` may post reads, so every `locate` waits for the posted reads of its rows. Fixed at
        build: a step captured in a CUDA graph before the first read-ahead must wait for them as well."""

    def attach_ssd(self, ssd: SsdFetch) -> None:
        """Set the SSD tier that fills this tier's misses (it usually needs `records` to be built)."""
        self.ssd = ssd

    def check_ready(self) -> None:
        """Raise RamTierError unless a step can be served: a partial tier needs an SSD tier below it."""
        if not self.full and self.ssd is None:
            raise RamTierError(
                f"{self.num_slots} RAM slots for {self.num_experts} experts need an SSD tier to fill misses; "
                "attach an SSD service or give as many RAM slots as experts"
            )

    def check_filled(self) -> None:
        """Raise RamTierError if this is a full tier whose records were never loaded."""
        if not self._filled:
            raise RamTierError("the full RAM tier was never filled; call fill_all() before the first step")

    @property
    def full(self) -> bool:
        """Every expert has its own row (row = expert id); no SSD tier below."""
        return self.num_slots == self.num_experts

    # ---- filling ----------------------------------------------------------------------

    def fill_all(self, read: ExpertReader) -> None:
        """Load every expert of a full tier (at start)."""
        if not self.full:
            raise RamTierError("fill_all() loads a full tier; a partial tier is filled by the SSD tier or warm()")
        for expert in range(self.num_experts):
            read(expert, self.records[expert])
        self._filled = True

    def load_all(self, records: torch.Tensor) -> None:
        """Fill a full tier from a uint8 [experts, pitch] tensor (any device) in one copy."""
        if not self.full:
            raise RamTierError("load_all() fills a full tier; a partial tier is filled by the SSD tier or warm()")
        if tuple(records.shape) != tuple(self.records.shape) or records.dtype != torch.uint8:
            raise RamTierError(
                f"load_all() needs uint8 {tuple(self.records.shape)}, got {records.dtype} {tuple(records.shape)}"
            )
        self.records.copy_(records)
        self._filled = True

    def mark_filled(self) -> None:
        """A full tier whose records the caller wrote itself (an engine's weight loader) is ready."""
        if not self.full:
            raise RamTierError("mark_filled() is for a full tier; a partial tier is filled by the SSD tier or warm()")
        self._filled = True

    def warm(self, experts: torch.Tensor, read: ExpertReader) -> None:
        """Place the given experts (hottest first, at most R) in an empty partial tier and read them."""
        if self.full:
            raise RamTierError("a full RAM tier already holds every expert; warm() is for partial tiers")
        slots = self.table.place(experts[: self.num_slots]).tolist()
        for expert, slot in zip(experts[: self.num_slots].tolist(), slots):
            read(int(expert), self.records[slot])

    # ---- the step path -----------------------------------------------------------------

    def locate(
        self,
        experts: torch.Tensor,
        stats_row: torch.Tensor | None = None,
        ssd_row: torch.Tensor | None = None,
        needed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record rows holding `experts` (int64 [M], -1 padded), reading misses from SSD first.

        No host sync: the RAM decision runs on the model's device, and the SSD
        service waits on the stream (bounded) for the rows it fills. A full tier
        is the identity (its counters are kept by the VRAM decision).
        needed: every expert the step needs, VRAM hits too; with read-ahead, reads ahead of them count as used
        even where a VRAM prefetch copied them on before the step (SlotTable.note_used_above).
        """
        self.check_filled()
        if self.full:
            return experts
        self.check_ready()
        got = self.table.acquire(experts, stats_row, ssd_row, self.layout.record_bytes)
        if needed is not None and self.reading_ahead:
            self.table.note_used_above(needed)
        if not self.reading_ahead:
            self.ssd.fetch(got.miss_experts, got.miss_slots)
            return got.remapped
        sink = self.num_slots
        self.posted.index_fill_(0, torch.where(got.miss_slots >= 0, got.miss_slots, sink), 0)  # superseded reads
        self.ssd.fetch(got.miss_experts, got.miss_slots, got.remapped, self.posted)
        return got.remapped

    def read_ahead(
        self,
        predicted: torch.Tensor,
        skip: torch.Tensor | None = None,
        stats_row: torch.Tensor | None = None,
        depth: int = 1,
    ) -> None:
        """Give predicted experts (int64, -1 padded) rows and post their SSD reads; no wait, no host sync.

        skip: bool [experts] not to read (those in VRAM). stats_row (this tier's counters) gets the
        reads as bytes and prefetched, and the previous round's prefetch_used / prefetch_wasted_bytes.
        depth: layers ahead the proposal was made; each depth's rounds have their own gate (SlotTable.admit).
        A full tier reads nothing ahead.
        """
        if self.full:
            return
        self.check_ready()
        if not self.reading_ahead:
            raise RamTierError("this RAM tier was built without read-ahead (RamTier(read_ahead=True))")
        self.check_can_post()
        self.ssd.settle(self.posted)
        available = None if skip is None else ~skip
        keep = self.posted[: self.num_slots] != 0  # a row with an unconfirmed read is never taken
        got = self.table.admit(predicted, available, stats_row, self.layout.record_bytes, keep_slots=keep, depth=depth)
        self.ssd.post(got.experts, got.slots, self.posted)

    def check_can_post(self) -> None:
        """Raise RamTierError unless the SSD tier below can post reads (before any table changes)."""
        if not getattr(self.ssd, "can_post", False):
            raise RamTierError("SSD read-ahead needs an SSD tier that can post reads (SsdService(read_ahead=True))")

    def source_rows(self) -> SourceRows | None:
        """Where a partial tier keeps each expert and which rows await a posted read (None: a full tier)."""
        return None if self.full else SourceRows(self.table.expert_slot, self.posted)

    def complete(self) -> torch.Tensor:
        """bool [experts]: experts whose record row holds all their bytes (in RAM, no unconfirmed read)."""
        if self.full:
            return torch.ones(self.num_experts, dtype=torch.bool, device=self.device)
        rows = self.table.expert_slot
        return (rows >= 0) & (self.posted[torch.where(rows >= 0, rows, self.num_slots)] == 0)
