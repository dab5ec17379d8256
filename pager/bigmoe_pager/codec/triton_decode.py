"""The GPU decoder: compressed records in a VRAM staging buffer -> expert slots.

The pager copies compressed records into `staging` (a uint8 CUDA tensor), writes
a work list `work` (int64 [M, 2]: byte offset of a record in staging, destination
slot; slot -1 = nothing to do) and calls `decode_into_slots`. The kernel reads
the work list from device memory, so a CUDA graph that captured the call decodes
whatever the current step wrote there when it is replayed.

One launch covers up to four layout components (all of a MoE layout). Program
(m, g) works on record m; its group g picks a component and a range of it. In a
coded component a program decodes CHUNKS chunks: LANES lanes per chunk each hold
a 64-bit bit buffer, refill 32 bits when fewer than 32 remain, then decode 4
exponents through the chunk's 256-entry LUT (codes are <= 8 bits, so 4 always
fit) and join them with the sign/mantissa nibbles; the lanes of a chunk write
one contiguous 64-byte run per step. Raw components (block scales, or FP8 that
would not shrink) are copied.

Checks on the device (no host sync): header magic, version, layout crc, sizes
and every section bound are checked before any byte is read from a record, and
each lane must consume exactly the bits its chunk header gives it. A failed
check adds to `errors[m]` (int32 [M]); the slot of such a record holds garbage
and must not be used. The crc32 of a record is checked on the host when it
enters RAM (reference.verify_record, or the paging file's own crc).

On CPU tensors the same kernel runs under Triton's interpreter (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.triton_launch import kernel_for

from . import format as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build may run without Triton; decode_record is the CPU path
    triton = tl = None

CHUNKS_PER_PROGRAM = 8  # chunks (x LANES lanes) one program decodes
NUM_WARPS = 4
PREFETCH = True  # load stream words and nibbles a step ahead (see the kernel)
RAW_STEP = 256  # bytes per iteration of a raw copy (wider costs registers the decode loop would then lack)
MAX_COMPONENTS = 4  # components one launch covers; larger layouts launch in groups

_MAGIC_U32 = int.from_bytes(F.MAGIC, "little")


class DecodeError(ValueError):
    """decode_into_slots was called with tensors that do not fit the layout; the message is one line."""


@dataclass(frozen=True)
class ComponentPlan:
    """How one layout component is expanded."""

    name: str
    """Slot buffer name."""
    dir_offset: int
    """Byte offset of its directory entry in every record."""
    nbytes: int
    """Bytes of one expert's slice."""
    coded: bool
    """FP8: exponent-coded unless the record stores it raw (else always copied raw)."""


@dataclass(frozen=True)
class DecodePlan:
    """What the kernels need to know about a layout's records."""

    components: tuple[ComponentPlan, ...]
    """In layout order."""
    layout_crc: int
    """Expected header field."""
    header_word1: int
    """Expected version | components << 16."""
    raw_bytes: int
    """layout.record_bytes."""
    max_record: int
    """max_record_bytes(layout): no valid record is longer."""


@lru_cache(maxsize=None)
def decode_plan(layout: ExpertLayout) -> DecodePlan:
    comps = tuple(
        ComponentPlan(c.name, F.directory_offset(i), c.nbytes, F.is_coded(c)) for i, c in enumerate(layout.components)
    )
    return DecodePlan(
        comps, F.layout_crc(layout), F.CODEC_VERSION | len(comps) << 16, layout.record_bytes, F.max_record_bytes(layout)
    )


def new_errors(work: torch.Tensor) -> torch.Tensor:
    """A zeroed error counter per work item (int32 [M]) on the work list's device."""
    return torch.zeros(work.shape[0], dtype=torch.int32, device=work.device)


def decode_into_slots(
    staging: torch.Tensor,
    work: torch.Tensor,
    slot_buffers: dict[str, torch.Tensor],
    layout: ExpertLayout,
    errors: torch.Tensor,
    *,
    chunks_per_program: int = CHUNKS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    prefetch: bool = PREFETCH,
    geometry: F.Geometry = F.STANDARD,
) -> None:
    """For each m with work[m, 1] >= 0: decode the record at staging[work[m, 0]:] into slot work[m, 1].

    staging: uint8 [B]; work: int64 [M, 2] (offsets multiples of STAGING_ALIGN);
    slot_buffers: layout.slot_buffers(...) on the same device; errors: int32 [M],
    incremented for every record that fails a check (its slot is then garbage).
    Asynchronous on CUDA; capturable in a CUDA graph. prefetch: load each lane's next stream word and
    nibbles a step ahead (same output; a kernel-shape choice like chunks_per_program and num_warps).
    geometry: the records' chunk geometry (the kernel is built for one; a record of another fails its checks).
    """
    _check(staging, work, slot_buffers, layout, errors)
    plan = decode_plan(layout)
    launch = kernel_for(_expand_kernel, staging.device)
    span = chunks_per_program * geometry.chunk_symbols  # bytes of a component one program covers
    comps = list(plan.components)
    for start in range(0, len(comps), MAX_COMPONENTS):
        group = comps[start : start + MAX_COMPONENTS]
        dsts = [_flat_bytes(slot_buffers[c.name]) for c in group]
        groups = [-(-c.nbytes // span) for c in group]
        firsts = [sum(groups[:i]) for i in range(1, MAX_COMPONENTS)]  # first program group of components 1..3
        coded = [c.coded for c in group]
        aligned = [c.nbytes % 4 == 0 and d.data_ptr() % 4 == 0 for c, d in zip(group, dsts)]  # whole u32 stores
        while len(dsts) < MAX_COMPONENTS:  # unused places: no program group reaches them
            dsts.append(dsts[0])
            group.append(group[0])
            coded.append(False)
            aligned.append(False)
        launch[(work.shape[0], sum(groups))](
            staging,
            staging.numel(),
            work,
            errors,
            *dsts,
            *(c.dir_offset for c in group),
            *(c.nbytes for c in group),
            *firsts,
            plan.max_record,
            plan.layout_crc,
            plan.header_word1,
            plan.raw_bytes,
            *coded,
            *aligned,
            BLOCK=chunks_per_program,
            LANES=geometry.lanes,
            STEPS=geometry.lane_steps,
            CHUNK=geometry.chunk_symbols,
            HDR=geometry.chunk_header_bytes,
            MAX_TABLES=F.MAX_TABLES,
            PAD_WORDS=F.STREAM_PAD_WORDS,
            MAGIC=_MAGIC_U32,
            GEOMETRY=geometry.word,
            ALIGN=F.STAGING_ALIGN,
            RAW_STEP=RAW_STEP,
            PREFETCH=prefetch,
            num_warps=num_warps,
        )


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    """[S, *shape] -> uint8 [S, nbytes] view of the same memory."""
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def _check(staging, work, slot_buffers, layout: ExpertLayout, errors) -> None:
    if staging.dtype != torch.uint8 or staging.dim() != 1:
        raise DecodeError(f"staging must be a 1-D uint8 tensor, got {staging.dtype} {tuple(staging.shape)}")
    if work.dtype != torch.int64 or work.dim() != 2 or work.shape[1] != 2 or not work.is_contiguous():
        raise DecodeError(
            f"work must be a contiguous int64 [M, 2] tensor (offset, slot), got {work.dtype} {tuple(work.shape)}"
        )
    if errors.dtype != torch.int32 or tuple(errors.shape) != (work.shape[0],):
        raise DecodeError(f"errors must be int32 [{work.shape[0]}], got {errors.dtype} {tuple(errors.shape)}")
    for t, what in ((work, "work"), (errors, "errors")):
        if t.device != staging.device:
            raise DecodeError(f"{what} is on {t.device} but staging is on {staging.device}")
    for c in layout.components:
        buf = slot_buffers.get(c.name)
        if buf is None or tuple(buf.shape[1:]) != c.shape or buf.dtype != c.dtype or not buf.is_contiguous():
            got = "missing" if buf is None else f"{buf.dtype} {tuple(buf.shape)}"
            raise DecodeError(
                f"slot buffer {c.name} must be a contiguous [S, {', '.join(map(str, c.shape))}] {c.dtype}, got {got}"
            )
        if buf.device != staging.device:
            raise DecodeError(f"slot buffer {c.name} is on {buf.device} but staging is on {staging.device}")


if triton is not None:

    @triton.jit
    def _expand_kernel(
        staging,
        staging_bytes,
        work,
        errors,
        dst0,
        dst1,
        dst2,
        dst3,
        dir0,
        dir1,
        dir2,
        dir3,
        n0,
        n1,
        n2,
        n3,
        g1,
        g2,
        g3,
        max_record,
        layout_crc,
        header_word1,
        raw_bytes,
        CODED0: tl.constexpr,
        CODED1: tl.constexpr,
        CODED2: tl.constexpr,
        CODED3: tl.constexpr,
        ALIGNED0: tl.constexpr,
        ALIGNED1: tl.constexpr,
        ALIGNED2: tl.constexpr,
        ALIGNED3: tl.constexpr,
        BLOCK: tl.constexpr,
        LANES: tl.constexpr,
        STEPS: tl.constexpr,
        CHUNK: tl.constexpr,
        HDR: tl.constexpr,
        MAX_TABLES: tl.constexpr,
        PAD_WORDS: tl.constexpr,
        MAGIC: tl.constexpr,
        GEOMETRY: tl.constexpr,
        ALIGN: tl.constexpr,
        RAW_STEP: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        # Program (m, g): record m; group g is part of component 0 below g1, 1 below g2, 2 below g3, else 3.
        # Written as one body: the interpreter cannot call nested jit helpers.
        m = tl.program_id(0)
        g = tl.program_id(1)
        in1, in2, in3 = g >= g1, g >= g2, g >= g3
        dst = tl.where(in3, dst3, tl.where(in2, dst2, tl.where(in1, dst1, dst0)))
        dir_off = tl.where(in3, dir3, tl.where(in2, dir2, tl.where(in1, dir1, dir0)))
        n_bytes = tl.where(in3, n3, tl.where(in2, n2, tl.where(in1, n1, n0)))
        gl = g - tl.where(in3, g3, tl.where(in2, g2, tl.where(in1, g1, 0)))  # group within the component
        coded = tl.where(in3, CODED3, tl.where(in2, CODED2, tl.where(in1, CODED1, CODED0)))
        aligned = tl.where(in3, ALIGNED3, tl.where(in2, ALIGNED2, tl.where(in1, ALIGNED1, ALIGNED0)))
        n_chunks = (n_bytes + CHUNK - 1) // CHUNK
        rec = tl.load(work + 2 * m)
        slot = tl.load(work + 2 * m + 1)
        if slot >= 0:
            u32 = tl.pointer_type(tl.uint32)
            # Header: 8 u32 words; nothing else is read unless all of it checks out.
            ok = (rec >= 0) & (rec % ALIGN == 0) & (rec + 32 <= staging_bytes)
            base = staging + rec
            hdr = base.to(u32)
            magic = tl.load(hdr, mask=ok, other=0).to(tl.int64)
            word1 = tl.load(hdr + 1, mask=ok, other=0).to(tl.int64)
            lcrc = tl.load(hdr + 2, mask=ok, other=0).to(tl.int64)
            raw = tl.load(hdr + 3, mask=ok, other=0).to(tl.int64)
            total = tl.load(hdr + 4, mask=ok, other=0).to(tl.int64)
            geometry = tl.load(hdr + 6, mask=ok, other=0).to(tl.int64)
            ok = ok & (magic == MAGIC) & (word1 == header_word1) & (lcrc == layout_crc) & (raw == raw_bytes)
            ok = ok & (geometry == GEOMETRY) & (total <= max_record) & (rec + total <= staging_bytes)
            # Directory entry: kind | tables << 8, then five u32 offsets / counts.
            ent = (base + dir_off).to(u32)
            kind_tables = tl.load(ent, mask=ok, other=0).to(tl.int64)
            first = tl.load(ent + 1, mask=ok, other=0).to(tl.int64)
            luts = tl.load(ent + 2, mask=ok, other=0).to(tl.int64)
            nibs = tl.load(ent + 3, mask=ok, other=0).to(tl.int64)
            strm = tl.load(ent + 4, mask=ok, other=0).to(tl.int64)
            words = tl.load(ent + 5, mask=ok, other=0).to(tl.int64)
            tables = (kind_tables >> 8) & 0xFF
            kind = kind_tables & 0xFF
            raw_ok = (kind == 0) & (first + n_bytes <= total)
            nib_bytes = ((n_bytes + 1) // 2 + 7) // 8 * 8
            coded_ok = coded & (kind == 1) & (tables >= 1) & (tables <= MAX_TABLES)
            coded_ok = coded_ok & (first % 4 == 0) & (first + n_chunks * HDR <= total)
            coded_ok = coded_ok & (luts + tables * 256 <= total) & (nibs % 2 == 0) & (nibs + nib_bytes <= total)
            coded_ok = coded_ok & (strm % 4 == 0) & (strm + 4 * (words + PAD_WORDS) <= total) & (words < (1 << 26))
            ok = ok & (raw_ok | coded_ok)
            bad = tl.where(ok, 0, 1)
            out = dst + slot * n_bytes
            if ok:
                if kind == 0:
                    # Raw bytes (block scales, or FP8 that coding would not shrink): copy this program's span.
                    for i in range(BLOCK * CHUNK // RAW_STEP):
                        offs = gl * (BLOCK * CHUNK) + i * RAW_STEP + tl.arange(0, RAW_STEP)
                        mask = offs < n_bytes
                        tl.store(out + offs, tl.load(base + first + offs, mask=mask, other=0), mask=mask)
                else:
                    # Chunk headers: word offset u32, table u8, flags u8, base bits u16, LANES u8 deltas.
                    c = gl * BLOCK + tl.arange(0, BLOCK)
                    live = c < n_chunks
                    hp = base + first + c * HDR
                    word_off = tl.load(hp.to(u32), mask=live, other=0).to(tl.int64)
                    table = tl.load(hp + 4, mask=live, other=0).to(tl.int32)
                    lane_base = tl.load((hp + 6).to(tl.pointer_type(tl.uint16)), mask=live, other=0).to(tl.int32)
                    lane = tl.arange(0, LANES)
                    delta = tl.load(hp[:, None] + 8 + lane[None, :], mask=live[:, None], other=0).to(tl.int32)
                    lens = lane_base[:, None] + delta
                    sane = live & (word_off <= words) & (table < tables)
                    bit = tl.where(sane, word_off, 0).to(tl.int32)[:, None] * 32 + tl.cumsum(lens, axis=1) - lens
                    good = sane[:, None] & (bit + lens <= (words * 32).to(tl.int32))
                    bad += tl.sum((live[:, None] & ~good).to(tl.int32))
                    # A lane's state: a 64-bit buffer whose top `have` bits are the next stream bits.
                    sp = (base + strm).to(u32)
                    wi = bit >> 5
                    skip = bit & 31
                    w0 = tl.load(sp + wi, mask=good, other=0).to(tl.uint64)
                    w1 = tl.load(sp + wi + 1, mask=good, other=0).to(tl.uint64)
                    buf = ((w0 << 32) | w1) << skip.to(tl.uint64)
                    have = 64 - skip
                    nxt = wi + 2
                    limit = (words + PAD_WORDS).to(tl.int32)
                    # Every lane's LUT lies inside the record (bad tables fall back to table 0): no mask needed.
                    lut = base + luts + tl.where(sane, table, 0)[:, None] * 256
                    nib16 = (base + nibs).to(tl.pointer_type(tl.uint16))
                    out32 = out.to(u32)
                    pos = c[:, None] * CHUNK + lane[None, :] * 4
                    # PREFETCH: the lane's next stream word and the next step's nibbles are loaded a step
                    # ahead, so a step waits on its four LUT loads only, not on an L2 round trip (~300+ cycles).
                    nw = tl.load(sp + nxt, mask=good & (nxt < limit), other=0)
                    nbn = tl.load(nib16 + (pos >> 2), mask=good & (pos < n_bytes), other=0)
                    for k in range(STEPS):
                        need = have < 32
                        if PREFETCH:
                            wv = tl.where(need, nw, 0).to(tl.uint64)
                        else:
                            wv = tl.load(sp + nxt, mask=need & good & (nxt < limit), other=0).to(tl.uint64)
                        buf = buf | (wv << tl.where(need, 32 - have, 0).to(tl.uint64))
                        have = tl.where(need, have + 32, have)
                        nxt = tl.where(need, nxt + 1, nxt)
                        if PREFETCH:
                            # Lanes that took a word load the one after it; the others keep theirs.
                            nw = tl.load(sp + nxt, mask=need & good & (nxt < limit), other=nw)
                        e0 = tl.load(lut + (buf >> 56).to(tl.int32)).to(tl.int32)
                        buf = buf << (e0 >> 4).to(tl.uint64)
                        e1 = tl.load(lut + (buf >> 56).to(tl.int32)).to(tl.int32)
                        buf = buf << (e1 >> 4).to(tl.uint64)
                        e2 = tl.load(lut + (buf >> 56).to(tl.int32)).to(tl.int32)
                        buf = buf << (e2 >> 4).to(tl.uint64)
                        e3 = tl.load(lut + (buf >> 56).to(tl.int32)).to(tl.int32)
                        buf = buf << (e3 >> 4).to(tl.uint64)
                        have = have - ((e0 >> 4) + (e1 >> 4) + (e2 >> 4) + (e3 >> 4))
                        p = pos + k * (LANES * 4)
                        wm = good & (p < n_bytes)
                        # Nibbles (sign << 3 | mantissa) of bytes p..p+3, byte p lowest, spread one per byte.
                        if PREFETCH:
                            nb = nbn.to(tl.uint32)
                            pn = p + LANES * 4
                            nbn = tl.load(nib16 + (pn >> 2), mask=good & (pn < n_bytes) & (k + 1 < STEPS), other=0)
                        else:
                            nb = tl.load(nib16 + (p >> 2), mask=wm, other=0).to(tl.uint32)
                        nb = (nb & 0xFF) | ((nb >> 8) << 16)
                        nb = (nb | (nb << 4)) & 0x0F0F0F0F
                        exps = (e0 & 15) | ((e1 & 15) << 8) | ((e2 & 15) << 16) | ((e3 & 15) << 24)
                        word = ((nb & 0x08080808) << 4) | (nb & 0x07070707) | (exps.to(tl.uint32) << 3)
                        if aligned:
                            tl.store(out32 + (p >> 2), word, mask=wm)
                        else:
                            tl.store(out + p, word.to(tl.uint8), mask=wm)
                            tl.store(out + p + 1, (word >> 8).to(tl.uint8), mask=good & (p + 1 < n_bytes))
                            tl.store(out + p + 2, (word >> 16).to(tl.uint8), mask=good & (p + 2 < n_bytes))
                            tl.store(out + p + 3, (word >> 24).to(tl.uint8), mask=good & (p + 3 < n_bytes))
                    consumed = (nxt - wi) * 32 - skip - have
                    bad += tl.sum((good & (consumed != lens)).to(tl.int32))
            tl.atomic_add(errors + m, bad, mask=bad > 0)
