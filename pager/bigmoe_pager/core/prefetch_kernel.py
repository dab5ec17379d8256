"""One prefetch round of a layer whose RAM tier holds every expert: admit and copy in one launch.

The two-launch round (admit_kernel's one-CTA decision, then copy_kernel's grid) puts two graph
nodes a layer on the prefetch side stream of vLLM's CUDA graphs, and a round that copies nothing
(the idle path: recall 0, a closed gate) still pays for both. Here P programs (the pager's
prefetch_programs, 16 by default) do it all, the way step_kernel does a step:
1. every program makes the same decision from the table as it stood before the round, in
   registers (the proposal is compared with every expert and every slot instead of scattered
   into a scratch table);
2. program 0 writes the outputs;
3. every program bumps the table's prefetch done counter once it has read the table; the last
   one writes the new table state and the round's counters and resets the counter;
4. each program copies its share of the chosen experts' blocks (grid-stride over experts x
   blocks), or returns at once when the round copies nothing.
No program waits for another, so no grid size can deadlock. Outputs, table state, counters
and slot bytes equal SlotTable.admit followed by copy_records; the unit tests run both side by side.
"""

from __future__ import annotations

import torch
from bigmoe_pager.core import stats
from bigmoe_pager.core.acquire_kernel import MAX_SLOTS, NEEDED_KEY, PACKED_MAX, next_pow2
from bigmoe_pager.core.copy_kernel import (
    BLOCK_BYTES,
    MAX_COMPONENTS,
    check_records_and_buffers,
    component_groups,
    copy_plan,
    record_words,
)
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.step_kernel import MAX_CELLS, MAX_IDS, ids_block
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


class PrefetchKernelError(ValueError):
    """The fused round was asked for a shape it does not take (callers check `fits` first)."""


def fits(num_experts: int, num_slots: int, num_ids: int, layout: ExpertLayout) -> bool:
    """Whether one fused launch serves a round proposing `num_ids` ids (else admit + copy_records).

    Each program holds [experts x ids] and [slots x ids] comparisons, and the [chosen x experts] one that lists
    the chosen experts in ascending id, in registers (MAX_CELLS each)."""
    if not 1 <= num_ids <= MAX_IDS or num_slots > MAX_SLOTS or len(layout.components) > MAX_COMPONENTS:
        return False
    width = max(next_pow2(num_experts), next_pow2(num_slots))
    return width * ids_block(num_ids) <= MAX_CELLS


def launch_prefetch(
    table_state: dict[str, torch.Tensor],
    predicted: torch.Tensor,
    num_experts: int,
    num_slots: int,
    m: int,
    records: torch.Tensor,
    layout: ExpertLayout,
    buffers: dict[str, torch.Tensor],
    *,
    programs: int,
    stats_row: torch.Tensor | None = None,
    lfu: bool = False,
    min_used_percent: int = 0,
    budget: int = 0,
    lift_percent: int | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, torch.Tensor]:
    """Decide (SlotTable.admit's rule), copy the chosen experts from records (row = expert id) into the slot
    buffers, count; one launch. Returns experts, slots, evicted, rows (int64 [m], -1 padded) as
    admit_kernel.launch_admit does. table_state: SlotTable.admit_state(); the policy arguments are
    launch_admit's (no available mask, kept slots or partial source: the RAM tier is full)."""
    flat = predicted.reshape(-1)
    if not fits(num_experts, num_slots, flat.numel(), layout):
        raise PrefetchKernelError(
            f"a fused prefetch takes 1..{MAX_IDS} ids, <= {MAX_SLOTS} slots, <= {MAX_COMPONENTS} "
            f"components; got {flat.numel()} ids, {num_slots} slots, {len(layout.components)} components"
        )
    if programs < 1:
        raise PrefetchKernelError(f"a fused prefetch needs >= 1 program, got {programs}")
    check_records_and_buffers(records, layout, buffers)
    plan = copy_plan(layout)
    block = max(1, block_bytes // plan.word_bytes)
    (group,) = component_groups(layout, buffers, block)
    device = flat.device
    out = {name: torch.empty(m, dtype=torch.int64, device=device) for name in ("experts", "slots", "evicted")}
    dummy = out["experts"]  # pointer for an absent stats row (never touched: HAS_STATS is False)
    kernel_for(_prefetch_kernel, device)[(programs,)](
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
        table_state["used_score"],
        table_state["wasted_score"],
        table_state["gate_closed"],
        table_state["prefetch_done"],
        min_used_percent,
        -1 if lift_percent is None else lift_percent,
        *out.values(),
        m,
        stats_row if stats_row is not None else dummy,
        layout.record_bytes,
        programs,
        record_words(records, plan),
        plan.pitch_words,
        *group.outs,
        E=num_experts,
        S=num_slots,
        NEEDED=NEEDED_KEY,
        PACKED_MAX=PACKED_MAX,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_S=next_pow2(num_slots),
        BLOCK_I=ids_block(flat.numel()),
        HAS_STATS=stats_row is not None,
        LFU=lfu,
        BUDGET=budget,
        OFF0=group.offsets[0],
        OFF1=group.offsets[1],
        OFF2=group.offsets[2],
        OFF3=group.offsets[3],
        N0=group.sizes[0],
        N1=group.sizes[1],
        N2=group.sizes[2],
        N3=group.sizes[3],
        NB0=group.nblocks[0],
        NB1=group.nblocks[1],
        NB2=group.nblocks[2],
        NB3=group.nblocks[3],
        NBLK=sum(group.nblocks),
        BLOCK=block,
        num_warps=4,
    )
    return {**out, "rows": out["experts"]}  # the records are indexed by expert id


if triton is not None:
    from bigmoe_pager.core.admit_kernel import gate_scores, judge_round, victim_keys, within_budget
    from bigmoe_pager.core.copy_kernel import copy_listed_share

    # Columns of stats.COUNTERS the kernel adds to, as compile-time constants (a kernel reads only constexpr globals).
    _BYTES = tl.constexpr(stats.BYTES)
    _PREFETCHED = tl.constexpr(stats.PREFETCHED)
    _PREFETCH_USED = tl.constexpr(stats.PREFETCH_USED)
    _PREFETCH_WASTED_BYTES = tl.constexpr(stats.PREFETCH_WASTED_BYTES)

    @triton.jit
    def _prefetch_kernel(
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
        used_score_ptr,
        wasted_score_ptr,
        gate_closed_ptr,
        done_ptr,
        min_used_percent,
        lift_percent,
        out_exp_ptr,
        out_slot_ptr,
        out_evicted_ptr,
        m,
        stats_ptr,
        record_bytes,
        programs,
        rec_ptr,
        pitch_words,
        out0,
        out1,
        out2,
        out3,
        E: tl.constexpr,
        S: tl.constexpr,
        NEEDED: tl.constexpr,
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_I: tl.constexpr,
        HAS_STATS: tl.constexpr,
        LFU: tl.constexpr,
        BUDGET: tl.constexpr,
        OFF0: tl.constexpr,
        OFF1: tl.constexpr,
        OFF2: tl.constexpr,
        OFF3: tl.constexpr,
        N0: tl.constexpr,
        N1: tl.constexpr,
        N2: tl.constexpr,
        N3: tl.constexpr,
        NB0: tl.constexpr,
        NB1: tl.constexpr,
        NB2: tl.constexpr,
        NB3: tl.constexpr,
        NBLK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        step = tl.load(step_ptr)
        e_ar = tl.arange(0, BLOCK_E)
        s_ar = tl.arange(0, BLOCK_S)
        j = tl.arange(0, BLOCK_I)  # proposal position; also the chosen list's position (m <= ids)
        e_in = e_ar < E
        s_in = s_ar < S
        held = tl.load(slot_expert_ptr + s_ar, mask=s_in, other=-1)
        last = tl.load(last_use_ptr + s_ar, mask=s_in, other=-1)
        slot_now = tl.load(expert_slot_ptr + e_ar, mask=e_in, other=-1)

        # 1. Settle the previous round (judged once a step ran since its admit): its copies, and a closed round's
        # would-fetch marks (used: needed since, so resident now with a later stamp).
        pstep = tl.load(prefetch_step_ptr)
        judged = step > pstep
        marks = tl.load(prefetched_ptr + s_ar, mask=s_in, other=-1)
        would_fetch = tl.load(would_fetch_ptr + e_ar, mask=e_in, other=0)
        n_used, n_wasted, gate_used, gate_wasted = judge_round(
            held, last, marks, would_fetch, slot_now, last_use_ptr, pstep, judged
        )
        used_score, wasted_score, gate_open, lifted = gate_scores(
            tl.load(used_score_ptr), tl.load(wasted_score_ptr), gate_used, gate_wasted, min_used_percent, lift_percent
        )

        # 2. The experts to fetch: proposed, not resident, within the budget (the highest use counts, ties: lower id).
        ids = tl.load(pred_ptr + j, mask=j < n_pred, other=-1).to(tl.int64)
        valid = (ids >= 0) & (ids < E)
        want = tl.sum(((e_ar[:, None] == ids[None, :]) & valid[None, :]).to(tl.int32), 1) > 0
        fetch = want & (slot_now < 0)
        fetch = within_budget(fetch, lifted, freq_ptr, e_ar, e_in, E, BUDGET)
        would_fetch = tl.where(judged, 0, would_fetch) | (fetch & ~gate_open).to(tl.int32)
        fetch = fetch & gate_open
        n_fetch = tl.sum(fetch.to(tl.int64), 0)
        pos = tl.cumsum(fetch.to(tl.int32), 0) - 1  # ascending id
        chosen = tl.sum(
            tl.where(fetch[None, :] & (pos[None, :] == j[:, None]), e_ar[None, :].to(tl.int64), 0), 1
        )  # [i]

        # 3. Slots: never one holding a proposed expert or one the latest step used; then by (empty, policy key, slot).
        protect = (tl.sum(((held[:, None] == ids[None, :]) & valid[None, :]).to(tl.int32), 1) > 0) | (last >= step)
        key = victim_keys(held, last, protect, s_ar, freq_ptr, E, S, NEEDED, LFU)
        free = key != NEEDED
        n_take = tl.minimum(tl.minimum(n_fetch, m), tl.sum(free.to(tl.int64), 0)).to(tl.int32)
        cand = tl.full([BLOCK_I], -1, tl.int64)
        old = tl.full([BLOCK_I], -1, tl.int64)
        packed = tl.where(free, (key + 1) * BLOCK_S + s_ar, PACKED_MAX)  # unique: ties broken by slot
        for i in range(0, n_take):
            best = tl.min(packed, 0)
            victim = packed == best
            cand = tl.where(j == i, best % BLOCK_S, cand)
            old = tl.where(j == i, tl.sum(tl.where(victim, held, 0), 0), old)
            packed = tl.where(victim, PACKED_MAX, packed)
        take = j < n_take
        mexp = tl.where(take, chosen, -1)
        if pid == 0:
            tl.store(out_exp_ptr + j, mexp, mask=j < m)
            tl.store(out_slot_ptr + j, cand, mask=j < m)
            tl.store(out_evicted_ptr + j, old, mask=j < m)

        # 4. The new table state, written by the last program to have read the old one (the barrier orders this
        # program's reads before its count).
        tl.debug_barrier()
        if tl.atomic_add(done_ptr, 1) == programs - 1:
            tl.store(done_ptr, 0)
            tl.store(prefetched_ptr + s_ar, tl.where(judged, -1, marks), mask=s_in)
            tl.store(would_fetch_ptr + e_ar, would_fetch, mask=e_in)
            tl.debug_barrier()  # the cleared marks land before the new ones, which may fall on the same slots
            tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
            tl.store(expert_slot_ptr + mexp, cand, mask=take)
            tl.store(slot_expert_ptr + cand, mexp, mask=take)
            tl.store(last_use_ptr + cand, step, mask=take)
            tl.store(prefetched_ptr + cand, mexp, mask=take)
            tl.store(prefetch_step_ptr, step)
            tl.store(used_score_ptr, used_score)
            tl.store(wasted_score_ptr, wasted_score)
            tl.store(gate_closed_ptr, tl.load(gate_closed_ptr) + (1 - gate_open.to(tl.int64)))
            if HAS_STATS:
                n = n_take.to(tl.int64)
                tl.atomic_add(stats_ptr + _BYTES, n * record_bytes)
                tl.atomic_add(stats_ptr + _PREFETCHED, n)
                tl.atomic_add(stats_ptr + _PREFETCH_USED, n_used)
                tl.atomic_add(stats_ptr + _PREFETCH_WASTED_BYTES, n_wasted * record_bytes)

        # 5. This program's blocks of the copy: unit u = chosen * NBLK + block, units pid, pid + P, ...
        copy_listed_share(
            pid,
            programs,
            n_take,
            j,
            mexp,  # record row = expert id (the RAM tier is full)
            cand,
            rec_ptr,
            pitch_words,
            out0,
            out1,
            out2,
            out3,
            OFF0,
            OFF1,
            OFF2,
            OFF3,
            N0,
            N1,
            N2,
            N3,
            NB0,
            NB1,
            NB2,
            NB3,
            NBLK,
            BLOCK,
        )
