"""A plain reference MoE over slot buffers: SiLU-gated experts, fp32 accumulation.

It computes one output per (token, k) pair from that pair's slot alone, then
combines the pairs of a token in k order with the routing weights. A pair's
output depends only on its token's input and its expert's bytes, never on the
other pairs of the batch, which is what makes streamed (chunked) steps exact.
Used by the tests and as the CPU path of the paging benchmark.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, block: int | None) -> torch.Tensor:
    """fp32 copy of `weight` [..., R, C]; FP8 block scales `scale` [..., ceil(R/b), ceil(C/b)]
    applied per b x b block."""
    w = weight.float()
    if scale is None:
        return w
    rows, cols = w.shape[-2], w.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return w * s[..., :rows, :cols]


def pair_outputs(
    x: torch.Tensor, slots: torch.Tensor, buffers: dict[str, torch.Tensor], block: int | None
) -> torch.Tensor:
    """fp32 [T, K, H]: expert output of each (token, k) pair; zeros where slots == -1.

    x: [T, H]; slots: [T, K] VRAM slot ids; buffers: w13_weight [S, 2I, H], w2_weight [S, H, I]
    (+ *_scale_inv when block is given).
    """
    t, k = slots.shape
    flat = slots.reshape(-1).long()
    safe = flat.clamp(min=0)
    w13 = dequantize(buffers["w13_weight"][safe], _scale(buffers, "w13", safe, block), block)
    w2 = dequantize(buffers["w2_weight"][safe], _scale(buffers, "w2", safe, block), block)
    xs = x.float().repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*K, H, 1]
    gate_up = torch.bmm(w13, xs).squeeze(-1)  # [T*K, 2I]
    inter = w13.shape[1] // 2
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch.bmm(w2, h.unsqueeze(-1)).squeeze(-1)  # [T*K, H]
    y = torch.where((flat >= 0).unsqueeze(-1), y, torch.zeros((), dtype=y.dtype))
    return y.reshape(t, k, -1)


def combine(pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H]: sum over k in order 0..K-1 of weights[t, k] * pairs[t, k]."""
    out = torch.zeros_like(pairs[:, 0])
    for j in range(pairs.shape[1]):
        out = out + weights[:, j : j + 1].float() * pairs[:, j]
    return out


def moe(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, buffers: dict[str, torch.Tensor], block: int | None
) -> torch.Tensor:
    """The whole layer: pair outputs then combine."""
    return combine(pair_outputs(x, slots, buffers, block), weights)


def _scale(buffers: dict[str, torch.Tensor], which: str, idx: torch.Tensor, block: int | None) -> torch.Tensor | None:
    if block is None:
        return None
    return buffers[f"{which}_weight_scale_inv"][idx]
