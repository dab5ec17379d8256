"""The tensors of a synthetic Qwen3-MoE checkpoint: what they are, and their seeded values.

Every source weight draws from its own generator, seeded from (seed, weight name),
so a weight's values do not depend on the order of generation, the shard layout or
the flavour: the fp8 flavour quantizes exactly the bf16 flavour's weights. Values
depend on the device kind that draws them (CPU and CUDA generators differ).

Scales keep a random model stable and its greedy output varied: Linears draw
N(0, 1/fan_in) so each projection keeps unit scale (about 0.02 at Qwen's sizes),
the embedding N(0, 1) so the current token shows through the layers, the router
N(0, (2/sqrt(hidden))^2) so router logits spread by about 2 and tokens pick
different experts, and norms are ones.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from .fp8 import quantize_blocks, scale_shape
from .shape import TinyShape

EMBED_STD = 1.0
"""Standard deviation of the token embedding."""
ROUTER_LOGIT_STD = 2.0
"""Spread of router logits for a unit-RMS input."""


@dataclass(frozen=True)
class Param:
    """One weight of the model and how the checkpoint stores it."""

    module: str
    """Module path, e.g. model.layers.0.mlp.experts.3.up_proj; tensors are module + '.weight'."""
    shape: tuple[int, ...]
    """Shape of the weight ([out, in] for a Linear)."""
    std: float
    """Standard deviation of its normal draw; 0 means all ones (norm weights)."""
    fp8: bool
    """Stored as float8_e4m3fn with a `weight_scale_inv` block-scale grid."""


@dataclass(frozen=True)
class Stored:
    """One tensor as written to a safetensors file."""

    name: str
    """Tensor name in the checkpoint."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: torch.dtype
    """Stored dtype (bfloat16, float8_e4m3fn, float32)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan(shape: TinyShape, dtype: str) -> list[Param]:
    """Every weight of the model in checkpoint order; Linears other than router and head are FP8 in the fp8 flavour."""
    fp8 = dtype == "fp8"
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def linear(module: str, out: int, inp: int, quantized: bool = fp8) -> Param:
        return Param(module, (out, inp), 1.0 / math.sqrt(inp), quantized)

    params = [Param("model.embed_tokens", (shape.vocab, h), EMBED_STD, False)]
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        params += [
            Param(f"{p}.input_layernorm", (h,), 0.0, False),
            linear(f"{p}.self_attn.q_proj", q, h),
            linear(f"{p}.self_attn.k_proj", kv, h),
            linear(f"{p}.self_attn.v_proj", kv, h),
            linear(f"{p}.self_attn.o_proj", h, q),
            Param(f"{p}.self_attn.q_norm", (shape.head_dim,), 0.0, False),
            Param(f"{p}.self_attn.k_norm", (shape.head_dim,), 0.0, False),
            Param(f"{p}.post_attention_layernorm", (h,), 0.0, False),
            Param(f"{p}.mlp.gate", (shape.experts, h), ROUTER_LOGIT_STD / math.sqrt(h), False),
        ]
        for expert in range(shape.experts):
            e = f"{p}.mlp.experts.{expert}"
            params += [
                linear(f"{e}.gate_proj", shape.moe_intermediate, h),
                linear(f"{e}.up_proj", shape.moe_intermediate, h),
                linear(f"{e}.down_proj", h, shape.moe_intermediate),
            ]
    params += [Param("model.norm", (h,), 0.0, False), linear("lm_head", shape.vocab, h, quantized=False)]
    return params


def stored(param: Param, scale_dtype: torch.dtype) -> list[Stored]:
    """The tensors one weight becomes in the checkpoint."""
    if not param.fp8:
        return [Stored(f"{param.module}.weight", param.shape, torch.bfloat16)]
    return [
        Stored(f"{param.module}.weight", param.shape, torch.float8_e4m3fn),
        Stored(f"{param.module}.weight_scale_inv", scale_shape(*param.shape), scale_dtype),
    ]


def param_seed(seed: int, module: str) -> int:
    """Generator seed of one weight: a stable hash of (seed, module), 63 bits."""
    digest = hashlib.blake2b(f"{seed}:{module}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def source_weight(param: Param, seed: int, device: torch.device) -> torch.Tensor:
    """The bf16 weight itself, before any quantization, on `device`."""
    if param.std == 0.0:
        return torch.ones(param.shape, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(seed, param.module))
    draw = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=device)
    return (draw * param.std).to(torch.bfloat16)


def materialize(
    param: Param, seed: int, device: torch.device, scale_dtype: torch.dtype
) -> Iterator[tuple[Stored, torch.Tensor]]:
    """(what, values) of each tensor `param` is stored as, values on the CPU."""
    weight = source_weight(param, seed, device)
    if param.fp8:
        values = quantize_blocks(weight, scale_dtype)
    else:
        values = (weight,)
    for spec, tensor in zip(stored(param, scale_dtype), values):
        yield spec, tensor.cpu()
