"""The tensors of a synthetic Qwen4Exp checkpoint: names, shapes, dtypes and seeded values.

Names are the ones vLLM's Qwen4Exp loader reads (vllm/models/qwen4_exp/nvidia/model.py and
mtp.py): the text model under `model.language_model.`, the MTP head under `mtp.`, routed
experts one tensor per projection (`mlp.experts.{E}.gate_proj.weight`), the shared expert
as `mlp.shared_expert.*` with its sigmoid gate `mlp.shared_expert_gate`, q/k/v/gate as
separate projections (vLLM packs them), and the n-gram table as row shards
`...ple.ple_embedding.ngram_embedding.shard_{i}.weight` with one FP32 `weight_scale`.

Ordinary weights reuse the Qwen3-MoE maker's seeded draws (tensors.Param): each weight
draws from its own generator seeded by (seed, name), N(0, 1/fan_in) for projections so
each keeps unit scale, N(0, 1) for the embedding, a router spread of about 2 logits.
Gemma-style norms (which scale by 1 + weight) are zeros; gated norms are ones.
N-gram rows are the pager's synthetic rows (row id in the first bytes, a seeded pattern
after) with FP8 NaN codes cleared, so a gathered row can be checked and stays finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np
import torch
from bigmoe_bench.ngram_synthetic import expected_rows
from bigmoe_pager.ngram.spec import TableSpec

from . import tensors
from .qwen4exp_shape import NGRAM_ROW_ELEMS, Qwen4ExpShape
from .tensors import EMBED_STD, ROUTER_LOGIT_STD, Param, Stored

TEXT = "model.language_model"
"""Prefix of the text model's tensors in the checkpoint (vLLM maps it to `model.`)."""
MTP = "mtp"
"""Prefix of the MTP head's tensors in the checkpoint."""
NGRAM_SCALE = 0.01
"""Per-table FP32 scale of the n-gram rows: random FP8 bytes have an RMS of about 100."""
CONV_STD = 0.5
"""Standard deviation of depthwise convolution taps (kernel 4: unit gain)."""


@dataclass(frozen=True)
class Special:
    """A tensor that is not a seeded normal draw: constant, or n-gram table rows."""

    name: str
    """Tensor name in the checkpoint."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: torch.dtype
    """Stored dtype."""
    kind: str
    """'const' (every element `value`) or 'ngram' (table rows from `first_row`)."""
    value: float = 0.0
    """The constant of a 'const' tensor."""
    first_row: int = 0
    """Table row id of an 'ngram' shard's first row."""


Weight = Union[Param, Special]
"""One planned weight: a seeded draw (the Qwen3-MoE maker's Param) or a Special."""


def ngram_spec(config: dict) -> TableSpec:
    """The n-gram table the config implies (rows, 160-byte rows, shards), as the pager computes it."""
    return TableSpec.from_config(config)


def plan(shape: Qwen4ExpShape, dtype: str, config: dict) -> list[Weight]:
    """Every weight of the checkpoint in file order; `config` is its config.json (for the n-gram table)."""
    fp8 = dtype == "fp8"
    h = shape.hidden
    weights: list[Weight] = [Param(f"{TEXT}.embed_tokens", (shape.vocab, h), EMBED_STD, False)]
    ple_layers = {i - 1 for i in shape.ple_layer_ids()}
    for layer, kind in enumerate(shape.layer_types()):
        prefix = f"{TEXT}.layers.{layer}"
        weights += _hyper_connections(shape, prefix)
        if layer in ple_layers:
            weights += _ple(shape, f"{prefix}.ple", fp8, ngram_spec(config))
        if kind == "linear_attention":
            weights += _linear_attention(shape, f"{prefix}.linear_attn", fp8)
        else:
            weights += _qsa_attention(shape, f"{prefix}.self_attn", fp8)
        weights += _moe(shape, f"{prefix}.mlp", fp8)
    weights += _mixer(shape, f"{TEXT}.hyper_connection_mixer")
    weights.append(Param("lm_head", (shape.vocab, h), 1.0 / math.sqrt(h), False))
    weights += _mtp(shape, fp8)
    return weights


def stored(weight: Weight, scale_dtype: torch.dtype) -> list[Stored]:
    """The tensors one weight becomes in the checkpoint."""
    if isinstance(weight, Special):
        return [Stored(weight.name, weight.shape, weight.dtype)]
    return tensors.stored(weight, scale_dtype)


def materialize(
    weight: Weight, seed: int, device: torch.device, scale_dtype: torch.dtype
) -> Iterator[tuple[Stored, torch.Tensor]]:
    """(what, values on the CPU) of each tensor `weight` is stored as."""
    if isinstance(weight, Param):
        yield from tensors.materialize(weight, seed, device, scale_dtype)
        return
    spec = stored(weight, scale_dtype)[0]
    if weight.kind == "const":
        yield spec, torch.full(weight.shape, weight.value, dtype=weight.dtype)
    elif weight.kind == "ngram":
        yield spec, torch.from_numpy(table_rows(weight.first_row, weight.shape[0], seed)).view(torch.float8_e4m3fn)
    else:
        raise ValueError(f"{weight.name}: unknown tensor kind {weight.kind!r}")


def table_rows(first_row: int, rows: int, seed: int) -> np.ndarray:
    """uint8 [rows, 160]: the n-gram rows from `first_row`, the pager's synthetic rows with FP8 NaN codes cleared."""
    values = expected_rows(np.arange(first_row, first_row + rows, dtype=np.int64), NGRAM_ROW_ELEMS, seed)
    values[(values & 0x7F) == 0x7F] ^= 0x01  # 0x7F / 0xFF are NaN in FP8 E4M3
    return values


# ---- one block each --------------------------------------------------------------------------


def _linear(name: str, out: int, inp: int, fp8: bool) -> Param:
    return Param(name, (out, inp), 1.0 / math.sqrt(inp), fp8)


def _zeros(name: str, size: int) -> Special:
    """A Gemma-style norm weight (the norm scales by 1 + weight): zeros are the identity."""
    return Special(f"{name}.weight", (size,), torch.bfloat16, "const", 0.0)


def _hyper_connections(shape: Qwen4ExpShape, prefix: str) -> list[Weight]:
    weights: list[Weight] = []
    for branch in ("attn_hyper_connection", "mlp_hyper_connection"):
        p = f"{prefix}.{branch}"
        weights += _mixer(shape, p)
        weights.append(_linear(f"{p}.block_inject_weight", shape.hc_count, shape.hc_count * shape.hidden, False))
    return weights


def _mixer(shape: Qwen4ExpShape, prefix: str) -> list[Weight]:
    """A hyper-connection's norm and low-rank mixer (the final mixer has no injection)."""
    wide = shape.hc_count * shape.hidden
    return [
        _zeros(f"{prefix}.hc_norm", wide),
        _linear(f"{prefix}.input_mix_weight_down", shape.hc_lowrank, wide, False),
        _linear(f"{prefix}.input_mix_weight_up", wide, shape.hc_lowrank, False),
    ]


def _ple(shape: Qwen4ExpShape, prefix: str, fp8: bool, spec: TableSpec) -> list[Weight]:
    wide, embed = shape.hc_count * shape.hidden, spec.heads * spec.row_elems
    table = f"{prefix}.ple_embedding.ngram_embedding"
    weights: list[Weight] = [
        _linear(f"{prefix}.key_proj", wide, embed, fp8),
        _linear(f"{prefix}.value_proj", shape.hidden, embed, fp8),
        _zeros(f"{prefix}.norm_key", wide),
        _zeros(f"{prefix}.norm_query", wide),
        _zeros(f"{prefix}.norm_conv", wide),
        Param(f"{prefix}.conv1d", (wide, 1, 4), CONV_STD, False),
    ]
    for part in range(spec.parts):
        rows = spec.rows_in_shard(part)
        if rows:
            weights.append(
                Special(
                    f"{table}.shard_{part}.weight",
                    (rows, spec.row_elems),
                    torch.float8_e4m3fn,
                    "ngram",
                    first_row=part * spec.shard_rows,
                )
            )
    weights.append(Special(f"{table}.weight_scale", (), torch.float32, "const", NGRAM_SCALE))
    return weights


def _linear_attention(shape: Qwen4ExpShape, prefix: str, fp8: bool) -> list[Weight]:
    h, d = shape.hidden, shape.linear_head_dim
    keys, values, heads = shape.linear_key_heads * d, shape.linear_value_heads * d, shape.linear_value_heads
    conv = 2 * keys + values
    return [
        _linear(f"{prefix}.in_proj_qkv", conv, h, fp8),
        _linear(f"{prefix}.in_proj_z", values, h, fp8),
        _linear(f"{prefix}.in_proj_b", heads, h, False),  # too narrow for 128-row blocks: modules_to_not_convert
        _linear(f"{prefix}.in_proj_a", heads, h, False),
        Param(f"{prefix}.conv1d", (conv, 1, 4), CONV_STD, False),
        Special(f"{prefix}.dt_bias", (heads,), torch.bfloat16, "const", 1.0),
        Special(f"{prefix}.A_log", (heads,), torch.float32, "const", 0.0),  # decay rate exp(0) = 1
        Param(f"{prefix}.norm", (d,), 0.0, False),  # a gated RMSNorm that scales by weight: ones
        _linear(f"{prefix}.out_proj", h, values, fp8),
    ]


def _qsa_attention(shape: Qwen4ExpShape, prefix: str, fp8: bool) -> list[Weight]:
    h, d, q = shape.hidden, shape.head_dim, shape.heads * shape.head_dim
    index = (shape.indexer_heads + 1) * shape.indexer_head_dim  # query heads and the one key head
    weights: list[Weight] = [
        _linear(f"{prefix}.q_proj", 2 * q, h, fp8),  # queries and their output gate
        _linear(f"{prefix}.k_proj", shape.kv_heads * d, h, fp8),
        _linear(f"{prefix}.v_proj", shape.kv_heads * d, h, fp8),
        _linear(f"{prefix}.o_proj", h, q, fp8),
        _zeros(f"{prefix}.q_norm", d),
        _zeros(f"{prefix}.k_norm", d),
    ]
    if not shape.indexer_heads:
        return weights
    return weights + [
        _linear(f"{prefix}.indexer.index_qk_proj", index, h, fp8),
        _zeros(f"{prefix}.indexer.q_layernorm", shape.indexer_head_dim),
        _zeros(f"{prefix}.indexer.k_layernorm", shape.indexer_head_dim),
    ]


def _moe(shape: Qwen4ExpShape, prefix: str, fp8: bool) -> list[Weight]:
    h = shape.hidden
    weights: list[Weight] = [Param(f"{prefix}.gate", (shape.experts, h), ROUTER_LOGIT_STD / math.sqrt(h), False)]
    weights += _mlp(f"{prefix}.shared_expert", h, shape.shared_intermediate, fp8)
    weights.append(_linear(f"{prefix}.shared_expert_gate", 1, h, False))
    for expert in range(shape.experts):
        weights += _mlp(f"{prefix}.experts.{expert}", h, shape.moe_intermediate, fp8)
    return weights


def _mlp(prefix: str, hidden: int, intermediate: int, fp8: bool) -> list[Weight]:
    return [
        _linear(f"{prefix}.gate_proj", intermediate, hidden, fp8),
        _linear(f"{prefix}.up_proj", intermediate, hidden, fp8),
        _linear(f"{prefix}.down_proj", hidden, intermediate, fp8),
    ]


def _mtp(shape: Qwen4ExpShape, fp8: bool) -> list[Weight]:
    """The MTP head: embedding/hidden fusion, QSA decoder layers (MoE included), its own final mixer."""
    h = shape.hidden
    weights: list[Weight] = [
        _zeros(f"{MTP}.pre_fc_norm_embedding", h),
        _zeros(f"{MTP}.pre_fc_norm_hidden", shape.hc_count * h),
        _linear(f"{MTP}.fc_embedding", h, h, fp8),
        _linear(f"{MTP}.fc_hidden", h, h, fp8),
    ]
    for layer in range(shape.mtp_layers):
        prefix = f"{MTP}.layers.{layer}"
        weights += _hyper_connections(shape, prefix)
        weights += _qsa_attention(shape, f"{prefix}.self_attn", fp8)
        weights += _moe(shape, f"{prefix}.mlp", fp8)
    weights += _mixer(shape, f"{MTP}.hyper_connection_mixer")
    return weights
