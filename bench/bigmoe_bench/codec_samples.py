"""Sample FP8 expert records for the codec's tests and benchmark.

Realistic weights are drawn from a Student-t (heavy tails, like trained LLM
weights) or a Gaussian and block-quantized as in Qwen's official FP8
checkpoints: each 128x128 block scaled so its largest magnitude maps to 448,
rounded to float8_e4m3fn, with the float32 scale stored beside it. Fuzz
patterns fill every FP8 component with one kind of byte soup.
"""

from __future__ import annotations

import numpy as np
import torch
from bigmoe_pager.core.layout import ExpertLayout

BLOCK = 128  # quantization tile, elements per side
FP8_MAX = 448.0  # largest finite float8_e4m3fn

SHAPES = {"qwen3.6-35b-a3b": (2048, 512), "qwen3.8-flash-next": (2560, 640)}
"""Preset name -> (hidden, moe intermediate)."""

PATTERNS = ("random", "all_values", "constant", "skewed", "uniform_exp", "nan", "student_t", "gaussian")
"""Fuzz patterns `pattern_bytes` knows."""


def moe_layout(hidden: int, intermediate: int) -> ExpertLayout:
    return ExpertLayout.for_moe(hidden, intermediate, torch.float8_e4m3fn, block=BLOCK)


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 bytes uint8 [R, C], float32 scales [ceil(R/128), ceil(C/128)]) of a 2-D float weight."""
    rows, cols = weight.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((br * BLOCK, bc * BLOCK), np.float32)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(br, BLOCK, bc, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    scaled = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(br * BLOCK, bc * BLOCK)
    fp8 = torch.from_numpy(np.ascontiguousarray(scaled[:rows, :cols])).to(torch.float8_e4m3fn)
    return fp8.view(torch.uint8).numpy(), scale


def weights(shape: tuple[int, int], dist: str, rng: np.random.Generator) -> np.ndarray:
    if dist == "student_t":
        return rng.standard_t(5, size=shape).astype(np.float32)
    if dist == "gaussian":
        return rng.standard_normal(shape, dtype=np.float32)
    raise ValueError(f"unknown weight distribution {dist!r}; use student_t or gaussian")


def expert_record(layout: ExpertLayout, dist: str, rng: np.random.Generator) -> np.ndarray:
    """One record (uint8 [record_bytes]) of block-quantized weights; scales fill the *_scale_inv components."""
    out = np.zeros(layout.record_bytes, np.uint8)
    for comp in layout.components:
        if comp.dtype != torch.float8_e4m3fn:
            continue
        fp8, scale = quantize(weights(comp.shape, dist, rng))
        out[comp.offset : comp.offset + comp.nbytes] = fp8.reshape(-1)
        scale_name = comp.name + "_scale_inv"
        if scale_name in {c.name for c in layout.components}:
            sc = layout[scale_name]
            out[sc.offset : sc.offset + sc.nbytes] = scale.reshape(-1).view(np.uint8)[: sc.nbytes]
    return out


def pattern_bytes(pattern: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n bytes of one fuzz pattern (uint8)."""
    if pattern == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if pattern == "all_values":
        return np.resize(np.arange(256, dtype=np.uint8), n)
    if pattern == "constant":
        return np.full(n, 0x3C, np.uint8)
    if pattern == "skewed":  # nearly every exponent 7, a few others: very short codes
        exps = np.where(rng.random(n) < 0.97, 7, rng.integers(0, 16, n)).astype(np.uint8)
        return (exps << 3) | rng.integers(0, 256, n, dtype=np.uint8) & 0x87
    if pattern == "uniform_exp":  # every exponent equally likely: nothing to gain, stored verbatim
        return (rng.integers(0, 16, n, dtype=np.uint8) << 3) | rng.integers(0, 256, n, dtype=np.uint8) & 0x87
    if pattern == "nan":  # E4M3 NaNs (0x7F, 0xFF) among zeros and maxima
        return rng.choice(np.array([0x7F, 0xFF, 0x00, 0x80, 0x7E, 0xFE], np.uint8), n)
    if pattern in ("student_t", "gaussian"):
        cols = 256 if n >= 256 else n
        w = weights((-(-n // cols), cols), pattern, rng)
        return quantize(w)[0].reshape(-1)[:n]
    raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")


def pattern_record(layout: ExpertLayout, pattern: str, rng: np.random.Generator) -> np.ndarray:
    """A record whose FP8 components hold `pattern` bytes and whose other components hold random bytes."""
    out = np.zeros(layout.record_bytes, np.uint8)
    for comp in layout.components:
        fill = (
            pattern_bytes(pattern, comp.nbytes, rng)
            if comp.dtype == torch.float8_e4m3fn
            else rng.integers(0, 256, comp.nbytes, dtype=np.uint8)
        )
        out[comp.offset : comp.offset + comp.nbytes] = fill
    return out


def exponent_entropy_bound(raw: np.ndarray, layout: ExpertLayout) -> float:
    """The per-row bound, as a fraction of record_bytes: sign+mantissa raw (4 bits), exponents at their
    empirical per-row entropy, non-FP8 components raw; headers and tables not counted."""
    bits = 0.0
    for comp in layout.components:
        data = raw[comp.offset : comp.offset + comp.nbytes]
        if comp.dtype != torch.float8_e4m3fn:
            bits += 8 * comp.nbytes
            continue
        cols = comp.shape[-1]
        exps = ((data >> 3) & 0xF).reshape(-1, cols).astype(np.int64)
        exps += np.arange(exps.shape[0])[:, None] * 16
        counts = np.bincount(exps.reshape(-1), minlength=exps.shape[0] * 16).reshape(-1, 16)
        p = counts / cols
        logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
        bits += 4 * data.size - (counts * logs).sum()
    return bits / 8 / layout.record_bytes
