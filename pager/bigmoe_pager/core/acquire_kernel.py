"""SlotTable.acquire as one Triton program.

The torch formulation of `acquire` is ~40 tiny kernels; replayed per layer per
decode step that costs more than the copies it decides. This kernel does the
same decision (same policy, same outputs, same table state: the unit tests run
both side by side) in a single program of one CTA, with block barriers between
phases and two small scratch areas in global memory for the scatters.

lfu-duel (SlotTable's module doc) decides with the selectors as they stood before
the step; after the decision the kernel plays the step on the three shadow tables
(`play_shadows`, which the fused step kernel calls too) and moves the selectors.
"""

from __future__ import annotations

import torch
from bigmoe_pager.core import stats
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

NEEDED_KEY = 1 << 52  # key of a slot the step needs; real keys (step * (E+1) + expert) stay below it
PACKED_MAX = 1 << 62  # above every (key + 1) * BLOCK_S + slot while BLOCK_S <= 1024
MAX_SLOTS = 1024
IDS_BLOCK = 256  # ids read per loop iteration
STEP_SIZES = ("n_ids", "m")
"""Arguments that change with a step's size: Triton compiles them unspecialized (not per value class: ==1,
%16==0), so the compile that engine warm-up makes serves every eager step (DeviceLayerPager.warm_kernels)."""
DUEL_STATE = (
    "fast", "slow", "fast_held", "fast_stamps", "slow_held", "slow_stamps", "lru_held", "lru_stamps",
    "psel", "psel_lru",
)  # fmt: skip
"""lfu-duel's tensors in SlotTable.kernel_state(), in the decision kernels' argument order."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_acquire(
    table_state: dict[str, torch.Tensor],
    ids: torch.Tensor,
    num_experts: int,
    num_slots: int,
    m: int,
    stats_row: torch.Tensor | None = None,
    aux_row: torch.Tensor | None = None,
    record_bytes: int = 0,
    lfu: bool = False,
    decay: int = 0,
    duel: bool = False,
    slow_decay: int = 0,
    psel_max: int = 0,
) -> dict[str, torch.Tensor]:
    """Run the decision; returns remapped (ids' shape/dtype), miss_experts, miss_slots, evicted ([m] int64) and counts.

    counts: int64 [6] = lookups, hits, misses, loaded, overflow, invalid.
    stats_row: int64 [7] counters (lookups, hits, misses, bytes, ..., errors) to add to;
    aux_row: counters of a full RAM tier, whose lookups and hits grow by the experts loaded.
    lfu: rank eviction candidates by (use count, last use, expert) with counts halved every `decay` steps.
    duel (with lfu): lfu-duel, its slow counts halved every `slow_decay` steps, its selector within +-psel_max
    (SlotTable.kernel_policy() gives all five).
    """
    if num_slots > MAX_SLOTS:
        raise ValueError(f"the acquire kernel handles up to {MAX_SLOTS} slots per table, got {num_slots}")
    flat = ids.reshape(-1)
    out = decision_outputs(flat, m)
    dummy = out["counts"]  # pointer for absent stats rows (never touched: HAS_* is False)
    kernel_for(_acquire_kernel, flat.device)[(1,)](
        flat,
        flat.numel(),
        table_state["expert_slot"],
        table_state["slot_expert"],
        table_state["last_use"],
        table_state["step"],
        table_state["need"],
        table_state["freq"],
        *duel_tensors(table_state, duel),
        *out.values(),
        m,
        stats_row if stats_row is not None else dummy,
        aux_row if aux_row is not None else dummy,
        record_bytes,
        E=num_experts,
        S=num_slots,
        NEEDED=NEEDED_KEY,
        PACKED_MAX=PACKED_MAX,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_S=next_pow2(num_slots),
        BLOCK_N=IDS_BLOCK,
        HAS_STATS=stats_row is not None,
        HAS_AUX=aux_row is not None,
        LFU=lfu,
        DECAY=decay,
        DUEL=duel,
        SLOW_DECAY=slow_decay,
        PSEL_MAX=psel_max,
        num_warps=4,
    )
    return {**out, "remapped": out["remapped"].reshape(ids.shape)}


def duel_tensors(table_state: dict[str, torch.Tensor], duel: bool) -> list[torch.Tensor]:
    """lfu-duel's state tensors (DUEL_STATE order); without duel, the table's counts stand in (never touched)."""
    if not duel:
        return [table_state["freq"]] * len(DUEL_STATE)
    return [table_state[name] for name in DUEL_STATE]


def decision_outputs(flat_ids: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    """What a decision kernel writes, in its argument order: remapped (like flat_ids), miss_experts,
    miss_slots, evicted (int64 [m]) and counts (int64 [6]: lookups, hits, misses, loaded, overflow, invalid)."""
    device = flat_ids.device
    return {
        "remapped": torch.empty_like(flat_ids),
        "miss_experts": torch.empty(m, dtype=torch.int64, device=device),
        "miss_slots": torch.empty(m, dtype=torch.int64, device=device),
        "evicted": torch.empty(m, dtype=torch.int64, device=device),
        "counts": torch.empty(6, dtype=torch.int64, device=device),
    }


if triton is not None:
    # Columns of stats.COUNTERS the kernel adds to, as compile-time constants (a kernel reads only constexpr globals).
    _LOOKUPS = tl.constexpr(stats.LOOKUPS)
    _HITS = tl.constexpr(stats.HITS)
    _MISSES = tl.constexpr(stats.MISSES)
    _BYTES = tl.constexpr(stats.BYTES)
    _ERRORS = tl.constexpr(stats.ERRORS)
    _NO_KEY = tl.constexpr(PACKED_MAX)  # above every shadow key (count << 42 | stamp << 10 | expert < 2**52)

    @triton.jit
    def lfu_key(counts, stamps, experts):
        """The LFU eviction order as one int64 (SlotTable's key): fewest uses (capped at 1023), then least recently
        used, then lowest id; unique per expert and below NEEDED_KEY while stamps < 2**32."""
        return (tl.minimum(counts, 1023) << 42) | (stamps << 10) | experts

    @triton.jit
    def record_counts(
        counts_ptr,
        stats_ptr,
        aux_ptr,
        lookups,
        hits,
        misses,
        loaded,
        overflow,
        invalid,
        record_bytes,
        HAS_STATS: tl.constexpr,
        HAS_AUX: tl.constexpr,
    ):
        """A step's counts: its six outputs (Acquired's lookups .. invalid), added to the layer's VRAM counters
        (stats.COUNTERS) and, for the experts it loaded, to the tier below's as lookups that hit."""
        tl.store(counts_ptr + 0, lookups)
        tl.store(counts_ptr + 1, hits)
        tl.store(counts_ptr + 2, misses)
        tl.store(counts_ptr + 3, loaded)
        tl.store(counts_ptr + 4, overflow)
        tl.store(counts_ptr + 5, invalid)
        if HAS_STATS:
            tl.atomic_add(stats_ptr + _LOOKUPS, lookups)
            tl.atomic_add(stats_ptr + _HITS, hits)
            tl.atomic_add(stats_ptr + _MISSES, misses)
            tl.atomic_add(stats_ptr + _BYTES, loaded * record_bytes)
            tl.atomic_add(stats_ptr + _ERRORS, invalid)
        if HAS_AUX:
            tl.atomic_add(aux_ptr + _LOOKUPS, loaded)
            tl.atomic_add(aux_ptr + _HITS, loaded)

    @triton.jit
    def halved(counts, step, period: tl.constexpr):
        """Use counts as a step leaves them before adding its needs: halved on every `period`-th step (0: never)."""
        if period > 0:
            counts = tl.where(step % period == 0, counts >> 1, counts)
        return counts

    @triton.jit
    def leader(psel, psel_lru, slow, fast):
        """The counts the selectors name (SlotTable._follow_leader): 0 (recency alone) while psel_lru > 0, else the
        slow counts while psel > 0, else the fast ones."""
        return tl.where(psel_lru > 0, 0, tl.where(psel > 0, slow, fast))

    @triton.jit
    def moved_selectors(psel, psel_lru, fast_hits, slow_hits, lru_hits, PSEL_MAX: tl.constexpr):
        """Both selectors after a step's shadow play (SlotTable._duel_play): psel by slow less fast hits, psel_lru by
        lru hits less those of the counts psel named for the step; each saturating at +-PSEL_MAX."""
        ranked = tl.where(psel > 0, slow_hits, fast_hits)
        psel_lru = tl.minimum(tl.maximum(psel_lru + lru_hits - ranked, -PSEL_MAX), PSEL_MAX)
        psel = tl.minimum(tl.maximum(psel + slow_hits - fast_hits, -PSEL_MAX), PSEL_MAX)
        return psel, psel_lru

    @triton.jit
    def shadow_load(held_ptr, stamps_ptr, e_ar, E: tl.constexpr):
        """A shadow table's held experts (bool) and stamps."""
        e_in = e_ar < E
        return tl.load(held_ptr + e_ar, mask=e_in, other=0) != 0, tl.load(stamps_ptr + e_ar, mask=e_in, other=-1)

    @triton.jit
    def shadow_keys(held, stamps, counts, needed, e_ar, S: tl.constexpr):
        """A shadow table's step before its evictions (SlotTable._shadow_step): its hits, how many experts it gives
        up, and each candidate's eviction key (_NO_KEY where the expert is no candidate). counts: the step's counts
        of the shadow's kind (int64 [BLOCK_E]), needed: the step's experts (bool [BLOCK_E])."""
        missing = needed & ~held
        candidate = held & ~needed
        # Four sums in one reduction: each is at most E < 2**16 (LFU_MAX_EXPERTS), so 16 bits a field.
        packed = (
            (needed & held).to(tl.int64)
            | (held.to(tl.int64) << 16)
            | (missing.to(tl.int64) << 32)
            | (candidate.to(tl.int64) << 48)
        )
        sums = tl.sum(packed, 0)
        over = ((sums >> 16) & 0xFFFF) + ((sums >> 32) & 0xFFFF) - S
        evict = tl.minimum(tl.maximum(over, 0), (sums >> 48) & 0xFFFF).to(tl.int32)
        key = tl.where(candidate, lfu_key(counts, stamps, e_ar), _NO_KEY)  # unique per expert, below PACKED_MAX
        return sums & 0xFFFF, evict, key

    @triton.jit
    def shadow_store(held_ptr, stamps_ptr, held, stamps, drop, needed, step, e_ar, E: tl.constexpr):
        """A shadow table's state after its step: `drop` given up, the needed experts held and stamped. Each element
        is read and written by the same thread: no barrier."""
        e_in = e_ar < E
        tl.store(held_ptr + e_ar, ((held & ~drop) | needed).to(tl.uint8), mask=e_in)
        tl.store(stamps_ptr + e_ar, tl.where(needed, step, stamps), mask=e_in)

    @triton.jit
    def _min3(a0, b0, c0, a1, b1, c1):
        return tl.minimum(a0, a1), tl.minimum(b0, b1), tl.minimum(c0, c1)

    @triton.jit
    def play_shadows(
        fast_held_ptr,
        fast_stamps_ptr,
        slow_held_ptr,
        slow_stamps_ptr,
        lru_held_ptr,
        lru_stamps_ptr,
        fast,
        slow,
        needed,
        step,
        e_ar,
        E: tl.constexpr,
        S: tl.constexpr,
    ):
        """One step of the three lfu-duel shadows (fast counts, slow counts, recency alone); returns their hits.
        fast, slow: the step's counts with its uses added. The shadows are loaded before any is played (one wait,
        not three) and give up their victims in one loop, the three minima of an iteration in one reduction (run
        44: played one after another, the third shadow cost a hit step 1.3 us a layer; run 45: played so, a hit
        step takes 7.7 us, two shadows' 7.85)."""
        fast_held, fast_stamps = shadow_load(fast_held_ptr, fast_stamps_ptr, e_ar, E)
        slow_held, slow_stamps = shadow_load(slow_held_ptr, slow_stamps_ptr, e_ar, E)
        lru_held, lru_stamps = shadow_load(lru_held_ptr, lru_stamps_ptr, e_ar, E)
        fast_hits, fast_evict, fast_key = shadow_keys(fast_held, fast_stamps, fast, needed, e_ar, S)
        slow_hits, slow_evict, slow_key = shadow_keys(slow_held, slow_stamps, slow, needed, e_ar, S)
        lru_hits, lru_evict, lru_key = shadow_keys(lru_held, lru_stamps, tl.zeros_like(fast), needed, e_ar, S)
        fast_drop = e_ar < 0
        slow_drop = e_ar < 0
        lru_drop = e_ar < 0
        # The `evict` lowest keys of each (a step's few misses); a shadow with fewer victims stops picking
        for i in range(0, tl.maximum(tl.maximum(fast_evict, slow_evict), lru_evict)):
            fast_min, slow_min, lru_min = tl.reduce((fast_key, slow_key, lru_key), 0, _min3)
            fast_pick = (fast_key == fast_min) & (i < fast_evict)
            slow_pick = (slow_key == slow_min) & (i < slow_evict)
            lru_pick = (lru_key == lru_min) & (i < lru_evict)
            fast_drop = fast_drop | fast_pick
            slow_drop = slow_drop | slow_pick
            lru_drop = lru_drop | lru_pick
            fast_key = tl.where(fast_pick, _NO_KEY, fast_key)
            slow_key = tl.where(slow_pick, _NO_KEY, slow_key)
            lru_key = tl.where(lru_pick, _NO_KEY, lru_key)
        shadow_store(fast_held_ptr, fast_stamps_ptr, fast_held, fast_stamps, fast_drop, needed, step, e_ar, E)
        shadow_store(slow_held_ptr, slow_stamps_ptr, slow_held, slow_stamps, slow_drop, needed, step, e_ar, E)
        shadow_store(lru_held_ptr, lru_stamps_ptr, lru_held, lru_stamps, lru_drop, needed, step, e_ar, E)
        return fast_hits, slow_hits, lru_hits

    @triton.jit(do_not_specialize=STEP_SIZES)
    def _acquire_kernel(
        ids_ptr,
        n_ids,
        expert_slot_ptr,
        slot_expert_ptr,
        last_use_ptr,
        step_ptr,
        need_ptr,
        freq_ptr,
        fast_ptr,
        slow_ptr,
        fast_held_ptr,
        fast_stamps_ptr,
        slow_held_ptr,
        slow_stamps_ptr,
        lru_held_ptr,
        lru_stamps_ptr,
        psel_ptr,
        psel_lru_ptr,
        remapped_ptr,
        miss_exp_ptr,
        miss_slot_ptr,
        evicted_ptr,
        counts_ptr,
        m,
        stats_ptr,
        aux_ptr,
        record_bytes,
        E: tl.constexpr,
        S: tl.constexpr,
        NEEDED: tl.constexpr,
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_STATS: tl.constexpr,
        HAS_AUX: tl.constexpr,
        LFU: tl.constexpr,
        DECAY: tl.constexpr,
        DUEL: tl.constexpr,
        SLOW_DECAY: tl.constexpr,
        PSEL_MAX: tl.constexpr,
    ):
        step = tl.load(step_ptr) + 1
        tl.store(step_ptr, step)
        e_ar = tl.arange(0, BLOCK_E)
        s_ar = tl.arange(0, BLOCK_S)  # also indexes the miss list (m <= S)
        e_in = e_ar < E
        s_in = s_ar < S
        m_in = s_ar < m

        # Phase 1: the set of needed experts, scattered into scratch.
        tl.store(need_ptr + e_ar, 0, mask=e_in)
        tl.store(miss_exp_ptr + s_ar, -1, mask=m_in)
        tl.debug_barrier()
        bad = tl.zeros([BLOCK_N], dtype=tl.int64)
        for n0 in range(0, n_ids, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(ids_ptr + offs, mask=offs < n_ids, other=-1).to(tl.int64)
            ok = (ids >= 0) & (ids < E)
            bad += ((ids < -1) | (ids >= E)).to(tl.int64)
            tl.store(need_ptr + ids, 1, mask=ok)
        tl.debug_barrier()
        need = tl.load(need_ptr + e_ar, mask=e_in, other=0) != 0
        where_now = tl.load(expert_slot_ptr + e_ar, mask=e_in, other=-1)
        hit = need & (where_now >= 0)
        miss = need & (where_now < 0)
        lookups = tl.sum(need.to(tl.int64), 0)
        hits = tl.sum(hit.to(tl.int64), 0)
        misses = tl.sum(miss.to(tl.int64), 0)
        if DUEL:  # both counts; the step ranks by those the selectors named before it
            psel = tl.load(psel_ptr)
            psel_lru = tl.load(psel_lru_ptr)
            fast = halved(tl.load(fast_ptr + e_ar, mask=e_in, other=0), step, DECAY) + need.to(tl.int64)
            slow = halved(tl.load(slow_ptr + e_ar, mask=e_in, other=0), step, SLOW_DECAY) + need.to(tl.int64)
            tl.store(fast_ptr + e_ar, fast, mask=e_in)
            tl.store(slow_ptr + e_ar, slow, mask=e_in)
            tl.store(freq_ptr + e_ar, leader(psel, psel_lru, slow, fast), mask=e_in)
            tl.debug_barrier()
        elif LFU:
            uses = halved(tl.load(freq_ptr + e_ar, mask=e_in, other=0), step, DECAY)
            tl.store(freq_ptr + e_ar, uses + need.to(tl.int64), mask=e_in)
            tl.debug_barrier()

        # Phase 2: misses in ascending id; candidate slots by (empty, policy key, slot).
        pos = tl.cumsum(miss.to(tl.int32), 0) - 1
        tl.store(miss_exp_ptr + pos, e_ar.to(tl.int64), mask=miss & (pos < m))
        held = tl.load(slot_expert_ptr + s_ar, mask=s_in, other=-1)
        last = tl.load(last_use_ptr + s_ar, mask=s_in, other=-1)
        occupied = held >= 0
        held_needed = tl.load(need_ptr + held, mask=occupied, other=0) != 0
        if LFU:
            rank = lfu_key(tl.load(freq_ptr + held, mask=occupied, other=0), last, held)
        else:
            rank = last * (E + 1) + held
        key = tl.where(occupied, rank, -1)
        key = tl.where(held_needed | (s_ar >= S), NEEDED, key)
        avail = key != NEEDED
        n_take = tl.minimum(tl.minimum(misses, m), tl.sum(avail.to(tl.int64), 0)).to(tl.int32)
        packed = tl.where(avail, (key + 1) * BLOCK_S + s_ar, PACKED_MAX)  # unique: ties broken by slot
        # The n_take smallest keys, one block-wide min each: a decode step misses a few experts at
        # most, so this beats sorting every slot. Candidate i goes to scratch (miss_slot_ptr) row i.
        for i in range(0, n_take):
            best = tl.min(packed, 0)
            tl.store(miss_slot_ptr + i, best % BLOCK_S)
            packed = tl.where(packed == best, PACKED_MAX, packed)
        tl.debug_barrier()
        mexp = tl.load(miss_exp_ptr + s_ar, mask=m_in, other=-1)
        take = s_ar < n_take
        cand_slot = tl.load(miss_slot_ptr + s_ar, mask=take, other=0)
        old = tl.load(slot_expert_ptr + cand_slot, mask=take, other=-1)
        tl.debug_barrier()

        # Phase 3: install the misses and stamp every needed slot.
        tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
        tl.store(expert_slot_ptr + mexp, cand_slot.to(tl.int64), mask=take)
        tl.store(slot_expert_ptr + cand_slot, mexp, mask=take)
        tl.store(last_use_ptr + where_now, step, mask=hit)
        tl.store(last_use_ptr + cand_slot, step, mask=take)
        tl.store(miss_exp_ptr + s_ar, tl.where(take, mexp, -1), mask=m_in)
        tl.store(miss_slot_ptr + s_ar, tl.where(take, cand_slot.to(tl.int64), -1), mask=m_in)
        tl.store(evicted_ptr + s_ar, tl.where(take, old, -1), mask=m_in)
        tl.debug_barrier()

        # Phase 4: remap the ids to their slots.
        for n0 in range(0, n_ids, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(ids_ptr + offs, mask=offs < n_ids, other=-1).to(tl.int64)
            ok = (ids >= 0) & (ids < E)
            slot = tl.load(expert_slot_ptr + ids, mask=ok, other=-1)
            tl.store(remapped_ptr + offs, slot, mask=offs < n_ids)

        # Phase 5 (lfu-duel): play the step on the shadows, move the selectors, follow the leader they name.
        if DUEL:
            fast_hits, slow_hits, lru_hits = play_shadows(
                fast_held_ptr,
                fast_stamps_ptr,
                slow_held_ptr,
                slow_stamps_ptr,
                lru_held_ptr,
                lru_stamps_ptr,
                fast,
                slow,
                need,
                step,
                e_ar,
                E,
                S,
            )
            psel, psel_lru = moved_selectors(psel, psel_lru, fast_hits, slow_hits, lru_hits, PSEL_MAX)
            tl.store(psel_ptr, psel)
            tl.store(psel_lru_ptr, psel_lru)
            tl.store(freq_ptr + e_ar, leader(psel, psel_lru, slow, fast), mask=e_in)

        loaded = tl.sum(take.to(tl.int64), 0)
        invalid = tl.sum(bad, 0)
        overflow = tl.maximum(lookups - S, 0)
        record_counts(
            counts_ptr,
            stats_ptr,
            aux_ptr,
            lookups,
            hits,
            misses,
            loaded,
            overflow,
            invalid,
            record_bytes,
            HAS_STATS,
            HAS_AUX,
        )
