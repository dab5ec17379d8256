"""Next-layer prefetch over a full RAM tier in one launch: SlotTable.admit's decision and copy_records' copy.

The two-launch path (admit_kernel's one-CTA decision, then copy_kernel's grid of
m x P programs) costs two graph nodes per layer per token on the side stream,
each a few microseconds on the H200 even with nothing to copy (a closed gate, a
prediction of resident experts). Here one grid of the copy's shape does both:
1. every program takes a ticket (an atomic add on the table's sync words); the
   program with ticket 0 makes the decision (admit_kernel.admit_decision, the
   admit kernel's own body: outputs, table, gate and counters), then sets the
   ready flag with an atomic exchange (acq_rel, GPU scope: it releases the
   decision's writes, after a block barrier that orders every thread's);
2. every other program waits until it reads the flag set (volatile loads, SPIN_SLEEP_NS apart, then
   one acq_rel atomic read that acquires the decision's writes);
3. program (i, p) then copies work item i's blocks p, p + P, ... (copy_kernel.copy_blocks:
   copy_records' own mapping, so the copy runs as many programs per expert as the
   two-launch path's, which PREFETCH_PROGRAMS_PER_RECORD was measured with; the
   decider copies its share too);
4. every program bumps the done count; the one that makes it the grid size
   resets the three words to 0 for the next launch (stream order publishes them).
Roles go by ticket, never by program id, so the decider is a program already
running: the waiters cannot keep it from being scheduled. In Triton's interpreter
(CPU tensors) programs run one after another: the first takes ticket 0 and
decides before any other starts, so nobody waits.
Outputs, table state, counters and slot bytes equal SlotTable.admit followed by
copy_records; the unit tests run both side by side.
"""

from __future__ import annotations

import torch
from bigmoe_pager.core.acquire_kernel import MAX_SLOTS
from bigmoe_pager.core.admit_kernel import admit_args, admit_constants, admit_outputs
from bigmoe_pager.core.copy_kernel import (
    BLOCK_BYTES,
    MAX_COMPONENTS,
    check_records_and_buffers,
    component_groups,
    copy_plan,
    record_words,
)
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

SPIN_SLEEP_NS = 200  # a waiting program's pause between reads of the ready flag (the decision takes microseconds)
TICKET, READY, DONE = 0, 1, 2  # words of SlotTable.admit_state()["sync"] (int32 [3], all 0 between launches)


class PrefetchKernelError(ValueError):
    """The fused prefetch was asked for a shape it does not take (callers check `fits` first)."""


def fits(num_slots: int, layout: ExpertLayout) -> bool:
    """Whether one fused launch serves this table and layout (else SlotTable.admit + copy_records)."""
    return num_slots <= MAX_SLOTS and len(layout.components) <= MAX_COMPONENTS


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
    programs_per_record: int,
    stats_row: torch.Tensor | None = None,
    lfu: bool = False,
    min_used_percent: int = 0,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, torch.Tensor]:
    """Decide (admit_kernel.launch_admit's rule, no masks, no source tier) and copy (row = expert id); one launch.

    Returns experts, slots, evicted, rows (int64 [m], -1 padded; rows = experts). table_state:
    SlotTable.admit_state() (with its sync words); records: uint8 [experts, pitch]; buffers: the slot buffers.
    programs_per_record: copy_records' (at most this many programs per work item; 0: one per block).
    stats_row gets bytes, prefetched, prefetch_used and prefetch_wasted_bytes as launch_admit adds them.
    """
    if not fits(num_slots, layout):
        raise PrefetchKernelError(
            f"a fused prefetch takes <= {MAX_SLOTS} slots and <= {MAX_COMPONENTS} components; "
            f"got {num_slots} slots, {len(layout.components)} components"
        )
    if programs_per_record < 0:
        raise PrefetchKernelError(f"programs_per_record must be >= 0, got {programs_per_record}")
    check_records_and_buffers(records, layout, buffers)
    plan = copy_plan(layout)
    block = max(1, block_bytes // plan.word_bytes)
    (group,) = component_groups(layout, buffers, block)
    blocks = sum(group.nblocks)
    grid = (m, min(blocks, programs_per_record) if programs_per_record else blocks)  # copy_records' grid
    flat = predicted.reshape(-1)
    out = admit_outputs(flat, m)
    kernel_for(_prefetch_kernel, flat.device)[grid](
        *admit_args(table_state, flat, out, m, None, None, None, stats_row, layout.record_bytes, min_used_percent),
        table_state["sync"],
        record_words(records, plan),
        plan.pitch_words,
        *group.outs,
        **admit_constants(num_experts, num_slots, None, None, None, stats_row, lfu),
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
        BLOCK=block,
        num_warps=4,
    )
    out["rows"] = out["experts"]  # the full tier's records are indexed by expert id
    return out


if triton is not None:
    from bigmoe_pager.core.admit_kernel import admit_decision
    from bigmoe_pager.core.copy_kernel import copy_blocks

    _TICKET = tl.constexpr(TICKET)
    _READY = tl.constexpr(READY)
    _DONE = tl.constexpr(DONE)
    _SPIN_SLEEP_NS = tl.constexpr(SPIN_SLEEP_NS)

    @triton.jit
    def _pause():
        """Sleep about SPIN_SLEEP_NS between two reads of the ready flag: the waiting warps leave the SM's issue
        slots to the compute beside them and the flag's L2 slice to the decider (never run by the interpreter,
        where nobody waits)."""
        tl.inline_asm_elementwise(
            "nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [tl.full([], _SPIN_SLEEP_NS, tl.int32)], tl.int32, False, 1
        )

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
        want_ptr,
        used_score_ptr,
        wasted_score_ptr,
        gate_closed_ptr,
        min_used_percent,
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
        sync_ptr,
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
        BLOCK_N: tl.constexpr,
        HAS_AVAIL: tl.constexpr,
        HAS_KEEP: tl.constexpr,
        HAS_SOURCE: tl.constexpr,
        HAS_STATS: tl.constexpr,
        LFU: tl.constexpr,
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
        BLOCK: tl.constexpr,
    ):
        # 1-2. Ticket 0 decides and publishes; the others wait for it (a scalar atomic: one per program).
        if tl.atomic_add(sync_ptr + _TICKET, 1) == 0:
            admit_decision(
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
                E,
                S,
                NEEDED,
                PACKED_MAX,
                BLOCK_E,
                BLOCK_S,
                BLOCK_N,
                HAS_AVAIL,
                HAS_KEEP,
                HAS_SOURCE,
                HAS_STATS,
                LFU,
            )
            tl.debug_barrier()  # every thread's stores of the decision before the release below
            tl.atomic_xchg(sync_ptr + _READY, 1)
        else:
            while tl.load(sync_ptr + _READY, volatile=True) == 0:  # plain reads of L2 while waiting
                _pause()
            tl.atomic_add(sync_ptr + _READY, 0)  # the acquire that pairs with the decider's release
        tl.debug_barrier()  # the acquire (one thread's) before any thread reads the lists

        # 3. Work item i's blocks p, p + P, ... (the lists are read at L2, past any stale L1 line).
        i = tl.program_id(0)
        s = tl.load(out_exp_ptr + i, volatile=True)  # record row = expert id (the RAM tier is full)
        d = tl.load(out_slot_ptr + i, volatile=True)
        copy_blocks(
            rec_ptr,
            s,
            d,
            pitch_words,
            out0,
            out1,
            out2,
            out3,
            tl.program_id(1),
            tl.num_programs(1),
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
            BLOCK,
        )

        # 4. The last program to finish resets the words: every program took its ticket and saw the flag by then.
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + _DONE, 1) == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(sync_ptr + _TICKET, 0)
            tl.store(sync_ptr + _READY, 0)
            tl.store(sync_ptr + _DONE, 0)
