"""A replayed trace's proposal rows (prediction.replayed_predictions) gathered in one Triton launch.

The torch formulation reads the cursor, then builds the row indices, wraps them, gathers and widens
to int64: six or seven tiny kernels per layer, on the prefetch side stream of every MoE layer inside
vLLM's CUDA graph. This kernel reads the device cursor itself and writes the int64 proposal, so a
captured graph's replays read the cursor's new value and launch one kernel a layer. No host reads,
fixed output shape: capturable.
"""

from __future__ import annotations

import torch
from bigmoe_pager.core.triton_launch import kernel_for

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

BLOCK = 1024  # output ids per program: one program for any decode step (tokens * P <= 1024)


def launch_replayed_rows(
    predicted: torch.Tensor, cursor: torch.Tensor, index: int, offset: int, layer: int, tokens: int
) -> torch.Tensor:
    """int64 [tokens * P]: rows cursor[index] + offset .. + tokens - 1 (mod the trace's length) of predicted[:, layer].

    predicted: int32 or int64 [trace tokens, layers, P] on the launch's device; cursor: int64 [n] on it, read
    on the device; index: which cursor; offset: rows from the cursor to the first row (ReplayedPredictions.rows
    passes -tokens: the cursor has already advanced past the rows); layer: the column, taken mod the trace's layers.
    """
    length, layers, width = predicted.shape
    n = tokens * width
    out = torch.empty(n, dtype=torch.int64, device=predicted.device)
    if n == 0:
        return out
    kernel_for(_replayed_rows_kernel, predicted.device)[(triton.cdiv(n, BLOCK),)](
        predicted,
        cursor,
        out,
        index,
        offset,
        n,
        length,
        predicted.stride(0),
        (layer % layers) * predicted.stride(1),
        predicted.stride(2),
        P=width,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _replayed_rows_kernel(
        pred_ptr,
        cursor_ptr,
        out_ptr,
        index,
        offset,
        n,
        length,
        row_stride,
        column_offset,
        p_stride,
        P: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        start = tl.load(cursor_ptr + index).to(tl.int64) + offset
        row = (start + offs // P) % length
        row = tl.where(row < 0, row + length, row)  # a remainder may take the dividend's sign; torch's does not
        at = row * row_stride + column_offset + (offs % P) * p_stride
        ids = tl.load(pred_ptr + at, mask=inside, other=-1)
        tl.store(out_ptr + offs, ids.to(tl.int64), mask=inside)
