"""FP8 E4M3 block quantization in the layout of Qwen's official FP8 checkpoints.

A Linear weight [out, in] is cut into 128x128 blocks; each block is stored as
`float8_e4m3fn` values plus one scale in `weight_scale_inv` [out/128, in/128], with
`weight ~= fp8 * scale` per block. The scale maps the block's largest magnitude to
448, the largest finite E4M3 value.
"""

from __future__ import annotations

import torch

BLOCK = 128
"""Side of one square quantization block (elements)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude."""
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Storage dtypes of `weight_scale_inv` seen in official checkpoints, by name."""


class BlockShapeError(ValueError):
    """A weight cannot be cut into whole 128x128 blocks; the message is one line."""


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the block-scale grid of a [rows, cols] weight."""
    check_blocks(rows, cols)
    return rows // BLOCK, cols // BLOCK


def check_blocks(rows: int, cols: int) -> None:
    if rows % BLOCK or cols % BLOCK:
        raise BlockShapeError(f"a [{rows}, {cols}] weight is not a whole number of {BLOCK}x{BLOCK} FP8 blocks")


def quantize_blocks(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [R, C], block scales [R/128, C/128]) of a 2-D weight, on the weight's device.

    Values are divided by the scale as stored (after rounding to `scale_dtype`), so
    `fp8 * scale` is the dequantized weight exactly as a loader computes it.
    """
    rows, cols = weight.shape
    check_blocks(rows, cols)
    blocks = weight.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=3).amax(dim=1)  # last dim first: contiguous, much faster on CPU
    # An all-zero block keeps scale 1 so dividing by it stays finite.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    scaled = blocks / scale.float()[:, None, :, None]
    fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows, cols)
    return fp8, scale


def dequantize_blocks(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight [R, C] from an fp8 weight and its block scales."""
    rows, cols = fp8.shape
    check_blocks(rows, cols)
    blocks = fp8.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return (blocks * scale.float()[:, None, :, None]).reshape(rows, cols)
