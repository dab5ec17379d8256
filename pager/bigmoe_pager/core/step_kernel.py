"""One decode step of a layer whose RAM tier holds every expert: acquire, copy and stats in one launch.

The two-launch path (acquire_kernel's one-CTA decision, then copy_kernel's grid
of one program per possible miss and 8 KiB block) is two graph nodes per layer
per token, and its copy grid is mostly programs with nothing to do: at 40% VRAM
a decode step misses ~0.65 experts per layer, yet the grid is sized for all k
(3,088 programs for Qwen3.6, 6,020 for Flash-Next; docs/bench/pager-notes.md).

Here one grid of P programs (about two per SM) does it all, and no program
ever waits for another (so no grid size can deadlock):
1. every program makes the same decision from the table as it stood before the
   step, in registers: the step's few ids are compared with one another and
   with the slot row, and the n misses take the n smallest eviction keys;
2. it copies its share of the missing experts' blocks (grid-stride over
   misses x blocks: with no miss, a program is done after the decision);
3. program 0 writes the outputs and adds the step's counters;
4. if the step loads an expert, every program then bumps the table's done
   counter; the last one writes the new table state and resets the counter,
   after every program has read the old state. If it loads none, the programs
   use nothing the new state changes, so one of them writes it at once and
   nobody waits: a hit waits only for the ids and then their slots (the counts
   are read with the rest, the victims' counts only when victims are ranked).
Under lfu-duel the decision ranks by the counts the selectors named before the
step, and one more program (P + 1 in all) plays the step on the three shadow
tables (acquire_kernel.play_shadows) instead of copying: it runs beside the
copy, not after it (played in the tail, lfu-duel cost 0.18 ms a token over
lfu-fast where the two rank alike, 40 layers, run 10; beside it, 0.12 ms, run
11; both with two shadows). It leaves the moved selectors in two scratch words
that the program writing the state installs with the counts.
Given a ChainSignal (a forward captured whole, core.prefetch_chain), the
program writing the state, last of all, publishes the step to the forward's
chained prefetch rounds.
Outputs, table state, counters and slot bytes equal SlotTable.acquire followed
by copy_records; the unit tests run both side by side.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from bigmoe_pager.core import stats
from bigmoe_pager.core.acquire_kernel import (
    MAX_SLOTS,
    PACKED_MAX,
    STEP_SIZES,
    decision_outputs,
    duel_tensors,
    next_pow2,
)
from bigmoe_pager.core.copy_kernel import (
    BLOCK_BYTES,
    MAX_COMPONENTS,
    check_records_and_buffers,
    component_groups,
    copy_plan,
    record_words,
)
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prefetch_chain import GPU_MAX_SPINS, NO_CHAIN, ChainSignal
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_IDS = 64  # ids per step the fused path takes (decode batches); larger steps use the two-launch path
MAX_CELLS = 16384  # elements of a program's (slots x ids) or (experts x ids) comparison: stays in registers
PROGRAMS_PER_SM = 2  # 264 programs x 8 KiB on an H200: ~2 MB of PCIe reads in flight, ~10x the link's need
INTERPRETER_PROGRAMS = 3  # CPU tensors (Triton's interpreter): a few programs exercise the sharing


class StepKernelError(ValueError):
    """The fused step was asked for a shape it does not take (callers check `fits` first)."""


COMPILED: dict[str, dict[str, int]] = {}
"""What the GPU's loader reports for each step variant this process compiled first ('plain', 'chained',
'joinless'): registers per thread and local memory bytes per thread (spills and stack). Benchmark rows carry it
(adapters.vllm.process.engine_facts): run 25 found every launch of a decode graph slower with joinless steps in it.
Empty in Triton's interpreter."""


def step_variant(chain: ChainSignal | None) -> str:
    """The name COMPILED files a step launched with `chain` under."""
    if chain is None:
        return "plain"
    return "joinless" if chain.joinless else "chained"


def note_compiled(variant: str, kernel) -> None:
    """Keep the first compiled kernel's figures for `variant` (Triton's CompiledKernel once launched: n_regs,
    n_spills, which its CUDA driver fills from the function's local-memory size; anything else is ignored)."""
    if variant in COMPILED:  # every launch after the first of a variant (steps launched outside graphs)
        return
    regs, local = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    if isinstance(regs, int) and isinstance(local, int):
        COMPILED[variant] = {"registers": regs, "local_bytes": local}


def ids_block(num_ids: int) -> int:
    """Width of the kernel's id vector: a power of two >= num_ids (>= 2)."""
    return max(2, next_pow2(num_ids))


def fits(num_experts: int, num_slots: int, num_ids: int, layout: ExpertLayout, lfu: bool = False) -> bool:
    """Whether one fused launch serves a step of `num_ids` ids (else use acquire + copy_records)."""
    if not 1 <= num_ids <= MAX_IDS or num_slots > MAX_SLOTS or len(layout.components) > MAX_COMPONENTS:
        return False
    width = next_pow2(num_experts) if lfu else next_pow2(num_slots)
    return max(width, next_pow2(num_slots)) * ids_block(num_ids) <= MAX_CELLS


def default_programs(device: torch.device) -> int:
    """P for a device: PROGRAMS_PER_SM per SM on a GPU, a few in the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return PROGRAMS_PER_SM * _sm_count(index)


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_step(
    table_state: dict[str, torch.Tensor],
    ids: torch.Tensor,
    num_experts: int,
    num_slots: int,
    m: int,
    records: torch.Tensor,
    layout: ExpertLayout,
    buffers: dict[str, torch.Tensor],
    *,
    programs: int,
    stats_row: torch.Tensor | None = None,
    aux_row: torch.Tensor | None = None,
    lfu: bool = False,
    decay: int = 0,
    duel: bool = False,
    slow_decay: int = 0,
    psel_max: int = 0,
    chain: ChainSignal | None = None,
    block_bytes: int = BLOCK_BYTES,
    max_spins: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decide, copy misses from records (row = expert id) into the slot buffers, count; one launch.

    Returns what acquire_kernel.launch_acquire returns (remapped, miss_experts,
    miss_slots, evicted, counts). stats_row gets lookups, hits, misses, loaded *
    record_bytes and invalid ids; aux_row (the full RAM tier) gets loaded as
    lookups and hits. table_state is SlotTable.kernel_state(); lfu, decay, duel, slow_decay and psel_max
    are SlotTable.kernel_policy() (acquire_kernel.launch_acquire says what they mean). chain: the step, once done
    (its copies too), publishes itself to the forward's chained prefetch rounds (core.prefetch_chain); a
    joinless one first settles the round into its table and waits for the copies it needs (core.round_sync),
    giving up after max_spins polls (default GPU_MAX_SPINS on a GPU: about a second).
    """
    if not fits(num_experts, num_slots, ids.numel(), layout, lfu):
        raise StepKernelError(
            f"a fused step takes 1..{MAX_IDS} ids, <= {MAX_SLOTS} slots, <= {MAX_COMPONENTS} "
            f"components; got {ids.numel()} ids, {num_slots} slots, {len(layout.components)} components"
        )
    if programs < 1:
        raise StepKernelError(f"a fused step needs >= 1 program, got {programs}")
    check_records_and_buffers(records, layout, buffers)
    plan = copy_plan(layout)
    block = max(1, block_bytes // plan.word_bytes)
    (group,) = component_groups(layout, buffers, block)
    flat = ids.reshape(-1)
    out = decision_outputs(flat, m)
    dummy = out["counts"]  # pointer for absent stats rows (never touched: HAS_* is False)
    joinless = chain is not None and chain.joinless
    if max_spins is None:
        max_spins = GPU_MAX_SPINS if flat.is_cuda else 1
    compiled = kernel_for(_step_kernel, flat.device)[(programs + int(duel),)](
        flat,
        flat.numel(),
        table_state["expert_slot"],
        table_state["slot_expert"],
        table_state["last_use"],
        table_state["step"],
        table_state["freq"],
        *duel_tensors(table_state, duel),
        table_state["psel_next"] if duel else dummy,
        table_state["done"],
        *out.values(),
        m,
        stats_row if stats_row is not None else dummy,
        aux_row if aux_row is not None else dummy,
        chain.flags if chain is not None else dummy,
        chain.layer if chain is not None else 0,
        table_state["claim"],
        table_state["copied"],
        table_state["target"],
        table_state["filled"],
        max_spins,
        layout.record_bytes,
        programs,
        record_words(records, plan),
        plan.pitch_words,
        *group.outs,
        E=num_experts,
        S=num_slots,
        PACKED_MAX=PACKED_MAX,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_S=next_pow2(num_slots),
        BLOCK_I=ids_block(flat.numel()),
        HAS_STATS=stats_row is not None,
        HAS_AUX=aux_row is not None,
        LFU=lfu,
        DECAY=decay,
        DUEL=duel,
        SLOW_DECAY=slow_decay,
        PSEL_MAX=psel_max,
        CHAIN=NO_CHAIN if chain is None else chain.mode,
        SYNC=joinless,
        ON_GPU=flat.is_cuda,
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
    note_compiled(step_variant(chain), compiled)
    return {**out, "remapped": out["remapped"].reshape(ids.shape)}


if triton is not None:
    from bigmoe_pager.core.acquire_kernel import (
        halved,
        leader,
        lfu_key,
        moved_selectors,
        play_shadows,
        record_counts,
    )
    from bigmoe_pager.core.copy_kernel import copy_listed_share
    from bigmoe_pager.core.prefetch_chain import CANCELS, FORWARD, TIMEOUTS, publish_step, quiet_forward
    from bigmoe_pager.core.round_sync import (
        copies_under_way,
        held_slots,
        round_filled,
        settle_round,
        wait_busy,
        wait_copies,
    )

    _FORWARD, _TIMEOUTS, _CANCELS = (tl.constexpr(v) for v in (FORWARD, TIMEOUTS, CANCELS))

    # Columns of stats.COUNTERS the kernel adds to, as compile-time constants (a kernel reads only constexpr globals).
    _ERRORS = tl.constexpr(stats.ERRORS)
    _PREFETCH_LATE = tl.constexpr(stats.PREFETCH_LATE)

    @triton.jit(do_not_specialize=(*STEP_SIZES, "chain_layer"))
    def _step_kernel(
        ids_ptr,
        n_ids,
        expert_slot_ptr,
        slot_expert_ptr,
        last_use_ptr,
        step_ptr,
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
        psel_next_ptr,
        done_ptr,
        remapped_ptr,
        miss_exp_ptr,
        miss_slot_ptr,
        evicted_ptr,
        counts_ptr,
        m,
        stats_ptr,
        aux_ptr,
        chain_ptr,
        chain_layer,
        claim_ptr,
        copied_ptr,
        target_ptr,
        filled_ptr,
        max_spins,
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
        PACKED_MAX: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_I: tl.constexpr,
        HAS_STATS: tl.constexpr,
        HAS_AUX: tl.constexpr,
        LFU: tl.constexpr,
        DECAY: tl.constexpr,
        DUEL: tl.constexpr,
        SLOW_DECAY: tl.constexpr,
        PSEL_MAX: tl.constexpr,
        CHAIN: tl.constexpr,
        SYNC: tl.constexpr,
        ON_GPU: tl.constexpr,
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
        if SYNC:  # a joinless forward: the round into this table has decided, or never will (core.round_sync); in a
            # quiet one no round touches a table and no copy is under way (core.prefetch_chain): nothing to settle
            forward = tl.load(chain_ptr + _FORWARD)
            settles = ~quiet_forward(chain_ptr, forward)  # a load beside FORWARD's, one value for every thread
        # The ids are the router's, not the table's: their load is issued before the branch on `settles`, so the two
        # latencies may overlap (run 38: a quiet joinless step took 1.0-1.4 us more than a plain one; run 39 could not
        # tell this order from the old one within the probe's 1 us spread).
        j = tl.arange(0, BLOCK_I)  # id position; also the miss-list position
        ids = tl.load(ids_ptr + j, mask=j < n_ids, other=-1).to(tl.int64)
        if SYNC:
            if settles:
                cancelled, stuck = settle_round(claim_ptr, forward, max_spins, ON_GPU)
                if cancelled:
                    tl.atomic_add(chain_ptr + _CANCELS, 1)
                if stuck & (pid == 0):
                    tl.atomic_add(chain_ptr + _TIMEOUTS, 1)
        step = tl.load(step_ptr) + 1

        # 1. The decision, from the table as it stood before the step (written only at the end).
        valid = (ids >= 0) & (ids < E)
        invalid = tl.sum(((ids < -1) | (ids >= E)).to(tl.int64), 0)
        same = (ids[:, None] == ids[None, :]) & valid[:, None]  # [j, k]
        first = valid & (tl.sum((same & (j[None, :] < j[:, None])).to(tl.int32), 1) == 0)
        where_now = tl.load(expert_slot_ptr + ids, mask=valid, other=-1)
        hit = valid & (where_now >= 0)
        miss = valid & (where_now < 0)
        fresh = first & miss  # each missing expert once
        lookups = tl.sum(first.to(tl.int64), 0)
        hits = tl.sum((first & hit).to(tl.int64), 0)
        misses = lookups - hits
        # Misses are served in ascending expert id: rank = distinct missing experts below this one.
        rank = tl.sum((fresh[None, :] & (ids[None, :] < ids[:, None])).to(tl.int32), 1)

        s_ar = tl.arange(0, BLOCK_S)
        s_in = s_ar < S
        held = tl.load(slot_expert_ptr + s_ar, mask=s_in, other=-1)
        last = tl.load(last_use_ptr + s_ar, mask=s_in, other=-1)
        e_ar = tl.arange(0, BLOCK_E)
        e_in = e_ar < E
        if LFU:  # the counts the state writer adds to, read with the rest (nobody writes them before it)
            if DUEL:
                fast = halved(tl.load(fast_ptr + e_ar, mask=e_in, other=0), step, DECAY)
                slow = halved(tl.load(slow_ptr + e_ar, mask=e_in, other=0), step, SLOW_DECAY)
            else:
                uses = halved(tl.load(freq_ptr + e_ar, mask=e_in, other=0), step, DECAY)
        occupied = held >= 0
        held_needed = tl.sum(((held[:, None] == ids[None, :]) & valid[None, :]).to(tl.int32), 1) > 0
        avail = s_in & ~held_needed
        if SYNC:  # the slots this forward's round filled are not taken (a set every program reads alike, where
            # the copies' progress is not), unless too few others are left: then once those copies are all done
            if settles:  # (a quiet forward's rounds filled none, and no host copy is late)
                avail = avail & ~held_slots(filled_ptr, s_ar, avail)  # a late host copy's slot keeps its expert
                busy = round_filled(filled_ptr, forward, s_ar, avail)
                short = tl.minimum(misses, m) - tl.sum((avail & ~busy).to(tl.int64), 0)
                if short > 0:
                    late = wait_copies(copied_ptr, target_ptr, s_ar, busy, max_spins, ON_GPU)
                    if tl.sum(late.to(tl.int32), 0) == 0:
                        busy = late
                    elif pid == 0:  # misses left unplaced: counted as errors, never hidden
                        tl.atomic_add(chain_ptr + _TIMEOUTS, 1)
                        if HAS_STATS:
                            tl.atomic_add(stats_ptr + _ERRORS, short)
                avail = avail & ~busy
        n_take = tl.minimum(tl.minimum(misses, m), tl.sum(avail.to(tl.int64), 0)).to(tl.int32)
        cand = tl.full([BLOCK_I], -1, tl.int64)
        old = tl.full([BLOCK_I], -1, tl.int64)
        if n_take > 0:  # rank the victims only when there are some: a hit waits for no gather of the counts
            if DUEL:  # the counts the selectors named before the step (program P moves them, the writer installs
                # them)
                held_fast = halved(tl.load(fast_ptr + held, mask=occupied, other=0), step, DECAY)
                held_slow = halved(tl.load(slow_ptr + held, mask=occupied, other=0), step, SLOW_DECAY)
                count = leader(tl.load(psel_ptr), tl.load(psel_lru_ptr), held_slow, held_fast)
                rank_s = lfu_key(count, last, held)
            elif LFU:
                count = halved(tl.load(freq_ptr + held, mask=occupied, other=0), step, DECAY)
                rank_s = lfu_key(count, last, held)
            else:
                rank_s = last * (E + 1) + held
            key = tl.where(occupied, rank_s, -1)  # empty slots first, in slot order
            packed = tl.where(avail, (key + 1) * BLOCK_S + s_ar, PACKED_MAX)  # unique: ties broken by slot
            for i in range(0, n_take):
                best = tl.min(packed, 0)
                pick = packed == best
                cand = tl.where(j == i, best % BLOCK_S, cand)
                old = tl.where(j == i, tl.sum(tl.where(pick, held, 0), 0), old)
                packed = tl.where(pick, PACKED_MAX, packed)
        take = j < n_take
        mexp = tl.sum(tl.where(fresh[None, :] & (rank[None, :] == j[:, None]), ids[None, :], 0), 1)  # [i]
        mexp = tl.where(take, mexp, -1)
        my_cand = tl.sum(tl.where(j[None, :] == rank[:, None], cand[None, :], 0), 1)  # [j]: cand[rank_j]
        slot_after = tl.where(hit, where_now, tl.where(miss & (rank < n_take), my_cand, -1))

        # 2. Outputs and counters (nobody reads them in this launch).
        if pid == 0:
            tl.store(remapped_ptr + j, slot_after, mask=j < n_ids)
            tl.store(miss_exp_ptr + j, mexp, mask=j < m)
            tl.store(miss_slot_ptr + j, cand, mask=j < m)
            tl.store(evicted_ptr + j, old, mask=j < m)
            overflow = tl.maximum(lookups - S, 0)
            record_counts(
                counts_ptr,
                stats_ptr,
                aux_ptr,
                lookups,
                hits,
                misses,
                n_take.to(tl.int64),
                overflow,
                invalid,
                record_bytes,
                HAS_STATS,
                HAS_AUX,
            )

        # 3. This program's blocks of the copy: unit u = miss * NBLK + block, units pid, pid + P, ...
        # Under lfu-duel, program P plays the shadows instead: nobody else reads or writes them.
        copies = n_take
        if DUEL:
            copies = tl.where(pid < programs, copies, 0)
            if pid == programs:
                needed = tl.sum(((e_ar[:, None] == ids[None, :]) & valid[None, :]).to(tl.int64), 1) > 0
                uses = needed.to(tl.int64)
                fast_hits, slow_hits, lru_hits = play_shadows(
                    fast_held_ptr,
                    fast_stamps_ptr,
                    slow_held_ptr,
                    slow_stamps_ptr,
                    lru_held_ptr,
                    lru_stamps_ptr,
                    fast + uses,
                    slow + uses,
                    needed,
                    step,
                    e_ar,
                    E,
                    S,
                )
                psel, psel_lru = moved_selectors(
                    tl.load(psel_ptr), tl.load(psel_lru_ptr), fast_hits, slow_hits, lru_hits, PSEL_MAX
                )
                tl.store(psel_next_ptr, psel)
                tl.store(psel_next_ptr + 1, psel_lru)
        copy_listed_share(
            pid,
            programs,
            copies,
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

        # 3b. A joinless forward: vLLM's kernel reads the slots once this launch ends, so one program waits for the
        # round's copies into the slots this step hits, and copies any still under way after max_spins itself, at
        # once where a drain holds the slot for a late host copy (the same expert's bytes into the same slot: the race
        # with the round or the host is harmless); in a quiet forward none is under way.
        if SYNC:
            if (pid == 0) & settles:
                pending = copies_under_way(copied_ptr, target_ptr, where_now, first & hit, ON_GPU)
                n_pending = tl.sum(pending.to(tl.int64), 0)
                if HAS_STATS:  # the prefetches this step waits for: copies not hidden behind compute
                    if n_pending > 0:
                        tl.atomic_add(stats_ptr + _PREFETCH_LATE, n_pending)
                held_hits = held_slots(filled_ptr, where_now, pending)  # a drain gave up on these: no second wait
                gave_up = wait_busy(copied_ptr, target_ptr, where_now, pending & ~held_hits, max_spins, ON_GPU)
                if tl.sum(gave_up.to(tl.int32), 0) > 0:
                    tl.atomic_add(chain_ptr + _TIMEOUTS, 1)
                late = gave_up | held_hits
                n_late = tl.sum(late.to(tl.int32), 0)
                if n_late > 0:
                    late_rank = tl.sum((late[None, :] & (j[None, :] < j[:, None])).to(tl.int32), 1)
                    pick = late[None, :] & (late_rank[None, :] == j[:, None])  # [i, j]: list position i holds id j
                    late_exp = tl.sum(tl.where(pick, ids[None, :], 0), 1)
                    late_slot = tl.sum(tl.where(pick, where_now[None, :], 0), 1)
                    copy_listed_share(
                        0,
                        1,
                        n_late,
                        j,
                        late_exp,
                        late_slot,
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

        # 4. The new table state. When nothing is loaded (every id hits, or no slot is free) one program writes it
        # at once: the others use nothing it changes (the ranking was skipped and the slot map stays), so none need
        # be waited for. Under lfu-duel that program is the shadow player, which holds the new selector. Otherwise
        # the last program to get here writes it: by then every program has read the old state (the barrier orders
        # this program's reads before its count).
        tl.debug_barrier()
        if n_take == 0:
            writes = pid == (programs if DUEL else 0)
        else:
            writes = tl.atomic_add(done_ptr, 1) == (programs if DUEL else programs - 1)  # the shadow player counts
        if writes:
            tl.store(done_ptr, 0)
            tl.store(step_ptr, step)
            tl.store(expert_slot_ptr + old, -1, mask=take & (old >= 0))
            tl.store(expert_slot_ptr + mexp, cand, mask=take)
            tl.store(slot_expert_ptr + cand, mexp, mask=take)
            tl.store(last_use_ptr + where_now, step, mask=hit)
            tl.store(last_use_ptr + cand, step, mask=take)
            if LFU:
                needed = tl.sum(((e_ar[:, None] == ids[None, :]) & valid[None, :]).to(tl.int64), 1) > 0
                if DUEL:  # both counts, the selectors the shadow player left (atomic reads: it may have run on
                    # another SM), and the leader they name
                    fast = fast + needed.to(tl.int64)
                    slow = slow + needed.to(tl.int64)
                    tl.store(fast_ptr + e_ar, fast, mask=e_in)
                    tl.store(slow_ptr + e_ar, slow, mask=e_in)
                    psel = tl.atomic_add(psel_next_ptr, 0)
                    psel_lru = tl.atomic_add(psel_next_ptr + 1, 0)
                    tl.store(psel_ptr, psel)
                    tl.store(psel_lru_ptr, psel_lru)
                    tl.store(freq_ptr + e_ar, leader(psel, psel_lru, slow, fast), mask=e_in)
                else:
                    tl.store(freq_ptr + e_ar, uses + needed.to(tl.int64), mask=e_in)
            if CHAIN != 0:  # last: every program's copies are done (their counts were acquired above)
                publish_step(chain_ptr, chain_layer, CHAIN, ON_GPU)
