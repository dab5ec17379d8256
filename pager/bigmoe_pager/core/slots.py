"""Slot tables: which expert sits in which slot of one tier of one layer.

The table lives on the device that runs the model (the GPU, or the CPU for the
CPU build) and is updated there with fixed-shape tensor ops only: no `.item()`,
no `nonzero`, no data-dependent shapes. So `acquire` can be captured in a CUDA
graph and replayed with new routing written into the same input tensor.

Policy (deterministic so a plain-Python model can check it):
- every expert a step needs is kept or brought in, never evicted by that step;
- a miss takes an empty slot first, then the unneeded slot with the smallest
  (last-use step, expert id) under "lru", or the smallest (use count, last-use
  step, expert id) under "lfu" and "lfu-fast", where every step adds 1 to the
  count of each expert it needs and all counts halve every `decay` steps (256
  for lfu, 16 for lfu-fast: frequency that forgets within a topic). Chosen by
  scripts/sim_eviction.py over four routing families (docs/bench/eviction.json):
  lfu-fast misses no more than lru on any of them (a tie at 40% slots under
  topic shifts), lfu loses to lru once the routing shifts. "lfu-duel" keeps both counts (halved every `decay`
  and every DUEL_SLOW_DECAY steps) and two shadow tables that play each step as if ranking by one or the other
  (set dueling); a step ranks by the counts whose shadow hit more before it (the selector as it stood before the
  step: the shadows play and move it after the decision, so the fused step kernel's programs all decide from
  the old state). A third shadow ranks by recency alone (lru), and a second selector weighs its hits against
  those of the shadow of the counts the first selector named for each step: while it favours lru, a step ranks
  by recency (every count read as 0). Routing that shifts faster than the fast counts forget (every 8-84
  tokens) is lru's: without the third shadow the duel lost to lru by up to 0.019 of VRAM hit on 10 of 40
  families it was not chosen on (scripts/sim_holdout.py, session 54). Both decision kernels have it; the
  default since vLLM on the H200 measured the two-shadow duel (settings.PagerSettings.eviction);
- misses are assigned slots in ascending expert id;
- when a step needs more distinct experts than there are slots (overflow), the
  lowest-id misses get the free and unneeded slots, the rest stay out and their
  ids remap to -1; the caller must then stream the step in chunks.

Prefetch (`admit`, between two steps): predicted experts that are not resident
take, in ascending id, empty slots first, then the slots the policy ranks lowest
among those the table's latest step did not use and no prediction names. They
are stamped with the latest step (as recent as that step's experts) and add no
use count. The next `acquire` decides as always: a right prediction is a hit, a
wrong one is an unneeded slot, usually its first victim. Admits with no step between
them (a layer's reads posted ahead, then its prefetch) are one round for the counters.
A table built with `gates` > 1 keeps that many rounds apart (RoundState: marks, judgments, gate), and `admit(depth=d)`
uses round d: a RAM table receives SSD reads ahead from several layers back (BIGMOE_SSD_READ_AHEAD_LAYERS), and
proposals made further ahead are right less often, so each depth's reads are judged, and shut, by their own evidence
(one gate for all shut the next layer's good reads with the deeper ones' bad: benchmarks.md, session 67).

Prefetch gate (issue 15: prefetch must never cost more than it saves): each round first settles
the previous one (n_used of its experts the steps since needed, n_wasted not) and, when it judged
any, decays two fixed-point scores, score += (count << 6) - (score >> 3). A round admits only
while used_score is at least MIN_USED_PERCENT of the two together. A closed round copies nothing and takes no slot,
but still scores its proposal: it marks the experts it would have fetched (would-fetch marks), and the next round judges
them as it judges copies (used when the step since needed them). So the gate reopens as soon as the predictor becomes
useful, without copying anything to find out (session 13; before, a closed gate copied a whole proposal every 64th
step to keep its evidence fresh). Shadow judgments move the gate's scores only, never the prefetch counters.
A joinless forward that follows one where every gate stayed closed is quiet (core.prefetch_chain): its rounds take
nothing even where a gate opens after judging, but mark what they would fetch, so a reopened gate fetches from the
next forward on.

Prefetch budget (`prefetch_budget`, 0 = none; PREFETCH_BUDGET = 1 by default since run 12): a round fetches at most
this many of its candidates, those the policy's use counts rank highest (ties: lower id; lru keeps no counts, so the
lowest ids). The gate and its would-fetch marks judge the budgeted set. It bounds what one round copies to what a
layer's compute may hide. While the gate's scores show at least `lift_percent` (LIFT_PERCENT) of the judged experts
used, the budget is lifted and a round fetches its whole proposal: a predictor that is nearly always right keeps every
copy it can hide, one that is often wrong copies at most the budget. The order of a proposal's ids is never read (a
replayed row lists its right ids first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bigmoe_pager.core import acquire_kernel, admit_kernel, triton_launch
from bigmoe_pager.core.admit_kernel import SourceRows
from bigmoe_pager.core.stats import (
    BYTES,
    ERRORS,
    HITS,
    LOOKUPS,
    MISSES,
    PREFETCH_USED,
    PREFETCH_WASTED_BYTES,
    PREFETCHED,
)

_NEEDED = torch.iinfo(torch.int64).max  # sort key of a slot the current step needs: never a candidate
POLICIES = ("lru", "lfu", "lfu-fast", "lfu-duel")
DEFAULT_DECAY = {"lru": 0, "lfu": 256, "lfu-fast": 16, "lfu-duel": 16}
"""Steps between halvings of the use counts, per policy (lru keeps none; lfu-duel: its fast counts)."""
DUEL_SLOW_DECAY = 256
"""lfu-duel: the halving period (steps) of its slow counts; its fast counts halve every `decay` steps."""
DUEL_PSEL_MAX = 32
"""lfu-duel: the selector saturates at +-this many needs (about four steps of full disagreement at top-8)."""
LFU_MAX_COUNT = 1023  # counts are clamped to 10 bits in the eviction key
LFU_MAX_EXPERTS = 1024  # expert ids take the key's low 10 bits
MIN_USED_PERCENT = 25
"""Prefetch gate of the VRAM tables (PCIe copies): percent of its judged experts that must be used to stay open. Chosen
with PREFETCH_BUDGET = 1 in vLLM 0.33 on the H200 (docs/benchmarks.md, run 12: 102 slots, standard / topic-shift,
ms a token): at recall 0.8 with uniform wrong ids, 5.19 / 6.72 at 25 (call f), 5.37 / 7.15 at 50 (call e), 5.03 /
6.71 with no gate (calls b, d), against 5.14 / 7.20 without prefetch (call f); at recall 0, 25 stays shut as 50 does
(5.45 / 7.56) where no gate copies a wrong expert every round (5.69 / 7.91, call d). Rounds without a budget want 60
(run 10: there a wrong round cost about twice its transfer time): set BIGMOE_PREFETCH_MIN_USED_PERCENT=60 with
BIGMOE_PREFETCH_BUDGET=0."""
PREFETCH_BUDGET = 1
"""Experts one VRAM prefetch round copies at most (0: no limit), the most used first, until the gate's evidence lifts
it (LIFT_PERCENT). One copy (3.2 MB, about 60 us at 55 GB/s) fits the compute of the layer it hides behind, a whole
proposal often does not: at recall 0.8 a budget of 1 gave 5.03 / 6.71 ms where 2 gave 5.46 / 7.03 and none 5.71 /
7.52 (run 12, no gate). What it gives up where routing is flat (near-uniform, recorded) is simulated in
docs/bench/sim-prefetch-lift-*.json and probed on the GPU in run 12's overlap-b files."""
LIFT_PERCENT = 90
"""A round copies its whole proposal, budget or not, while at least this percent of the gate's judged experts were
used. At recall 1 the budget costs: 4.50 / 5.79 ms a token against 4.49 / 5.54 without (run 12 calls b and a), and
14.02 against 12.25 on near-uniform routing in the probe (overlap-b); at recall 0.8, 27-49% of the budgeted copies
were used with uniform wrong ids and 44-67% with popular ones (calls d, f), at recall 1 all of them. Any value from 70
to 95 splits those measured points alike; None never lifts it. Not yet timed inside vLLM as one engine (session 15):
its rounds are the budgeted ones below the threshold, whole ones above."""
READ_AHEAD_MIN_USED_PERCENT = 50
"""Gate of the RAM tables' SSD reads ahead: percent of the reads it judged that must have been used. Where the disk sets
the pace a wasted read costs a read's time and a used one saves at most the wait of one, so reads ahead can pay only
while more than half are used. On the GPU (vLLM 0.33, Flash-Next layers, 35 VRAM / 218 RAM slots) reads 30-32% used cost
25-86% TPOT (runs 52, 56) and reads 58-61% used saved 6-18% (run 56, 8 layers, reading 4 ahead; that count missed reads
a VRAM prefetch copied on, counted since: SlotTable.note_used_above). Simulated on four routing families
(docs/bench/sim-read-ahead-gate-*.json) a gate of 50 shuts the recall-0.8 read-ahead where its reads are mostly wasted
(standard, cold wrong ids: 97% of rounds, 2.13x -> 1.04x the reads of none), half of them at 50-51% used, and leaves it
open at 66-83% (near-uniform, recorded, topic-shift with popular wrong ids); 10 (before run 56) closed nothing. On the
GPU at 50 (run 57, 4 ahead) recall 0.8 cost 0% on 8 layers and 2% on 12, recall 1.0 (90% used) saved 20-24%. Even
above the gate a short lead can lose (run 55: 4 layers, 1 ahead, 90% used, +6%)."""


def lfu_key(counts: torch.Tensor, stamps: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The LFU eviction order as one int64 (acquire_kernel.lfu_key on the device): fewest uses (capped at
    LFU_MAX_COUNT), then least recently used, then lowest id; below acquire_kernel.NEEDED_KEY (2**52) while
    stamps < 2**32."""
    return (counts.clamp(max=LFU_MAX_COUNT) << 42) | (stamps << 10) | experts


@dataclass(frozen=True, eq=False)  # compared by identity: its fields are tensors
class RoundState:
    """One source's prefetch rounds in a table: what its latest round copied, the experts its closed rounds would
    have, and its gate. Device tensors, updated in place (captured graphs hold them)."""

    prefetched: torch.Tensor
    """int64 [slots + 1]: expert the latest round copied into each slot, -1 elsewhere (for the prefetch counters)."""
    prefetch_step: torch.Tensor
    """int64 []: the table's `step` when the latest round's admit ran."""
    would_fetch: torch.Tensor
    """int32 [experts + 1]: 1 for each expert the latest round would have fetched had its gate been open."""
    used_score: torch.Tensor
    """int64 []: decayed count of prefetched experts used (fixed point, x64 per expert): the gate's evidence for."""
    wasted_score: torch.Tensor
    """int64 []: decayed count of prefetched experts never used (same scale): the gate's evidence against."""
    gate_closed: torch.Tensor
    """int64 []: admit calls the gate kept from admitting, so far."""

    @classmethod
    def empty(cls, num_experts: int, num_slots: int, device: torch.device) -> "RoundState":
        def zero():
            return torch.zeros((), dtype=torch.int64, device=device)

        return cls(
            prefetched=torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device),
            prefetch_step=zero(),
            would_fetch=torch.zeros((num_experts + 1,), dtype=torch.int32, device=device),
            used_score=zero(),
            wasted_score=zero(),
            gate_closed=zero(),
        )


class SlotTableError(ValueError):
    """A slot table was built or called with sizes it cannot work with."""


@dataclass(frozen=True)
class Admitted:
    """What one `admit` (prefetch) decided; device tensors, nothing synced."""

    experts: torch.Tensor
    """int64 [M]: predicted experts to copy in now, ascending, -1 padded (M = min(predictions, slots))."""
    slots: torch.Tensor
    """int64 [M]: slot each goes to, -1 padded."""
    evicted: torch.Tensor
    """int64 [M]: expert that slot held before (-1 if it was empty)."""
    rows: torch.Tensor
    """int64 [M]: record row each expert is copied from (SourceRows' row; the expert id without one), -1 padded."""


@dataclass(frozen=True)
class Acquired:
    """What one `acquire` decided; every field is a device tensor, nothing was synced."""

    remapped: torch.Tensor
    """Input shape and dtype: slot of each id; -1 for -1 ids, invalid ids and overflowed experts."""
    miss_experts: torch.Tensor
    """int64 [M]: experts to bring in this step, ascending, -1 padded (M = min(ids, slots))."""
    miss_slots: torch.Tensor
    """int64 [M]: slot each of miss_experts goes to, -1 padded."""
    evicted: torch.Tensor
    """int64 [M]: expert that slot held before (-1 if it was empty or unused)."""
    lookups: torch.Tensor
    """int64 []: distinct valid experts the step needs."""
    hits: torch.Tensor
    """int64 []: of those, already resident."""
    misses: torch.Tensor
    """int64 []: of those, not resident (loaded or, on overflow, left out)."""
    loaded: torch.Tensor
    """int64 []: misses that got a slot (entries of miss_slots that are >= 0)."""
    overflow: torch.Tensor
    """int64 []: distinct needed experts beyond the slot count (0 when the step fits)."""
    invalid: torch.Tensor
    """int64 []: ids outside [-1, experts): bad routing, remapped to -1."""


def acquired_from_kernel(out: dict[str, torch.Tensor]) -> Acquired:
    """An Acquired from a decision kernel's outputs (counts = lookups, hits, misses, loaded, overflow, invalid)."""
    c = out["counts"]
    return Acquired(
        out["remapped"], out["miss_experts"], out["miss_slots"], out["evicted"], c[0], c[1], c[2], c[3], c[4], c[5]
    )


class SlotTable:
    """Expert <-> slot maps and last-use stamps for one tier of one layer."""

    def __init__(
        self,
        num_experts: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        use_kernel: bool | None = None,
        policy: str = "lru",
        decay: int | None = None,
        min_used_percent: int = MIN_USED_PERCENT,
        prefetch_budget: int = PREFETCH_BUDGET,
        lift_percent: int | None = LIFT_PERCENT,
        gates: int = 1,
    ) -> None:
        """gates: rounds kept apart, each with its own gate (admit's `depth` picks one; deeper ones share the last)."""
        if gates < 1:
            raise SlotTableError(f"a slot table keeps at least one prefetch round, got gates={gates}")
        if not 0 <= min_used_percent <= 100:
            raise SlotTableError(f"prefetch gate needs 0 <= min_used_percent <= 100, got {min_used_percent}")
        if lift_percent is not None and not 0 <= lift_percent <= 100:
            raise SlotTableError(f"the budget's lift needs 0 <= lift_percent <= 100 (or None), got {lift_percent}")
        if prefetch_budget < 0:
            raise SlotTableError(f"a prefetch budget is a number of experts >= 0 (0: none), got {prefetch_budget}")
        if policy not in POLICIES:
            raise SlotTableError(f"eviction policy {policy!r} is unknown; choose {', '.join(POLICIES)}")
        decay = DEFAULT_DECAY[policy] if decay is None else decay
        if policy != "lru" and (num_experts > LFU_MAX_EXPERTS or decay < 0):
            raise SlotTableError(f"lfu needs <= {LFU_MAX_EXPERTS} experts and decay >= 0 steps (0 = never)")
        if num_experts < 1 or num_slots < 1:
            raise SlotTableError(
                f"slot table needs >= 1 expert and >= 1 slot, got {num_experts} experts, {num_slots} slots"
            )
        if num_slots > num_experts:
            raise SlotTableError(f"{num_slots} slots for {num_experts} experts: slots must not exceed experts")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.device = torch.device(device)
        e, s = num_experts, num_slots
        # One extra entry at the end of each map is a write sink: scatters aim
        # padding there instead of branching, which keeps every shape fixed.
        self._expert_slot = torch.full((e + 1,), -1, dtype=torch.int64, device=self.device)
        self._slot_expert = torch.full((s + 1,), -1, dtype=torch.int64, device=self.device)
        self._last_use = torch.full((s + 1,), -1, dtype=torch.int64, device=self.device)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        """Acquire calls so far; the stamp of the current call."""
        self._arange_e = torch.arange(e, dtype=torch.int64, device=self.device)
        self._need_scratch = torch.zeros((e + 1,), dtype=torch.int32, device=self.device)
        if use_kernel is None:
            use_kernel = self.device.type == "cuda" and triton_launch.available()
        self.use_kernel = use_kernel
        """Decide with the one-program Triton kernel (GPU default) instead of torch ops (CPU default)."""
        self._stat_index = torch.tensor([LOOKUPS, HITS, MISSES, BYTES, ERRORS], dtype=torch.int64, device=self.device)
        self.policy = policy
        self.decay = decay
        """Steps between halvings of every use count (lfu-duel: of its fast counts); 0 = counts never decay."""
        self.lfu = policy != "lru"
        """Rank eviction candidates by use count first (lfu, lfu-fast, lfu-duel)."""
        self._freq = torch.zeros((e + 1,), dtype=torch.int64, device=self.device)
        self.duel = policy == "lfu-duel"
        """Keep fast and slow decayed counts, rank by whichever would have kept more of the recent needs."""
        self._fast = self._slow = None
        """lfu-duel: use counts halved every `decay` steps, and every DUEL_SLOW_DECAY steps."""
        self._shadows = []
        """lfu-duel: (held [E], last-use stamps [E], counts) of a table ranking by the fast counts, by the slow ones,
        and by recency alone (counts all 0)."""
        # _freq is always the leader's counts: where(psel_lru > 0, 0, where(psel > 0, slow, fast)) (admit ranks by
        # it, as every step does)
        if self.duel:
            self._fast, self._slow, no_counts = (
                torch.zeros((e + 1,), dtype=torch.int64, device=self.device) for _ in range(3)
            )
            held = [torch.zeros(e, dtype=torch.bool, device=self.device) for _ in range(3)]
            stamps = [torch.full((e,), -1, dtype=torch.int64, device=self.device) for _ in range(3)]
            self._shadows = list(zip(held, stamps, (self._fast, self._slow, no_counts)))
        self.psel = torch.zeros((), dtype=torch.int64, device=self.device)
        """lfu-duel's selector: > 0 ranks by the slow counts, else by the fast ones (saturating, +-DUEL_PSEL_MAX)."""
        self.psel_lru = torch.zeros((), dtype=torch.int64, device=self.device)
        """lfu-duel's second selector: > 0 ranks by recency alone, else by the counts `psel` names (moved by the lru
        shadow's hits less those of the shadow of the counts psel named for the step; saturating, +-DUEL_PSEL_MAX)."""
        self._psel_next = torch.zeros((2,), dtype=torch.int64, device=self.device)
        """lfu-duel: the two selectors (psel, psel_lru) after a fused step's shadow play, until the program that
        writes the step's state installs them."""
        self._done = torch.zeros((1,), dtype=torch.int32, device=self.device)
        """Programs of a fused decode step that loads experts that finished reading the table (step_kernel); 0
        between steps."""
        self._claim = torch.zeros((1,), dtype=torch.int64, device=self.device)
        """Joinless chained forwards (core.round_sync): forward * 4 + the state of that forward's round."""
        self._copied = torch.zeros((s + 1,), dtype=torch.int64, device=self.device)
        """Joinless rounds: copy blocks finished into each slot, ever (round_sync)."""
        self._target = torch.zeros((s + 1,), dtype=torch.int64, device=self.device)
        """Joinless rounds: `copied` once the latest round's copy into each slot is done (round_sync)."""
        self._filled = torch.zeros((s + 1,), dtype=torch.int64, device=self.device)
        """Joinless rounds: the forward whose round last filled each slot (round_sync)."""
        self.rounds = tuple(RoundState.empty(e, s, self.device) for _ in range(gates))
        """Each depth's rounds (admit's `depth`); a table without reads from several layers back keeps one."""
        self._want_scratch = torch.zeros((e + 1,), dtype=torch.int32, device=self.device)
        """The admit kernel's set of predicted experts (its own: a side stream's admit never shares acquire's)."""
        self.min_used_percent = min_used_percent
        """Prefetch gate threshold (percent); 0 keeps the gate always open."""
        self.prefetch_budget = prefetch_budget
        """Most experts one admit round fetches, the most used first (0: no limit)."""
        self.lift_percent = lift_percent
        """A round ignores the budget while at least this percent of the gate's judged experts were used (None:
        never)."""
        self._prefetch_stat_index = torch.tensor(
            [BYTES, PREFETCHED, PREFETCH_USED, PREFETCH_WASTED_BYTES], dtype=torch.int64, device=self.device
        )

    # ---- views -----------------------------------------------------------------------

    @property
    def used_score(self) -> torch.Tensor:
        """The next layer's round's gate evidence for (RoundState; the VRAM tables keep no other round)."""
        return self.rounds[0].used_score

    @property
    def wasted_score(self) -> torch.Tensor:
        """The next layer's round's gate evidence against."""
        return self.rounds[0].wasted_score

    @property
    def gate_closed(self) -> torch.Tensor:
        """Admit calls the next layer's round's gate kept from admitting, so far."""
        return self.rounds[0].gate_closed

    @property
    def expert_slot(self) -> torch.Tensor:
        """int64 [experts]: slot of each expert, -1 when not resident."""
        return self._expert_slot[: self.num_experts]

    @property
    def slot_expert(self) -> torch.Tensor:
        """int64 [slots]: expert in each slot, -1 when empty."""
        return self._slot_expert[: self.num_slots]

    @property
    def use_count(self) -> torch.Tensor:
        """int64 [experts]: decayed use counts (lfu policy; zeros under lru)."""
        return self._freq[: self.num_experts]

    @property
    def last_use(self) -> torch.Tensor:
        """int64 [slots]: step that last needed each slot's expert, -1 when empty."""
        return self._last_use[: self.num_slots]

    def miss_capacity(self, num_ids: int) -> int:
        """Length M of the miss list for an input of `num_ids` ids (fixed by shapes)."""
        return max(1, min(num_ids, self.num_slots))

    # ---- the decision ------------------------------------------------------------------

    def acquire(
        self,
        ids: torch.Tensor,
        stats_row: torch.Tensor | None = None,
        aux_row: torch.Tensor | None = None,
        record_bytes: int = 0,
    ) -> Acquired:
        """Make every needed expert resident; return slots for `ids` and what to load.

        stats_row (int64 [11], see stats.COUNTERS) gets lookups, hits, misses,
        loaded * record_bytes as bytes, and invalid ids as errors; aux_row (the
        tier below when it always hits) gets loaded as lookups and hits.
        """
        if self.use_kernel:
            return self._acquire_kernel(ids, stats_row, aux_row, record_bytes)
        got = self._acquire_torch(ids)
        if stats_row is not None:
            parts = [got.lookups, got.hits, got.misses, got.loaded * record_bytes, got.invalid]
            stats_row.index_add_(0, self._stat_index, torch.stack(parts))
        if aux_row is not None:
            aux_row[LOOKUPS : HITS + 1] += got.loaded  # adjacent columns: lookups, hits
        return got

    def kernel_state(self) -> dict[str, torch.Tensor]:
        """The device tensors a kernel that decides for this table reads and updates in place (lfu-duel's too)."""
        state = {
            "expert_slot": self._expert_slot,
            "slot_expert": self._slot_expert,
            "last_use": self._last_use,
            "step": self.step,
            "need": self._need_scratch,
            "freq": self._freq,
            "done": self._done,
            "claim": self._claim,
            "copied": self._copied,
            "target": self._target,
            "filled": self._filled,
        }
        if self.duel:
            (fast_held, fast_stamps, _), (slow_held, slow_stamps, _), (lru_held, lru_stamps, _) = self._shadows
            state.update(
                fast=self._fast,
                slow=self._slow,
                fast_held=fast_held.view(torch.uint8),  # a kernel reads and writes the bool masks as bytes
                fast_stamps=fast_stamps,
                slow_held=slow_held.view(torch.uint8),
                slow_stamps=slow_stamps,
                lru_held=lru_held.view(torch.uint8),
                lru_stamps=lru_stamps,
                psel=self.psel,
                psel_lru=self.psel_lru,
                psel_next=self._psel_next,
            )
        return state

    def kernel_policy(self) -> dict[str, bool | int]:
        """The decision kernels' policy arguments: lfu, decay, and lfu-duel's duel, slow_decay, psel_max."""
        return {
            "lfu": self.lfu,
            "decay": self.decay,
            "duel": self.duel,
            "slow_decay": DUEL_SLOW_DECAY if self.duel else 0,
            "psel_max": DUEL_PSEL_MAX if self.duel else 0,
        }

    def _acquire_kernel(self, ids, stats_row, aux_row, record_bytes) -> Acquired:
        ids = ids.to(self.device)
        m = self.miss_capacity(ids.numel())
        out = acquire_kernel.launch_acquire(
            self.kernel_state(),
            ids,
            self.num_experts,
            self.num_slots,
            m,
            stats_row,
            aux_row,
            record_bytes,
            **self.kernel_policy(),
        )
        return acquired_from_kernel(out)

    def _acquire_torch(self, ids: torch.Tensor) -> Acquired:
        e, s = self.num_experts, self.num_slots
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        m = self.miss_capacity(flat.numel())
        self.step.add_(1)

        valid = (flat >= 0) & (flat < e)
        invalid = ((flat < -1) | (flat >= e)).sum()
        idx = torch.where(valid, flat, e)
        need = torch.zeros(e + 1, dtype=torch.bool, device=self.device)
        need.index_fill_(0, idx, True)
        need[e:].fill_(False)

        resident = self._expert_slot[:e] >= 0
        hit_mask = need[:e] & resident
        miss_mask = need[:e] & ~resident
        lookups = need.sum()
        hits = hit_mask.sum()
        misses = miss_mask.sum()
        if self.lfu:
            self._count_uses(need)

        miss_experts = self._compact(miss_mask, m)
        miss_slots, evicted, take = self._choose_slots(need, miss_experts, m)
        miss_experts = torch.where(take, miss_experts, -1)
        self._install(miss_experts, miss_slots, evicted, take)
        self._stamp(need)
        if self.duel:
            self._duel_play(need)

        remapped = self._expert_slot[idx].reshape(ids.shape).to(ids.dtype)
        overflow = (lookups - s).clamp(min=0)
        return Acquired(
            remapped, miss_experts, miss_slots, evicted, lookups, hits, misses, take.sum(), overflow, invalid
        )

    def _compact(self, mask: torch.Tensor, m: int) -> torch.Tensor:
        """Expert ids where `mask` is set, ascending, in a -1 padded [m] tensor."""
        pos = torch.cumsum(mask, 0) - 1
        target = torch.where(mask & (pos < m), pos, m)
        out = torch.full((m + 1,), -1, dtype=torch.int64, device=self.device)
        out.scatter_(0, target, torch.where(mask, self._arange_e, -1))
        return out[:m]

    def _count_uses(self, need: torch.Tensor) -> None:
        if self.duel:
            self._duel_count(need)
            return
        if self.decay:
            halve = torch.remainder(self.step, self.decay) == 0
            self._freq.copy_(torch.where(halve, self._freq >> 1, self._freq))
        self._freq.add_(need.to(torch.int64))

    def _duel_count(self, need: torch.Tensor) -> None:
        """lfu-duel, before the decision: count this step's needs in both counts; this step ranks by the counts the
        selector chose before it (`_freq`, the eviction key's)."""
        for counts, period in ((self._fast, self.decay), (self._slow, DUEL_SLOW_DECAY)):
            if period:
                halve = torch.remainder(self.step, period) == 0
                counts.copy_(torch.where(halve, counts >> 1, counts))
            counts.add_(need.to(torch.int64))
        self._follow_leader()

    def _duel_play(self, need: torch.Tensor) -> None:
        """lfu-duel, after the decision: play the step on three shadow tables (which experts a table ranking by the
        fast counts, one ranking by the slow counts and one by recency alone would hold: set dueling), move `psel`
        by the slow shadow's hits less the fast one's and `psel_lru` by the lru shadow's less those of the shadow
        of the counts `psel` named for this step, and follow the leader they now name (for admits and the next step)."""
        needed = need[: self.num_experts]
        fast, slow, lru = (self._shadow_step(held, stamps, counts, needed) for held, stamps, counts in self._shadows)
        ranked = torch.where(self.psel > 0, slow, fast)
        self.psel_lru.copy_((self.psel_lru + lru - ranked).clamp(-DUEL_PSEL_MAX, DUEL_PSEL_MAX))
        self.psel.copy_((self.psel + slow - fast).clamp(-DUEL_PSEL_MAX, DUEL_PSEL_MAX))
        self._follow_leader()

    def _follow_leader(self) -> None:
        """lfu-duel: `_freq` = the counts the selectors name: none (all 0: recency alone) while psel_lru > 0, else
        the slow ones while psel > 0, else the fast ones."""
        lead = torch.where(self.psel > 0, self._slow, self._fast)
        self._freq.copy_(torch.where(self.psel_lru > 0, 0, lead))

    def _shadow_step(self, held, stamps, counts, needed) -> torch.Tensor:
        """One acquire on a shadow table (experts only, no slots): its hits; its misses come in and push out as many
        of its unneeded experts as it then holds beyond the slots, lowest-ranked first (a step needing more experts
        than slots leaves it over-full until later steps push the rest out)."""
        e, s = self.num_experts, self.num_slots
        hits = (needed & held).sum()
        missing = needed & ~held
        evict = (held.sum() + missing.sum() - s).clamp(min=0)
        candidate = held & ~needed
        key = lfu_key(counts[:e], stamps, self._arange_e)  # unique per expert
        key = torch.where(candidate, key, torch.iinfo(torch.int64).max)
        order = torch.argsort(key)
        drop = torch.zeros(e, dtype=torch.bool, device=self.device)
        drop[order] = torch.arange(e, device=self.device) < evict
        held.copy_((held & ~(drop & candidate)) | missing)
        stamps.copy_(torch.where(needed, self.step, stamps))
        return hits

    def _choose_slots(self, need: torch.Tensor, miss_experts: torch.Tensor, m: int):
        """Slots for the misses: empty first, then the unneeded ones the policy ranks lowest."""
        e, s = self.num_experts, self.num_slots
        held = self._slot_expert[:s]
        occupied = held >= 0
        held_idx = torch.where(occupied, held, e)
        slot_needed = need[held_idx]
        if self.lfu:
            rank = lfu_key(self._freq[held_idx], self._last_use[:s], held)
        else:
            rank = self._last_use[:s] * (e + 1) + held
        key = torch.where(occupied, rank, -1)
        key = torch.where(slot_needed, _NEEDED, key)
        order = torch.sort(key, stable=True).indices[:m]
        take = (miss_experts >= 0) & (key[order] != _NEEDED)
        miss_slots = torch.where(take, order, -1)
        evicted = torch.where(take, held[order], -1)
        return miss_slots, evicted, take

    def _install(self, experts: torch.Tensor, slots: torch.Tensor, evicted: torch.Tensor, take: torch.Tensor) -> None:
        e, s = self.num_experts, self.num_slots
        self._expert_slot.index_fill_(0, torch.where(evicted >= 0, evicted, e), -1)
        self._expert_slot.index_put_((torch.where(take, experts, e),), torch.where(take, slots, -1))
        self._slot_expert.index_put_((torch.where(take, slots, s),), torch.where(take, experts, -1))
        self._expert_slot[e:].fill_(-1)
        self._slot_expert[s:].fill_(-1)

    def _stamp(self, need: torch.Tensor) -> None:
        slot = self._expert_slot[: self.num_experts]
        target = torch.where(need[: self.num_experts] & (slot >= 0), slot, self.num_slots)
        self._last_use.index_put_((target,), self.step)

    # ---- prefetch ----------------------------------------------------------------------

    def admit(
        self,
        predicted: torch.Tensor,
        available: torch.Tensor | None = None,
        stats_row: torch.Tensor | None = None,
        record_bytes: int = 0,
        keep_slots: torch.Tensor | None = None,
        source: SourceRows | None = None,
        chain_flags: torch.Tensor | None = None,
        record_blocks: int = 0,
        depth: int = 1,
    ) -> Admitted:
        """Install predicted experts for the next step (see the module's prefetch rule); returns what to copy.

        available: bool [experts], experts that may be prefetched (a partial RAM tier: those in RAM).
        stats_row (int64 [11], stats.COUNTERS) gets bytes and prefetched for this round and, for the
        previous round, prefetch_used (experts the step since then needed) and prefetch_wasted_bytes.
        keep_slots: bool [slots] that must not be taken either (RAM rows whose posted reads are unconfirmed).
        source: a partial tier below; only experts whose rows it holds whole are prefetched, and
        Admitted.rows says which row each is copied from.
        chain_flags, record_blocks: a joinless chained forward's round (core.round_sync; the kernel only): it claims
        the table first and marks the slots it fills as record_blocks copy blocks short of done.
        depth: layers ahead of the step the proposal was made (its RoundState: the table's `gates`, deeper ones
        share the last); its round is settled, judged and gated apart from the other depths'.
        Fixed shapes, no host sync: capturable, also on a side stream.
        """
        if self.use_kernel:
            return self._admit_kernel(
                predicted, available, stats_row, record_bytes, keep_slots, source, chain_flags, record_blocks, depth
            )
        if chain_flags is not None:
            raise ValueError("a joinless round (chain_flags) is decided by the admit kernel only")
        r = self.round_state(depth)
        return self._admit_torch(predicted, available, stats_row, record_bytes, keep_slots, source, r)

    def round_state(self, depth: int = 1) -> RoundState:
        """The rounds of proposals made `depth` layers ahead (depth 1 and below: the next layer's)."""
        return self.rounds[min(max(depth, 1), len(self.rounds)) - 1]

    def admit_state(self, depth: int = 1) -> dict[str, torch.Tensor]:
        """The device tensors the admit kernel reads and updates in place (a depth's round: round_state)."""
        r = self.round_state(depth)
        return {
            **self.kernel_state(),
            "prefetched": r.prefetched,
            "would_fetch": r.would_fetch,
            "prefetch_step": r.prefetch_step,
            "want": self._want_scratch,
            "used_score": r.used_score,
            "wasted_score": r.wasted_score,
            "gate_closed": r.gate_closed,
        }

    def _admit_kernel(
        self,
        predicted,
        available,
        stats_row,
        record_bytes,
        keep_slots,
        source,
        chain_flags=None,
        record_blocks=0,
        depth: int = 1,
    ) -> Admitted:
        out = admit_kernel.launch_admit(
            self.admit_state(depth),
            predicted.to(self.device),
            self.num_experts,
            self.num_slots,
            self.miss_capacity(predicted.numel()),
            available,
            keep_slots,
            stats_row,
            record_bytes,
            source,
            lfu=self.lfu,
            min_used_percent=self.min_used_percent,
            budget=self.prefetch_budget,
            lift_percent=self.lift_percent,
            chain_flags=chain_flags,
            record_blocks=record_blocks,
        )
        return Admitted(out["experts"], out["slots"], out["evicted"], out["rows"])

    def _admit_torch(self, predicted, available, stats_row, record_bytes, keep_slots, source, r) -> Admitted:
        """admit in torch ops, for the round `r` (a RoundState of this table)."""
        e, s = self.num_experts, self.num_slots
        flat = predicted.reshape(-1).to(device=self.device, dtype=torch.int64)
        m = self.miss_capacity(flat.numel())
        used, wasted = self._settle_prefetch(r)
        marked_used, marked_wasted = self._settle_would_fetch(r)
        idx = torch.where((flat >= 0) & (flat < e), flat, e)
        want = torch.zeros(e + 1, dtype=torch.bool, device=self.device)
        want.index_fill_(0, idx, True)
        want[e:].fill_(False)
        fetch = want[:e] & (self._expert_slot[:e] < 0)
        if available is not None:
            fetch &= available.to(device=self.device, dtype=torch.bool)
        if source is not None:
            fetch &= self._whole_rows(source)
        is_open = self._gate(r, used + marked_used, wasted + marked_wasted)
        fetch = torch.where(self._budget_lifted(r), fetch, self._within_budget(fetch))
        marks = (fetch & ~is_open).to(torch.int32)
        r.would_fetch[:e].bitwise_or_(marks)  # a round's second admit adds to its marks
        fetch &= is_open
        experts = self._compact(fetch, m)
        protect = want.clone()
        held = self._slot_expert[:s]
        recent = torch.where((held >= 0) & (self._last_use[:s] >= self.step), held, e)
        protect.index_fill_(0, recent, True)  # the latest step's experts and the predicted ones stay
        if keep_slots is not None:
            protect.index_fill_(0, torch.where(keep_slots & (held >= 0), held, e), True)
        protect[e:].fill_(False)
        slots, evicted, take = self._choose_slots(protect, experts, m)
        experts = torch.where(take, experts, -1)
        self._install(experts, slots, evicted, take)
        self._last_use.index_put_((torch.where(take, slots, s),), self.step)
        r.prefetched.index_put_((torch.where(take, slots, s),), experts)
        r.prefetched[s:].fill_(-1)
        r.prefetch_step.copy_(self.step)
        if stats_row is not None:
            n = take.sum()
            parts = [n * record_bytes, n, used, wasted * record_bytes]
            stats_row.index_add_(0, self._prefetch_stat_index, torch.stack(parts))
        if source is None:
            return Admitted(experts, slots, evicted, experts)
        rows = torch.where(experts >= 0, source.expert_row[experts.clamp(min=0)], -1)
        return Admitted(experts, slots, evicted, rows)

    def _within_budget(self, fetch: torch.Tensor) -> torch.Tensor:
        """bool [experts]: the prefetch_budget candidates of `fetch` with the highest use counts (ties: lower id)."""
        if not self.prefetch_budget:
            return fetch
        e = self.num_experts
        count = self._freq[:e].clamp(max=LFU_MAX_COUNT)
        key = torch.where(fetch, count * e + (e - 1 - self._arange_e), -1)  # unique among candidates
        rank = torch.empty_like(key)
        rank[torch.argsort(key, descending=True)] = self._arange_e
        return fetch & (rank < self.prefetch_budget)

    def _whole_rows(self, source: SourceRows) -> torch.Tensor:
        """bool [experts]: held by the source tier in a row with no unconfirmed read."""
        rows = source.expert_row[: self.num_experts]
        sink = source.posted.numel() - 1
        return (rows >= 0) & (source.posted[torch.where(rows >= 0, rows, sink)] == 0)

    def _settle_prefetch(self, r: RoundState) -> tuple[torch.Tensor, torch.Tensor]:
        """(used, wasted) of the latest round's copied experts, judged by the steps since; clears their marks.

        With no step since the round's admit, nothing is judged yet and the marks stay (same round).
        """
        s = self.num_slots
        judged = self.step > r.prefetch_step
        marked = (r.prefetched[:s] >= 0) & judged
        used = marked & (self._slot_expert[:s] == r.prefetched[:s]) & (self._last_use[:s] > r.prefetch_step)
        r.prefetched.copy_(torch.where(judged, -1, r.prefetched))
        return used.sum(), (marked & ~used).sum()

    def note_used_above(self, ids: torch.Tensor) -> None:
        """A step needed `ids`, some served by the tier above (VRAM hits this table's acquire never sees): rows of
        the pending prefetch round holding one get this step as their last use, so the round's judgment counts them
        used. A read ahead that a VRAM prefetch copied on served that step; without this it was judged wasted (run 56:
        59-61% of reads four layers ahead counted used at recall 1.0). Call after the step's acquire; no host sync."""
        e, s = self.num_experts, self.num_slots
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        row = self._expert_slot[torch.where((flat >= 0) & (flat < e), flat, e)]
        row = torch.where(row >= 0, row, s)
        for r in self.rounds:
            pending = (row < s) & (r.prefetched[row] == flat)
            self._last_use.index_put_((torch.where(pending, row, s),), self.step)

    def _settle_would_fetch(self, r: RoundState) -> tuple[torch.Tensor, torch.Tensor]:
        """(used, wasted) of the latest closed round's would-fetch marks, judged as copies are (used: a step since
        needed the expert, so it is resident now with a later stamp); clears them once judged."""
        e = self.num_experts
        judged = self.step > r.prefetch_step
        marked = (r.would_fetch[:e] != 0) & judged
        slot = self._expert_slot[:e]
        stamp = self._last_use[torch.where(slot >= 0, slot, self.num_slots)]
        used = marked & (slot >= 0) & (stamp > r.prefetch_step)
        r.would_fetch.copy_(torch.where(judged, 0, r.would_fetch))
        return used.sum(), (marked & ~used).sum()

    def _gate(self, r: RoundState, used: torch.Tensor, wasted: torch.Tensor) -> torch.Tensor:
        """Fold the settled round (copies and would-fetch marks) into its gate's scores; bool []: may it admit."""
        judged = used + wasted > 0
        for score, count in ((r.used_score, used), (r.wasted_score, wasted)):
            score.copy_(torch.where(judged, score - (score >> 3) + (count << 6), score))
        is_open = self._gate_open(r)
        r.gate_closed.add_((~is_open).to(torch.int64))
        return is_open

    def gate_is_open(self, depth: int = 1) -> bool:
        """Whether a depth's gate (round_state) lets its next round copy, on its current scores (one sync)."""
        return bool(self._gate_open(self.round_state(depth)))

    def _gate_open(self, r: RoundState) -> torch.Tensor:
        """bool []: the gate's rule on its current scores: at least min_used_percent of its judged experts used."""
        return self._scores_at_least(r, self.min_used_percent)

    def _budget_lifted(self, r: RoundState) -> torch.Tensor:
        """bool []: whether this round copies its whole proposal whatever the budget (lift_percent's rule)."""
        if self.lift_percent is None:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        return self._scores_at_least(r, self.lift_percent)

    def _scores_at_least(self, r: RoundState, percent: int) -> torch.Tensor:
        return r.used_score * (100 - percent) >= r.wasted_score * percent

    # ---- direct placement (warm start, tests) ------------------------------------------

    def place(self, experts: torch.Tensor) -> torch.Tensor:
        """Put `experts` (distinct, at most slots) into slots 0.. in order on an empty table; returns their slots.

        For warming a tier at start; runs with host checks since it is not on the step path.
        """
        experts = experts.reshape(-1).to(device=self.device, dtype=torch.int64)
        n = experts.numel()
        if n > self.num_slots:
            raise SlotTableError(f"cannot place {n} experts in {self.num_slots} slots")
        if n and (int(experts.min()) < 0 or int(experts.max()) >= self.num_experts):
            raise SlotTableError(f"expert ids must lie in [0, {self.num_experts}) to be placed")
        if int(torch.unique(experts).numel()) != n:
            raise SlotTableError("experts to place must be distinct")
        if bool((self.slot_expert >= 0).any()):
            raise SlotTableError("place() warms an empty table; this one already holds experts")
        slots = torch.arange(n, dtype=torch.int64, device=self.device)
        self._slot_expert[:n] = experts
        self._expert_slot[experts] = slots
        # Stamp 0 (< any acquire step): warm experts are the first eviction candidates, hottest last.
        self._last_use[:n] = 0
        return slots
