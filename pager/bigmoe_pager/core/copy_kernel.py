"""Copy expert records into slot tensors, from a work list held in device memory.

The work list (record index, destination slot; -1 = nothing) is read by the
kernel itself, so a CUDA graph that captured the launch copies whatever the
current step decided when it is replayed (a captured memcpy would repeat the
addresses it saw at capture). The records may sit in pinned host memory: the
GPU dereferences those pointers directly over PCIe (UVA), and many programs
each move a block of one component so enough reads are in flight to fill the
link.

On CPU tensors (the CPU build, where "VRAM" slots are host tensors) the same
copy runs as torch `index_copy_`; both give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build may run without Triton; the torch path needs none
    triton = tl = None

MAX_COMPONENTS = 4  # destination tensors one launch writes; larger layouts launch in groups
BLOCK_BYTES = 8192  # bytes per program and pass: small enough for thousands of programs in flight per expert


class CopyError(ValueError):
    """A copy was asked with buffers that do not match the layout."""


@dataclass(frozen=True)
class CopyPlan:
    """How a layout's components map to machine words for the copy."""

    word: torch.dtype
    """Largest integer type (8, 4, 2 or 1 bytes) dividing every offset, size and the pitch."""
    word_bytes: int
    """Its size in bytes."""
    offsets: tuple[int, ...]
    """Start of each component in the record, in words."""
    sizes: tuple[int, ...]
    """Length of each component, in words."""
    pitch_words: int
    """Record pitch in words."""


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@lru_cache(maxsize=None)
def copy_plan(layout: ExpertLayout) -> CopyPlan:
    numbers = [layout.pitch] + [c.offset for c in layout.components] + [c.nbytes for c in layout.components]
    size, word = next((b, w) for b, w in _WORDS if all(n % b == 0 for n in numbers))
    return CopyPlan(
        word=word,
        word_bytes=size,
        offsets=tuple(c.offset // size for c in layout.components),
        sizes=tuple(c.nbytes // size for c in layout.components),
        pitch_words=layout.pitch // size,
    )


def copy_records(
    records: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    layout: ExpertLayout,
    buffers: dict[str, torch.Tensor],
    block_bytes: int = BLOCK_BYTES,
    programs_per_record: int = 0,
    copied: torch.Tensor | None = None,
) -> None:
    """For each i with src[i] >= 0 and dst[i] >= 0: record src[i] -> slot dst[i] of every component buffer.

    records: uint8 [R, pitch] (pinned host memory when the buffers are on a GPU);
    src, dst: integer [M] on the buffers' device; buffers: layout.slot_buffers(...).
    programs_per_record: at most this many programs per work item, each looping over its share of
    the blocks (0: one program per block, the fastest copy, which fills every SM while it runs).
    A copy beside compute (prefetch on a side stream) takes few, leaving the SMs to the compute.
    copied: int64 [slots] that gets, per slot, the blocks written into it (record_blocks of them per record;
    each program adds its share once its stores are made: a joinless round's progress, core.round_sync).
    """
    check_copy_args(records, src, dst, layout, buffers)
    device = next(iter(buffers.values())).device
    if device.type == "cpu":
        copy_records_torch(records, src, dst, layout, buffers)
        if copied is not None:
            filled = dst[(src >= 0) & (dst >= 0)].long()
            copied.index_add_(0, filled, torch.full_like(filled, record_blocks(layout, block_bytes)))
    else:
        copy_records_triton(records, src, dst, layout, buffers, block_bytes, programs_per_record, copied)


def record_blocks(layout: ExpertLayout, block_bytes: int = BLOCK_BYTES) -> int:
    """Copy blocks of one record, over all its components (what `copied` gets per record copied)."""
    plan = copy_plan(layout)
    block = max(1, block_bytes // plan.word_bytes)
    return sum(-(-words // block) for words in plan.sizes)


def copy_records_torch(records, src, dst, layout: ExpertLayout, buffers: dict[str, torch.Tensor]) -> None:
    """The CPU path: index_copy_ of each component's bytes (data-dependent shapes are fine on CPU)."""
    valid = (src >= 0) & (dst >= 0)
    s, d = src[valid].long(), dst[valid].long()
    rows = records[s]
    for c in layout.components:
        flat = _flat_bytes(buffers[c.name])
        flat.index_copy_(0, d, rows[:, c.offset : c.offset + c.nbytes])


def copy_records_triton(
    records,
    src,
    dst,
    layout: ExpertLayout,
    buffers: dict[str, torch.Tensor],
    block_bytes: int = BLOCK_BYTES,
    programs_per_record: int = 0,
    copied: torch.Tensor | None = None,
) -> None:
    """The kernel path (GPU; on CPU tensors, Triton's interpreter runs the same kernel)."""
    if programs_per_record < 0:
        raise CopyError(f"programs_per_record must be >= 0, got {programs_per_record}")
    plan = copy_plan(layout)
    block = max(1, block_bytes // plan.word_bytes)
    for group in component_groups(layout, buffers, block):
        blocks = sum(group.nblocks)
        grid = (src.numel(), min(blocks, programs_per_record) if programs_per_record else blocks)
        kernel_for(_copy_kernel, src.device)[grid](
            record_words(records, plan),
            src,
            dst,
            plan.pitch_words,
            *group.outs,
            *group.offsets,
            *group.sizes,
            *group.nblocks,
            src if copied is None else copied,
            BLOCK=block,
            COUNT=copied is not None,
            num_warps=4,
        )


@dataclass(frozen=True)
class ComponentGroup:
    """Kernel operands for up to MAX_COMPONENTS components, padded with zero-block entries."""

    outs: tuple[torch.Tensor, ...]
    """Each component's slot buffer viewed as words [S, size]; padding repeats the first."""
    offsets: tuple[int, ...]
    """Start of each component in the record, in words (0 for padding)."""
    sizes: tuple[int, ...]
    """Words per component (0 for padding)."""
    nblocks: tuple[int, ...]
    """Blocks of `block` words per component (0 for padding: never touched)."""


def component_groups(layout: ExpertLayout, buffers: dict[str, torch.Tensor], block: int) -> list[ComponentGroup]:
    """The layout's components in launches of at most MAX_COMPONENTS, as copy-kernel operands."""
    plan = copy_plan(layout)
    comps = list(layout.components)
    groups = []
    for start in range(0, len(comps), MAX_COMPONENTS):
        idx = range(start, min(start + MAX_COMPONENTS, len(comps)))
        outs = [_flat_bytes(buffers[comps[i].name]).view(plan.word) for i in idx]
        offs = [plan.offsets[i] for i in idx]
        sizes = [plan.sizes[i] for i in idx]
        pad = MAX_COMPONENTS - len(outs)
        groups.append(
            ComponentGroup(
                tuple(outs + [outs[0]] * pad),
                tuple(offs + [0] * pad),
                tuple(sizes + [0] * pad),
                tuple([-(-n // block) for n in sizes] + [0] * pad),
            )
        )
    return groups


def record_words(records: torch.Tensor, plan: CopyPlan) -> torch.Tensor:
    """uint8 [R, pitch] records as [R, pitch_words] of the plan's word type (same memory)."""
    return records.view(torch.uint8).view(records.shape[0], -1).view(plan.word)


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    """[S, *shape] -> uint8 [S, nbytes] view of the same memory."""
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def check_copy_args(records, src, dst, layout: ExpertLayout, buffers) -> None:
    """Raise CopyError unless records, work list and slot buffers fit the layout."""
    _check_records(records, layout)
    if src.shape != dst.shape or src.dim() != 1:
        raise CopyError(f"src and dst must be 1-D of one length, got {tuple(src.shape)} and {tuple(dst.shape)}")
    check_slot_buffers(layout, buffers)


def check_records_and_buffers(records, layout: ExpertLayout, buffers) -> None:
    """Raise CopyError unless the records and the slot buffers fit the layout (no work list)."""
    _check_records(records, layout)
    check_slot_buffers(layout, buffers)


def _check_records(records, layout: ExpertLayout) -> None:
    if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != layout.pitch:
        raise CopyError(f"records must be uint8 [R, {layout.pitch}], got {records.dtype} {tuple(records.shape)}")


def check_slot_buffers(layout: ExpertLayout, buffers) -> None:
    """Raise CopyError unless every component has a contiguous [S, *shape] buffer, S the same for all."""
    slots = None
    for c in layout.components:
        buf = buffers.get(c.name)
        if buf is None or tuple(buf.shape[1:]) != c.shape or buf.dtype != c.dtype or not buf.is_contiguous():
            got = "missing" if buf is None else f"{buf.dtype} {tuple(buf.shape)}"
            raise CopyError(
                f"buffer {c.name} must be a contiguous [S, {', '.join(map(str, c.shape))}] {c.dtype}, got {got}"
            )
        if slots is not None and buf.shape[0] != slots:
            raise CopyError(f"buffer {c.name} has {buf.shape[0]} slots, others have {slots}")
        slots = buf.shape[0]


if triton is not None:
    from bigmoe_pager.core.round_sync import count_copied

    @triton.jit
    def _copy_kernel(
        rec_ptr,
        src_ptr,
        dst_ptr,
        pitch_words,
        out0,
        out1,
        out2,
        out3,
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
        copied_ptr,
        BLOCK: tl.constexpr,
        COUNT: tl.constexpr,
    ):
        # Program (m, p): work item m, blocks p, p + P, ... of the components laid end to end (P programs per
        # item; one pass when P is the block count).
        m = tl.program_id(0)
        s = tl.load(src_ptr + m).to(tl.int64)
        d = tl.load(dst_ptr + m).to(tl.int64)
        if (s >= 0) & (d >= 0):
            p = tl.program_id(1)
            stride = tl.num_programs(1)
            copy_record_blocks(
                rec_ptr + s * pitch_words,
                d,
                p,
                stride,
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
                BLOCK,
            )
            if COUNT:
                tl.debug_barrier()  # this program's stores are made before its count
                nblk = NB0 + NB1 + NB2 + NB3
                count_copied(copied_ptr, d, tl.maximum((nblk - p + stride - 1) // stride, 0))

    @triton.jit
    def copy_listed_share(
        pid,
        programs,
        count,
        j,
        rows,
        slots,
        rec_ptr,
        pitch_words,
        out0,
        out1,
        out2,
        out3,
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
        """Program `pid` of `programs`' share of copying list entries 0 .. count - 1 (record rows[i] -> slot
        slots[i]; j: the lists' positions): unit u = entry * NBLK + block, units pid, pid + programs, ... (the fused
        step's and the fused prefetch round's copy)."""
        for i in range(0, count):
            src = tl.sum(tl.where(j == i, rows, 0), 0)
            dst = tl.sum(tl.where(j == i, slots, 0), 0)
            first_b = ((pid - i * NBLK) % programs + programs) % programs
            copy_record_blocks(
                rec_ptr + src * pitch_words,
                dst,
                first_b,
                programs,
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
                BLOCK,
            )

    @triton.jit
    def copy_record_blocks(
        base,
        dst,
        first,
        stride,
        out0,
        out1,
        out2,
        out3,
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
        """Blocks first, first + stride, ... of one record (words at `base`; its components laid end to end) into
        slot `dst` of the component buffers. The records are read once (pinned host memory, over PCIe): their
        lines are evicted first. Written out per component: each has its own pointer."""
        lane = tl.arange(0, BLOCK)
        for b in range(first, NB0 + NB1 + NB2 + NB3, stride):
            if b < NB0:
                offs = b * BLOCK + lane
                mask = offs < N0
                w = tl.load(base + OFF0 + offs, mask=mask, eviction_policy="evict_first")
                tl.store(out0 + dst * N0 + offs, w, mask=mask)
            elif b < NB0 + NB1:
                offs = (b - NB0) * BLOCK + lane
                mask = offs < N1
                w = tl.load(base + OFF1 + offs, mask=mask, eviction_policy="evict_first")
                tl.store(out1 + dst * N1 + offs, w, mask=mask)
            elif b < NB0 + NB1 + NB2:
                offs = (b - NB0 - NB1) * BLOCK + lane
                mask = offs < N2
                w = tl.load(base + OFF2 + offs, mask=mask, eviction_policy="evict_first")
                tl.store(out2 + dst * N2 + offs, w, mask=mask)
            else:
                offs = (b - NB0 - NB1 - NB2) * BLOCK + lane
                mask = offs < N3
                w = tl.load(base + OFF3 + offs, mask=mask, eviction_policy="evict_first")
                tl.store(out3 + dst * N3 + offs, w, mask=mask)
