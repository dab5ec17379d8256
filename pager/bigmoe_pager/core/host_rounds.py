"""The device side of a prefetch round the host copies (BIGMOE_PREFETCH_HOST_COPIER): its publication, and a
forward's drain.

A joinless round (core.round_sync) decides on the GPU which experts go into which slots, and sets each filled slot's
`target`: the `copied` value that says its copy is done. Instead of copying with SM programs, the round publishes the
list to the layer's mailbox in pinned memory (`publish_round`), and core.host_copier's thread copies it with the copy
engines, then writes each slot's goal into `copied`. The next step waits for the slots it needs exactly as for a
kernel's copy.

Nothing else orders the host's copies, so a forward whose rounds the host copies ends, once its side stream is
joined (so that every publication of the forward is in), with `drain_published`: a device wait until no published
copy is under way in any of those layers. Otherwise a copy could land in a slot that a later step (of the next
forward, or an eager one) took for another expert. The wait is bounded (about a second); a copy still under way
when it gives up is late, and the drain HOLDS its slot (core.round_sync: `filled` = HELD): no round or joinless step
gives a held slot to another expert, a step that hits it copies the expert itself without waiting, and a later
drain releases it once the copy has landed, waiting for it no more than the steps do. A drain that holds a slot
adds one to the chain's LATE word; every core.prefetch_chain.LATE_LIMIT-th holds the rounds back for a while (the
copy engines' work may not be landing beside the kernels, run 38: every forward's drain would wait its second), and
no hold-back ends while a late copy is still under way. A
publication with entries sets the chain's PUBLISHED word; a drain clears it once no copy is under way (none late
either), and one that finds it clear returns at once (every earlier copy was seen done by an earlier drain, and
nothing published since), which is every forward of an idle prefetch path (its gates closed, its lists empty): one
load instead of a pass over every layer's slots.

Two publishers: the one-node kernel (core.forward_rounds, its one program after each decision) and a per-layer round
(ExpertPager.prefetch with a mailbox: the admit kernel, then `publish_admitted`'s one-program launch).
"""

from __future__ import annotations

import torch
from bigmoe_pager.core.acquire_kernel import next_pow2
from bigmoe_pager.core.host_copier import HEADER_WORDS
from bigmoe_pager.core.prefetch_chain import GPU_MAX_SPINS
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def publish_admitted(
    mailbox: torch.Tensor, flags: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, target: torch.Tensor
) -> None:
    """Enqueue the publication of an admitted round (rows, slots: int64 [m], -1 padded; target: the table's int64
    goals) to `mailbox`, under the chained forward's number (flags: core.prefetch_chain's words)."""
    num_slots = (mailbox.numel() - HEADER_WORDS) // 3
    m = rows.numel()
    kernel_for(_publish_kernel, flags.device)[(1,)](
        mailbox, flags, rows, slots, target, m, S=num_slots, BLOCK_S=next_pow2(max(m, num_slots)), ON_GPU=flags.is_cuda
    )


def serve_pager(copier, pager, mailbox: torch.Tensor) -> None:
    """Have `copier` (core.host_copier.HostCopier) serve `mailbox`'s rounds into `pager`'s slots (an ExpertPager over a
    full RAM tier): its records, each component's place in a record and slot buffer, and its joinless `copied` words."""
    components = [(c.offset, c.nbytes, pager.buffers[c.name]) for c in pager.layout.components]
    copied = pager.vram.kernel_state()["copied"]
    copier.add_layer(mailbox, pager.ram.records, pager.layout.pitch, components, copied, pager.num_slots)


CPU_DRAIN_SPINS = 500
"""A drain's polls off the GPU (Triton's interpreter: about 1.5 ms each): the host thread's copies land within a poll
or two, and a thread held off a loaded CPU for a few milliseconds must not look late (a late drain holds its slots and
counts towards prefetch_chain.LATE_LIMIT)."""

PROGRESS_WORDS = ("copied", "target", "filled")
"""Each layer's table words a drain reads (core.round_sync), in the columns of `progress_words`."""


def progress_words(pagers: list, device: torch.device) -> torch.Tensor:
    """int64 [layers, 3]: the addresses of each pager's joinless PROGRESS_WORDS (what a drain reads, and `filled`,
    which it writes to hold a late copy's slot). Made outside any capture (a host copy)."""
    rows = [[p.vram.kernel_state()[w].data_ptr() for w in PROGRESS_WORDS] for p in pagers]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def drain_published(words: torch.Tensor, slots: int, flags: torch.Tensor, max_spins: int | None = None) -> None:
    """Enqueue a wait until no slot of the layers in `words` (progress_words, all with `slots` slots) is still being
    copied, slots already held for a late copy aside. Bounded: max_spins polls in all (about a second on a GPU); each
    layer with copies still under way when the wait gave up is counted in the chain's TIMEOUTS word, and their slots
    are held (round_sync.HELD), the drain counted once in LATE; held slots whose copies have landed are released."""
    on_gpu = words.is_cuda
    if max_spins is None:
        max_spins = GPU_MAX_SPINS if on_gpu else CPU_DRAIN_SPINS
    kernel_for(_drain_kernel, words.device)[(1,)](
        words, words.shape[0], flags, max_spins, S=slots, BLOCK_S=next_pow2(slots), ON_GPU=on_gpu
    )


if triton is not None:
    from bigmoe_pager.core.memory_order import SYS_SCOPE, store_release
    from bigmoe_pager.core.prefetch_chain import FORWARD, PUBLISHED, TIMEOUTS, count_late_drain, hold_while_late
    from bigmoe_pager.core.round_sync import HELD, copies_under_way, held_slots, wait_busy

    _HEADER = tl.constexpr(HEADER_WORDS)  # a mailbox's words before its lists (seq, count, a spare)
    _FORWARD, _TIMEOUTS, _PUBLISHED = tl.constexpr(FORWARD), tl.constexpr(TIMEOUTS), tl.constexpr(PUBLISHED)
    _HELD, _COLUMNS = tl.constexpr(HELD), tl.constexpr(len(PROGRESS_WORDS))

    @triton.jit
    def publish_round(
        box_ptr,
        flags_ptr,
        seq,
        rows_ptr,
        slot_ptr,
        target_ptr,
        m,
        S: tl.constexpr,
        BLOCK_S: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        """A decided round's list for the host copier (`publish_list`: record rows, slots and each slot's goal, read
        from the round's lists and the table's targets; the host reads the list only after it sees a new seq). A list
        with entries sets the chain's PUBLISHED word (flags_ptr: core.prefetch_chain's words), which the forward's
        drain reads after this kernel in stream order."""
        j = tl.arange(0, BLOCK_S)
        rows = tl.load(rows_ptr + j, mask=j < m, other=-1, volatile=True)
        slots = tl.load(slot_ptr + j, mask=j < m, other=-1, volatile=True)
        listed = (rows >= 0) & (slots >= 0)
        goals = tl.load(target_ptr + tl.where(listed, slots, 0), mask=listed, other=-1, volatile=True)
        if tl.sum(listed.to(tl.int32), 0) > 0:
            tl.store(flags_ptr + _PUBLISHED, 1)
        publish_list(box_ptr, seq, rows, slots, goals, listed, j, S, ON_GPU)

    @triton.jit
    def publish_list(box_ptr, seq, rows, slots, goals, listed, j, S: tl.constexpr, ON_GPU: tl.constexpr):
        """Hand a list held in registers (rows, slots, goals at positions j, where `listed`; the rest are holes) to
        the host copier through the mailbox at box_ptr of S slots: the lists, the count at word 1, then `seq` at word
        0 with a system-scope release (the caller has fenced what the entries name with a barrier). The count reaches
        the last listed entry, so a list with holes loses nothing (the host skips them)."""
        tl.store(box_ptr + _HEADER + j, tl.where(listed, rows, -1), mask=j < S)
        tl.store(box_ptr + _HEADER + S + j, tl.where(listed, slots, -1), mask=j < S)
        tl.store(box_ptr + _HEADER + 2 * S + j, tl.where(listed, goals, -1), mask=j < S)
        count = tl.max(tl.where(listed & (j < S), j + 1, 0), 0).to(tl.int64)
        tl.store(box_ptr + 1, count)
        tl.debug_barrier()  # every list word is written before the seq that hands them over
        store_release(box_ptr, seq, SYS_SCOPE, ON_GPU)

    @triton.jit
    def _publish_kernel(
        box_ptr,
        flags_ptr,
        rows_ptr,
        slot_ptr,
        target_ptr,
        m,
        S: tl.constexpr,
        BLOCK_S: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        # after the admit kernel on the same stream: its lists and targets are written
        forward = tl.load(flags_ptr + _FORWARD)
        publish_round(box_ptr, flags_ptr, forward, rows_ptr, slot_ptr, target_ptr, m, S, BLOCK_S, ON_GPU)

    @triton.jit
    def _drain_kernel(
        words_ptr,
        layers,
        flags_ptr,
        max_spins,
        S: tl.constexpr,
        BLOCK_S: tl.constexpr,
        ON_GPU: tl.constexpr,
    ):
        slots = tl.arange(0, BLOCK_S)
        if tl.load(flags_ptr + _PUBLISHED, volatile=True) != 0:  # (clear: nothing published since the last full drain)
            budget = max_spins  # for the whole drain: once a wait gives up, the later layers are only looked at
            outstanding = 0  # copies still under way once the drain is done: late or held
            newly_late = 0
            for layer in range(0, layers):
                row = words_ptr + layer * _COLUMNS
                copied_ptr = tl.load(row).to(tl.pointer_type(tl.int64))
                target_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int64))
                filled_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int64))
                held = held_slots(filled_ptr, slots, slots < S)
                busy = copies_under_way(copied_ptr, target_ptr, slots, slots < S, ON_GPU)
                late = wait_busy(copied_ptr, target_ptr, slots, busy & ~held, budget, ON_GPU)
                if tl.sum(late.to(tl.int32), 0) > 0:
                    tl.atomic_add(flags_ptr + _TIMEOUTS, 1)
                    budget = 0
                still = held & busy  # (one that lands during this drain is released by the next)
                tl.store(filled_ptr + slots, 0, mask=held & ~still)  # landed: the slot is the tables' again
                tl.store(filled_ptr + slots, _HELD, mask=late)
                outstanding += tl.sum((late | still).to(tl.int32), 0)
                newly_late += tl.sum(late.to(tl.int32), 0)
            if newly_late > 0:  # one a drain, however many layers (core.prefetch_chain: LATE_LIMIT)
                count_late_drain(flags_ptr)
            if outstanding == 0:  # every copy seen done: the next drain may skip until something is published again
                tl.store(flags_ptr + _PUBLISHED, 0)
            else:
                hold_while_late(flags_ptr)
