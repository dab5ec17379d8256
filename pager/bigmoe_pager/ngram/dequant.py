"""Stored n-gram rows (bytes) to activations, on whatever device the bytes are on.

The checkpoint stores FP8 E4M3 rows with one FP32 scale for the whole table
(BF16 tables have none). The arithmetic is the one vLLM's Qwen4Exp FP8 PLE
method does after its own lookup: cast to the activation dtype, then multiply by
the scale cast to the activation dtype, so paged and resident rows give the
same bits.
"""

from __future__ import annotations

import torch

STORED = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}
"""Torch dtype of each safetensors dtype a table may be stored in."""


def as_stored(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """View uint8 rows [..., row_bytes] as the stored element type [..., row_elems] (no copy)."""
    if dtype not in STORED:
        raise ValueError(f"n-gram rows stored as {dtype} cannot be dequantized; known: {sorted(STORED)}")
    if rows.dtype != torch.uint8:
        raise ValueError(f"n-gram rows must be uint8 bytes, got {rows.dtype}")
    return rows.view(STORED[dtype])


def dequantize_rows(
    rows: torch.Tensor, dtype: str, scale: float | torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Activations [..., row_elems] in out_dtype from uint8 rows [..., row_bytes] on the same device."""
    values = as_stored(rows, dtype).to(out_dtype)
    if scale is None:
        return values
    scale = torch.as_tensor(scale, dtype=torch.float32, device=rows.device)
    return values * scale.to(out_dtype)
