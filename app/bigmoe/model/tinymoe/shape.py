"""Shape of a synthetic Qwen3-MoE checkpoint and the config.json that describes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .fp8 import BLOCK, SCALE_DTYPES

DTYPES = ("bf16", "fp8")
"""Checkpoint flavours: all bf16, or FP8 block-quantized Linears like Qwen's -FP8 repos."""


class ShapeError(ValueError):
    """Sizes or options that cannot make a valid checkpoint; the message is one line."""


@dataclass(frozen=True)
class TinyShape:
    """Architecture numbers of a Qwen3-MoE model in which every decoder layer is MoE."""

    layers: int = 4
    """Decoder layers, each with attention and a routed-expert MLP."""
    experts: int = 16
    """Routed experts per layer."""
    top_k: int = 4
    """Experts each token is routed to per layer."""
    hidden: int = 256
    """Hidden size (vLLM's CPU MoE kernel wants a multiple of 32)."""
    moe_intermediate: int = 128
    """Intermediate size of one expert."""
    vocab: int = 2048
    """Rows of the embedding and the LM head."""
    heads: int = 4
    """Attention query heads."""
    kv_heads: int = 2
    """Attention key/value heads (grouped-query attention)."""
    head_dim: int = 64
    """Size of one attention head."""
    max_position: int = 4096
    """max_position_embeddings written to config.json (tokens)."""

    def kv_bytes_per_token(self) -> int:
        """bf16 KV-cache bytes one token of context takes over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


def validate(shape: TinyShape, dtype: str, scale_dtype: str = "float32") -> None:
    """Raise ShapeError with one line when `shape` cannot make a `dtype` checkpoint."""
    check_common(shape, dtype, scale_dtype)
    if shape.heads % shape.kv_heads:
        raise ShapeError(f"heads={shape.heads} is not a multiple of kv_heads={shape.kv_heads}")
    if shape.head_dim % 2:
        raise ShapeError(f"head_dim={shape.head_dim} must be even (rotary embedding pairs)")
    if dtype == "fp8":
        check_fp8_blocks(
            {
                "hidden": shape.hidden,
                "moe_intermediate": shape.moe_intermediate,
                "heads*head_dim": shape.heads * shape.head_dim,
                "kv_heads*head_dim": shape.kv_heads * shape.head_dim,
            }
        )


def check_common(
    shape, dtype: str, scale_dtype: str, error: type[ShapeError] = ShapeError, may_be_zero: tuple[str, ...] = ()
) -> None:
    """What every synthetic shape must pass (raising `error`): a known dtype and scale dtype, every field a
    positive integer (those named in `may_be_zero` may be 0), top_k within experts, and a vocabulary the
    byte-level tokenizer fits in."""
    if dtype not in DTYPES:
        raise error(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if scale_dtype not in SCALE_DTYPES:
        raise error(f"scale dtype {scale_dtype!r} is not one of {', '.join(SCALE_DTYPES)}")
    for name, value in asdict(shape).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name in may_be_zero else 1):
            raise error(f"{name} must be a positive integer, not {value!r}")
    if shape.top_k > shape.experts:
        raise error(f"top_k={shape.top_k} exceeds experts={shape.experts}")
    if shape.vocab < 512:
        raise error(f"vocab={shape.vocab} is too small: the byte-level tokenizer needs at least 512")


def check_fp8_blocks(sizes: dict[str, int], error: type[ShapeError] = ShapeError) -> None:
    """Raise `error` naming every size (name -> elements) that FP8 blocks do not divide."""
    bad = [f"{name}={value}" for name, value in sizes.items() if value % BLOCK]
    if bad:
        raise error(
            f"fp8 needs sizes divisible by {BLOCK} (the block size), but {', '.join(bad)}; "
            f"use multiples of {BLOCK} or --dtype bf16"
        )


def fp8_quantization_config(unconverted: list[str]) -> dict:
    """config.json's quantization_config of Qwen's FP8 block checkpoints; `unconverted` Linears stay bf16."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": unconverted,
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }


def unconverted_modules(shape: TinyShape) -> list[str]:
    """modules_to_not_convert as Qwen writes it for Qwen3-MoE FP8: the head, then per layer its norms and router."""
    names = ["lm_head"]
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        names += [f"{prefix}.input_layernorm", f"{prefix}.mlp.gate", f"{prefix}.post_attention_layernorm"]
    return names


def hf_config(shape: TinyShape, dtype: str, special_ids: dict[str, int]) -> dict:
    """config.json of the checkpoint, with Qwen3-MoE's keys (and the FP8 quantization_config for fp8)."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids["<|endoftext|>"],
        "decoder_sparse_step": 1,
        "eos_token_id": special_ids["<|im_end|>"],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        # Size a dense MLP would have; no layer is dense (mlp_only_layers is empty).
        "intermediate_size": shape.moe_intermediate * shape.top_k,
        "max_position_embeddings": shape.max_position,
        "max_window_layers": shape.layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": shape.moe_intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": shape.heads,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab,
    }
    if dtype == "fp8":
        config["quantization_config"] = fp8_quantization_config(unconverted_modules(shape))
    return config


def generation_config(special_ids: dict[str, int]) -> dict:
    """generation_config.json: greedy by default, stops at <|im_end|> or <|endoftext|>."""
    return {
        "bos_token_id": special_ids["<|endoftext|>"],
        "do_sample": False,
        "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        "pad_token_id": special_ids["<|endoftext|>"],
    }
