"""SlotTable.admit (next-layer prefetch) as one Triton program.

The torch formulation of `admit` is 74 tiny ops (torch.profiler, 256 experts); on
the H200 it cost about 140 us per layer even when every prediction was -1 (nothing
to copy). This kernel makes the same
decision (same outputs, same table state, same counters: the unit tests run
both side by side) in a single program of one CTA, with block barriers between
phases, the table's want scratch for the scatter of predictions, and the output
tensors as scratch for the two lists it builds (experts to fetch, slots to take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bigmoe_pager.core import stats
from bigmoe_pager.core.acquire_kernel import IDS_BLOCK, MAX_SLOTS, NEEDED_KEY, PACKED_MAX, next_pow2
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


@dataclass(frozen=True)
class SourceRows:
    """Where a partial tier below keeps each expert's record, and which of its rows are whole: what a decision may
    fetch from it (core.ram_tier makes it; SlotTable.admit and this kernel read it)."""

    expert_row: torch.Tensor
    """int64 [experts]: record row of each expert, -1 when the tier does not hold it."""
    posted: torch.Tensor
    """int64 [rows + 1]: nonzero where a row's posted read is unconfirmed (its bytes may not be whole)."""


def launch_admit(
    table_state: dict[str, torch.Tensor],
    predicted: torch.Tensor,
    num_experts: int,
    num_slots: int,
    m: int,
    available: torch.Tensor | None = None,
    keep_slots: torch.Tensor | None = None,
    stats_row: torch.Tensor | None = None,
    record_bytes: int = 0,
    source: SourceRows | None = None,
    lfu: bool = False,
    min_used_percent: int = 0,
    budget: int = 0,
    lift_percent: int | None = None,
    chain_flags: torch.Tensor | None = None,
    record_blocks: int = 0,
    num_warps: int = 4,
) -> dict[str, torch.Tensor]:
    """Run the prefetch decision; returns experts, slots, evicted, rows (int64 [m], -1 padded).

    table_state: SlotTable.admit_state() (maps, stamps, counts, prefetch marks, want scratch).
    available: bool [experts] that may be fetched; keep_slots: bool [slots] that must not be taken.
    stats_row: int64 [11] counters (stats.COUNTERS) that get bytes, prefetched, prefetch_used and
    prefetch_wasted_bytes added. source: SourceRows of a partial tier below (only experts in its
    whole rows are fetched; rows = their record rows); None: rows = experts.
    lfu: rank candidate slots by (use count, last use, expert).
    min_used_percent: the prefetch gate's threshold (slots.MIN_USED_PERCENT); it reads and updates table_state's
    used_score, wasted_score, gate_closed and would-fetch marks.
    budget: SlotTable.prefetch_budget (at most this many fetched, the highest use counts first; 0: no limit).
    lift_percent: SlotTable.lift_percent (the budget is ignored while the gate's scores reach it; None: never).
    chain_flags: a joinless chained forward's flags (core.round_sync): the round first claims the table for the
    forward (a step that came first has cancelled it: then nothing is decided and every output is -1), and marks
    each slot it fills as `record_blocks` copy blocks short of done before it releases the decision.
    num_warps: the CTA's warps (scripts/gpu_decide_timing.py times the choices).
    """
    if num_slots > MAX_SLOTS:
        raise ValueError(f"the admit kernel handles up to {MAX_SLOTS} slots per table, got {num_slots}")
    flat = predicted.reshape(-1)
    device = flat.device
    out = {name: torch.empty(m, dtype=torch.int64, device=device) for name in ("experts", "slots", "evicted", "rows")}
    dummy = out["experts"]  # pointer for absent inputs (never read: HAS_* is False)
    kernel_for(decide_round, device)[(1,)](
        flat,
        flat.numel(),
        table_state["expert_slot"],
        table_state["slot_expert"],
        table_state["last_use"],
        table_state["step"],
        table_state["freq"],
        table_state["prefetched"],
        table_state["would_fetch"],
        table_state["prefetch_step"],
        table_state["want"],
        table_state["used_score"],
        table_state["wasted_score"],
        table_state["gate_closed"],
        min_used_percent,
        -1 if lift_percent is None else lift_percent,
        _bytes_of(available, dummy),
        _bytes_of(keep_slots, dummy),
        dummy if source is None else source.expert_row,
        dummy if source is None else source.posted,
        *out.values(),
        m,
        stats_row if stats_row is not None else dummy,
        record_bytes,
        dummy if chain_flags is None else chain_flags,
        table_state["claim"],
        table_state["copied"],
        table_state["target"],
        table_state["filled"],
        record_blocks,
        E=num_experts,
        S=num_slots,
        NEEDED=NEEDED_KEY,
        PACKED_MAX=PACKED_MAX,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_S=next_pow2(num_slots),
        BLOCK_N=IDS_BLOCK,
        HAS_AVAIL=available is not None,
        HAS_KEEP=keep_slots is not None,
        HAS_SOURCE=source is not None,
        HAS_STATS=stats_row is not None,
        LFU=lfu,
        BUDGET=budget,
        SYNC=chain_flags is not None,
        ON_GPU=flat.is_cuda,
        num_warps=num_warps,
    )
    if source is None:
        out["rows"] = out["experts"]  # the records are indexed by expert id
    return out


def _bytes_of(mask: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A bool mask as uint8 bytes (a view when it already is bool), or the dummy pointer when absent."""
    if mask is None:
        return dummy
    return mask.reshape(-1).to(device=dummy.device, dtype=torch.bool).view(torch.uint8)


if triton is not None:
    from bigmoe_pager.core.acquire_kernel import lfu_key
    from bigmoe_pager.core.prefetch_chain import FORWARD, count_open_gate, holding_back, quiet_forward
    from bigmoe_pager.core.round_sync import claim_round, held_slots, release_round

    _FORWARD = tl.constexpr(FORWARD)

    # Columns of stats.COUNTERS the kernel adds to, as compile-time constants (a kernel reads only constexpr globals).
    _BYTES = tl.constexpr(stats.BYTES)
    _PREFETCHED = tl.constexpr(stats.PREFETCHED)
    _PREFETCH_USED = tl.constexpr(stats.PREFETCH_USED)
    _PREFETCH_WASTED_BYTES = tl.constexpr(stats.PREFETCH_WASTED_BYTES)

    @triton.jit
    def judge_round(held, last, marks, would_fetch, slot_now, last_use_ptr, pstep, judged):
        """The previous round, judged once a step ran since its admit: (copies used, copies wasted, and both counts
        with a closed round's would-fetch marks added, judged alike: used = needed since, so resident now with a
        later stamp). held, last, marks: [slots]; would_fetch, slot_now: [experts]."""
        marked = (marks >= 0) & judged
        used = marked & (held == marks) & (last > pstep)
        n_used = tl.sum(used.to(tl.int64), 0)
        n_wasted = tl.sum((marked & ~used).to(tl.int64), 0)
        marked_now = (would_fetch != 0) & judged
        stamp = tl.load(last_use_ptr + slot_now, mask=marked_now & (slot_now >= 0), other=-1)
        marked_used = marked_now & (slot_now >= 0) & (stamp > pstep)
        gate_used = n_used + tl.sum(marked_used.to(tl.int64), 0)
        gate_wasted = n_wasted + tl.sum((marked_now & ~marked_used).to(tl.int64), 0)
        return n_used, n_wasted, gate_used, gate_wasted

    @triton.jit
    def scores_at_least(used_score, wasted_score, percent):
        """The gate's rule (SlotTable._scores_at_least on the device): at least `percent` of the judged were used."""
        return used_score * (100 - percent) >= wasted_score * percent

    @triton.jit
    def gate_scores(used_score, wasted_score, gate_used, gate_wasted, min_used_percent, lift_percent):
        """The gate: a round that judged any folds into the decayed scores (x64 fixed point, 1/8 decay). Returns the
        new scores, whether this round may fetch, and whether the budget is lifted (lift_percent < 0: never)."""
        settled = gate_used + gate_wasted > 0
        used_score = tl.where(settled, used_score - (used_score >> 3) + (gate_used << 6), used_score)
        wasted_score = tl.where(settled, wasted_score - (wasted_score >> 3) + (gate_wasted << 6), wasted_score)
        gate_open = scores_at_least(used_score, wasted_score, min_used_percent)
        lifted = (lift_percent >= 0) & scores_at_least(used_score, wasted_score, lift_percent)
        return used_score, wasted_score, gate_open, lifted

    @triton.jit
    def within_budget(fetch, lifted, freq_ptr, e_ar, e_in, E: tl.constexpr, BUDGET: tl.constexpr):
        """fetch [experts] cut to the BUDGET candidates with the highest use counts (ties: lower id), one block-wide
        max each; whole while lifted; BUDGET 0: no limit."""
        if BUDGET > 0:
            uses = tl.minimum(tl.load(freq_ptr + e_ar, mask=e_in, other=0), 1023)
            key = tl.where(fetch, uses * E + (E - 1 - e_ar), -1)
            keep = e_ar < 0
            for _ in tl.static_range(BUDGET):
                best = tl.max(key, 0)
                pick = (key == best) & (best >= 0)
                keep = keep | pick
                key = tl.where(pick, -1, key)
            fetch = fetch & (keep | lifted)
        return fetch

    @triton.jit
    def victim_keys(
        held, last, protect, s_ar, freq_ptr, E: tl.constexpr, S: tl.constexpr, NEEDED: tl.constexpr, LFU: tl.constexpr
    ):
        """Each slot's eviction key for a prefetch round: -1 empty, NEEDED protected (or past S), else the policy's
        rank (lfu: use count, then last use, then expert; lru: last use, then expert)."""
        occupied = held >= 0
        if LFU:
            rank = lfu_key(tl.load(freq_ptr + held, mask=occupied, other=0), last, held)
        else:
            rank = last * (E + 1) + held
        key = tl.where(occupied, rank, -1)
        return tl.where((occupied & protect) | (s_ar >= S), NEEDED, key)

    @triton.jit(do_not_specialize=("n_pred", "m"))
    def decide_round(
        pred_ptr,
        n_pred,
        expert_slot_ptr,
        slot_expert_ptr,
        last_use_ptr,
        step_ptr,
        freq_ptr,
        prefetched_ptr,
        would_fetch_ptr,
        prefetch_step_ptr,
        want_ptr,
        used_score_ptr,
        wasted_score_ptr,
        gate_closed_ptr,
        min_used_percent,
        lift_percent,
        avail_ptr,
        keep_ptr,
        src_row_ptr,
        src_posted_ptr,
        out_exp_ptr,
        out_slot_ptr,
        out_evicted_ptr,
        out_row_ptr,
        m,
        stats_ptr,
        record_bytes,
        flags_ptr,
        claim_ptr,
        copied_ptr,
        target_ptr,
        filled_ptr,
        record_blocks,
        E: tl.constexpr,
        S: tl.constexpr,
        NEEDED: tl.constexpr,
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_AVAIL: tl.constexpr,
        HAS_KEEP: tl.constexpr,
        HAS_SOURCE: tl.constexpr,
        HAS_STATS: tl.constexpr,
        LFU: tl.constexpr,
        BUDGET: tl.constexpr,
        SYNC: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        """The admit decision of one round (launch_admit says what it reads and writes) in one program: launched
        alone as the admit kernel (one CTA), or called by the program that decides each round of a forward's
        one-node rounds (core.forward_rounds)."""
        claimed = True
        forward = 0
        if SYNC:  # a joinless forward: hold the table before reading it, or find the step came first; a quiet one
            # (core.prefetch_chain) holds none and takes nothing, judges and marks as always, and no step settles it
            forward = tl.load(flags_ptr + _FORWARD)
            quiet = quiet_forward(flags_ptr, forward)
            claimed = quiet
            if not quiet:
                claimed = claim_round(claim_ptr, forward)
        if claimed:
            step = tl.load(step_ptr)
            e_ar = tl.arange(0, BLOCK_E)
            s_ar = tl.arange(0, BLOCK_S)  # also indexes the output lists (m <= S)
            e_in = e_ar < E
            s_in = s_ar < S
            m_in = s_ar < m
            held = tl.load(slot_expert_ptr + s_ar, mask=s_in, other=-1)
            last = tl.load(last_use_ptr + s_ar, mask=s_in, other=-1)
            occupied = held >= 0
            # The gate's state, read before any store: every thread reads the old values, stores come after a barrier.
            used_score = tl.load(used_score_ptr)
            wasted_score = tl.load(wasted_score_ptr)
            gate_closed = tl.load(gate_closed_ptr)

            # Phase 1: settle the previous round (judged once a step ran since its admit), clear the
            # want scratch and the fetch list.
            pstep = tl.load(prefetch_step_ptr)
            judged = step > pstep
            marks = tl.load(prefetched_ptr + s_ar, mask=s_in, other=-1)
            would_fetch = tl.load(would_fetch_ptr + e_ar, mask=e_in, other=0)
            slot_now = tl.load(expert_slot_ptr + e_ar, mask=e_in, other=-1)
            n_used, n_wasted, gate_used, gate_wasted = judge_round(
                held, last, marks, would_fetch, slot_now, last_use_ptr, pstep, judged
            )
            tl.store(prefetched_ptr + s_ar, tl.where(judged, -1, marks), mask=s_in)
            would_fetch = tl.where(judged, 0, would_fetch)
            used_score, wasted_score, gate_open, lifted = gate_scores(
                used_score, wasted_score, gate_used, gate_wasted, min_used_percent, lift_percent
            )
            tl.store(want_ptr + e_ar, 0, mask=e_in)
            tl.store(out_exp_ptr + s_ar, -1, mask=m_in)
            tl.debug_barrier()
            for n0 in range(0, n_pred, BLOCK_N):
                offs = n0 + tl.arange(0, BLOCK_N)
                ids = tl.load(pred_ptr + offs, mask=offs < n_pred, other=-1).to(tl.int64)
                tl.store(want_ptr + ids, 1, mask=(ids >= 0) & (ids < E))
            tl.debug_barrier()

            # Phase 2: experts to fetch in ascending id; candidate slots by (empty, policy key, slot).
            want = tl.load(want_ptr + e_ar, mask=e_in, other=0) != 0
            fetch = want & (slot_now < 0)
            if HAS_AVAIL:
                fetch = fetch & (tl.load(avail_ptr + e_ar, mask=e_in, other=0) != 0)
            if HAS_SOURCE:  # held by the tier below in a row with no unconfirmed read
                row = tl.load(src_row_ptr + e_ar, mask=e_in, other=-1)
                fetch = fetch & (row >= 0) & (tl.load(src_posted_ptr + row, mask=row >= 0, other=1) == 0)
            fetch = within_budget(fetch, lifted, freq_ptr, e_ar, e_in, E, BUDGET)
            held_back = ~gate_open
            if SYNC:  # (copies that keep landing late: the gate's judging goes on, its fetching does not)
                late_path = holding_back(flags_ptr, forward)
                held_back = held_back | quiet | late_path
                count_open_gate(flags_ptr, gate_open & ~late_path)
            tl.store(would_fetch_ptr + e_ar, would_fetch | (fetch & held_back).to(tl.int32), mask=e_in)
            fetch = fetch & ~held_back
            n_fetch = tl.sum(fetch.to(tl.int64), 0)
            pos = tl.cumsum(fetch.to(tl.int32), 0) - 1
            tl.store(out_exp_ptr + pos, e_ar.to(tl.int64), mask=fetch & (pos < m))
            # Protected: predicted, used by the latest step, or in a slot the caller keeps.
            protect = (tl.load(want_ptr + held, mask=occupied, other=0) != 0) | (last >= step)
            if HAS_KEEP:
                protect = protect | (tl.load(keep_ptr + s_ar, mask=s_in, other=0) != 0)
            if SYNC:  # a slot a late host copy still targets keeps its expert (round_sync: HELD)
                protect = protect | held_slots(filled_ptr, s_ar, s_in)
            key = victim_keys(held, last, protect, s_ar, freq_ptr, E, S, NEEDED, LFU)
            free = key != NEEDED
            n_take = tl.minimum(tl.minimum(n_fetch, m), tl.sum(free.to(tl.int64), 0)).to(tl.int32)
            packed = tl.where(free, (key + 1) * BLOCK_S + s_ar, PACKED_MAX)  # unique: ties broken by slot
            # The n_take smallest keys, one block-wide min each (a few per layer); candidate i -> out_slot row i.
            for i in range(0, n_take):
                best = tl.min(packed, 0)
                tl.store(out_slot_ptr + i, best % BLOCK_S)
                packed = tl.where(packed == best, PACKED_MAX, packed)
            tl.debug_barrier()
            take = s_ar < n_take
            mexp = tl.load(out_exp_ptr + s_ar, mask=take, other=-1)
            cand = tl.load(out_slot_ptr + s_ar, mask=take, other=0)
            old = tl.load(slot_expert_ptr + cand, mask=take, other=-1)
            tl.debug_barrier()

            # Phase 3: install, stamp with the latest step, mark for the next round's counters.
            tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
            tl.store(expert_slot_ptr + mexp, cand, mask=take)
            tl.store(slot_expert_ptr + cand, mexp, mask=take)
            tl.store(last_use_ptr + cand, step, mask=take)
            tl.store(prefetched_ptr + cand, mexp, mask=take)
            tl.store(out_exp_ptr + s_ar, tl.where(take, mexp, -1), mask=m_in)
            tl.store(out_slot_ptr + s_ar, tl.where(take, cand, -1), mask=m_in)
            tl.store(out_evicted_ptr + s_ar, tl.where(take, old, -1), mask=m_in)
            if HAS_SOURCE:
                src = tl.load(src_row_ptr + mexp, mask=take, other=-1)
                tl.store(out_row_ptr + s_ar, tl.where(take, src, -1), mask=m_in)
            tl.store(prefetch_step_ptr, step)
            tl.store(used_score_ptr, used_score)
            tl.store(wasted_score_ptr, wasted_score)
            tl.store(gate_closed_ptr, gate_closed + (1 - gate_open.to(tl.int64)))
            if HAS_STATS:
                n = tl.sum(take.to(tl.int64), 0)
                tl.atomic_add(stats_ptr + _BYTES, n * record_bytes)
                tl.atomic_add(stats_ptr + _PREFETCHED, n)
                tl.atomic_add(stats_ptr + _PREFETCH_USED, n_used)
                tl.atomic_add(stats_ptr + _PREFETCH_WASTED_BYTES, n_wasted * record_bytes)
            if SYNC:  # each filled slot is record_blocks short of done until the round's copy has written it, and
                # marked as this forward's (the step's programs all exclude the same slots from their victims)
                # (past any earlier copy into the slot still under way, e.g. the host's: copies into a slot land
                # in order, so `copied` passes the old goal before it reaches this one)
                done = tl.load(copied_ptr + cand, mask=take, other=0)
                goal = tl.maximum(done, tl.load(target_ptr + cand, mask=take, other=0)) + record_blocks
                tl.store(target_ptr + cand, goal, mask=take)
                tl.store(filled_ptr + cand, forward, mask=take)
                tl.debug_barrier()  # every store of the decision is made before the release
                release_round(claim_ptr, forward, ON_GPU)  # in a quiet forward too: one-node copiers wait for it
        else:  # cancelled: nothing to copy
            s_ar = tl.arange(0, BLOCK_S)
            m_in = s_ar < m
            tl.store(out_exp_ptr + s_ar, -1, mask=m_in)
            tl.store(out_slot_ptr + s_ar, -1, mask=m_in)
            tl.store(out_evicted_ptr + s_ar, -1, mask=m_in)
            tl.store(out_row_ptr + s_ar, -1, mask=m_in)
