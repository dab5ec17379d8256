"""A grouped MoE for decode-sized batches, reading expert weights wherever they lie.

The paging benchmark runs this one MoE for every configuration: experts in VRAM
slots (bigmoe), in full VRAM tensors (resident), or in pinned host records read
over PCIe inside the kernel (static offload, as vLLM's --cpu-offload-gb does).
Weights are FP8 with 128x128 block scales (dequantized on the fly, fp32
accumulation) or bf16. Three kernels: gate/up + SiLU per (token, k) pair, down
projection per pair, then a per-token combine in k order (the same order as
`moe_ref.combine`).

Experts are addressed as [N, *shape] tensors whose expert dimension may be
strided (a record row holds every component), each expert's slice contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

UP_ROWS = 16  # intermediate rows per up-projection program: many programs keep enough loads in flight
DOWN_ROWS = 16  # hidden rows per down-projection program
COMBINE_COLS = 512


class MoeShapeError(ValueError):
    """Expert tensors that the decode MoE cannot use."""


@dataclass(frozen=True)
class ExpertWeights:
    """Where one layer's experts lie: [N, *shape] views, expert dimension possibly strided."""

    w13: torch.Tensor
    """[N, 2I, H]: gate rows then up rows."""
    w2: torch.Tensor
    """[N, H, I]."""
    w13_scale: torch.Tensor | None
    """[N, ceil(2I/b), ceil(H/b)] fp32 block scales, None for bf16 weights."""
    w2_scale: torch.Tensor | None
    """[N, ceil(H/b), ceil(I/b)] fp32 block scales, None for bf16 weights."""
    block: int | None
    """Scale block edge (128 for the Qwen FP8 checkpoints)."""

    @classmethod
    def from_slots(cls, buffers: dict[str, torch.Tensor], block: int | None) -> "ExpertWeights":
        return cls(
            buffers["w13_weight"],
            buffers["w2_weight"],
            buffers.get("w13_weight_scale_inv"),
            buffers.get("w2_weight_scale_inv"),
            block,
        )

    @classmethod
    def from_records(cls, records: torch.Tensor, layout: ExpertLayout, block: int | None) -> "ExpertWeights":
        """Views into uint8 [N, pitch] records (e.g. pinned host memory: the kernel reads it over PCIe)."""
        views = {}
        for c in layout.components:
            raw = records[:, c.offset : c.offset + c.nbytes]
            views[c.name] = raw.view(c.dtype).view(records.shape[0], *c.shape)
        return cls.from_slots(views, block)


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """fp32 [T, H]: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); ids are rows of `experts`, -1 = none."""
    return moe_combine(moe_pairs(x, ids, experts), weights)


def moe_pairs(x: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """fp32 [T, K, H]: each (token, k) pair's expert output, zeros where ids == -1.

    A pair's output depends only on x[t] and its expert's bytes, so streamed
    chunks merged by selection reproduce it exactly (see pager.Chunk.merge).
    """
    t, k = ids.shape
    n2i, h = experts.w13.shape[1:]
    inter = n2i // 2
    _check(x, experts, h, inter)
    device = x.device
    scaled = experts.block is not None
    sb = experts.block or 0
    bk = min(128, sb) if scaled else 128
    dummy = experts.w13
    s13 = experts.w13_scale if scaled else dummy
    s2 = experts.w2_scale if scaled else dummy
    ids = ids.contiguous()
    pairs = t * k
    hbuf = torch.empty((pairs, inter), dtype=torch.float32, device=device)
    ybuf = torch.empty((t, k, h), dtype=torch.float32, device=device)
    kernel_for(_up_kernel, device)[(pairs, -(-inter // UP_ROWS))](
        x.contiguous(),
        ids,
        experts.w13,
        s13,
        hbuf,
        experts.w13.stride(0),
        s13.stride(0) if scaled else 0,
        K=k,
        H=h,
        I=inter,
        SB=sb,
        SC=-(-h // sb) if scaled else 1,
        BN=UP_ROWS,
        BK=bk,
        num_warps=4,
    )
    kernel_for(_down_kernel, device)[(pairs, -(-h // DOWN_ROWS))](
        hbuf,
        ids,
        experts.w2,
        s2,
        ybuf,
        experts.w2.stride(0),
        s2.stride(0) if scaled else 0,
        H=h,
        I=inter,
        SB=sb,
        SC=-(-inter // sb) if scaled else 1,
        BN=DOWN_ROWS,
        BK=bk,
        num_warps=4,
    )
    return ybuf


def moe_combine(pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H]: sum over k in order 0..K-1 of weights[t, k] * pairs[t, k]."""
    t, k, h = pairs.shape
    out = torch.empty((t, h), dtype=torch.float32, device=pairs.device)
    kernel_for(_combine_kernel, pairs.device)[(t, -(-h // COMBINE_COLS))](
        pairs.contiguous(),
        weights.contiguous(),
        out,
        K=k,
        H=h,
        BH=COMBINE_COLS,
        num_warps=4,
    )
    return out


def _check(x: torch.Tensor, e: ExpertWeights, h: int, inter: int) -> None:
    if x.dim() != 2 or x.shape[1] != h:
        raise MoeShapeError(f"x must be [T, {h}], got {tuple(x.shape)}")
    if tuple(e.w2.shape[1:]) != (h, inter):
        raise MoeShapeError(f"w2 must be [N, {h}, {inter}] to match w13, got {tuple(e.w2.shape)}")
    for w in (e.w13, e.w2):
        if w[0].stride(-1) != 1 or not w[0].is_contiguous():
            raise MoeShapeError("each expert's weight slice must be contiguous")
    if e.block is not None and (e.w13_scale is None or e.w2_scale is None):
        raise MoeShapeError("FP8 experts need both block-scale tensors")
    if e.block is not None and e.block % min(128, e.block):
        raise MoeShapeError(f"scale block {e.block} must be a multiple of the kernel's K step")


if triton is not None:

    @triton.jit
    def _up_kernel(
        x_ptr,
        ids_ptr,
        w_ptr,
        s_ptr,
        h_ptr,
        w_stride,
        s_stride,
        K: tl.constexpr,
        H: tl.constexpr,
        I: tl.constexpr,
        SB: tl.constexpr,
        SC: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        p = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        slot = tl.load(ids_ptr + p).to(tl.int64)
        valid = slot >= 0
        safe = tl.where(valid, slot, 0)
        rmask = (rows < I) & valid
        w_base = w_ptr + safe * w_stride
        x_base = x_ptr + (p // K) * H
        acc_g = tl.zeros([BN], dtype=tl.float32)
        acc_u = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            cols = k0 + tl.arange(0, BK)
            cmask = cols < H
            xv = tl.load(x_base + cols, mask=cmask, other=0.0).to(tl.float32)
            m2 = rmask[:, None] & cmask[None, :]
            wg = tl.load(w_base + rows[:, None] * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(w_base + (rows[:, None] + I) * H + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            pg = tl.sum(wg * xv[None, :], axis=1)
            pu = tl.sum(wu * xv[None, :], axis=1)
            if SB > 0:
                s_base = s_ptr + safe * s_stride + k0 // SB
                pg = pg * tl.load(s_base + (rows // SB) * SC, mask=rmask, other=0.0)
                pu = pu * tl.load(s_base + ((rows + I) // SB) * SC, mask=rmask, other=0.0)
            acc_g += pg
            acc_u += pu
        hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + p * I + rows, hv, mask=rows < I)

    @triton.jit
    def _down_kernel(
        h_ptr,
        ids_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        w_stride,
        s_stride,
        H: tl.constexpr,
        I: tl.constexpr,
        SB: tl.constexpr,
        SC: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        p = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        slot = tl.load(ids_ptr + p).to(tl.int64)
        valid = slot >= 0
        safe = tl.where(valid, slot, 0)
        rmask = (rows < H) & valid
        w_base = w_ptr + safe * w_stride
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            cols = k0 + tl.arange(0, BK)
            cmask = cols < I
            hv = tl.load(h_ptr + p * I + cols, mask=cmask, other=0.0)
            w = tl.load(w_base + rows[:, None] * I + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(
                tl.float32
            )
            part = tl.sum(w * hv[None, :], axis=1)
            if SB > 0:
                part = part * tl.load(s_ptr + safe * s_stride + (rows // SB) * SC + k0 // SB, mask=rmask, other=0.0)
            acc += part
        tl.store(y_ptr + p * H + rows, acc, mask=rows < H)

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, out_ptr, K: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        cmask = cols < H
        acc = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            acc = acc + wj * tl.load(y_ptr + (t * K + j) * H + cols, mask=cmask, other=0.0)
        tl.store(out_ptr + t * H + cols, acc, mask=cmask)
