"""Shape of a synthetic Qwen4Exp (Qwen3.8-Flash-Next architecture) checkpoint and its config.json.

Numbers the preset states (48 MoE layers x 512 experts, top-10 plus one shared expert,
hidden 2560 -> 640, 12 full-attention layers with 2 KV heads of 256, one PLE layer
whose n-gram table has 16 heads of 160 FP8 bytes, one MTP layer) are the defaults.
The released config's other numbers are not public; those defaults are transformers'
Qwen4ExpTextConfig defaults (hc_count 4, hc_lowrank 320, linear-attention heads
16 x 128 / 32 x 128), and QSA indexer sizes that pass its validation. Every one is a
field, so a run can match a real config once it is known.

The config.json has the released schema: architectures ["Qwen4ExpForCausalLM"],
model_type "qwen4_exp" with the text model under text_config, `full_attention` in
layer_types (transformers maps it to its QSA layer type, under either of its names), and
for FP8 Qwen's block quantization_config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shape import ShapeError, check_common, check_fp8_blocks, fp8_quantization_config

NGRAM_ROW_ELEMS = 160
"""FP8 elements (bytes) in one n-gram row, as in the released table."""
FULL_ATTENTION_INTERVAL = 4
"""Every fourth layer of the released model is full (QSA) attention; the rest are linear attention."""


class Qwen4ExpShapeError(ShapeError):
    """Sizes or options that cannot make a valid checkpoint; the message is one line."""


@dataclass(frozen=True)
class Qwen4ExpShape:
    """Architecture numbers of a Qwen4Exp model; every decoder layer has a routed-expert MLP."""

    layers: int = 4
    """Decoder layers (the released model has 48); the layer-type pattern is scaled down, see layer_types()."""
    experts: int = 512
    """Routed experts per layer."""
    top_k: int = 10
    """Routed experts each token is sent to per layer."""
    hidden: int = 2560
    """Hidden size of one residual stream."""
    moe_intermediate: int = 640
    """Intermediate size of one routed expert."""
    shared_intermediate: int = 640
    """Intermediate size of the one shared expert."""
    vocab: int = 8192
    """Rows of the embedding and the LM head (the tokenizer uses at most 8192)."""
    heads: int = 16
    """Query heads of the full-attention layers."""
    kv_heads: int = 2
    """Key/value heads of the full-attention layers."""
    head_dim: int = 256
    """Size of one attention head."""
    linear_key_heads: int = 16
    """Key heads of the linear-attention (gated delta net) layers."""
    linear_value_heads: int = 32
    """Value heads of the linear-attention layers."""
    linear_head_dim: int = 128
    """Key and value head size of the linear-attention layers."""
    hc_count: int = 4
    """Residual streams of the hyper-connections."""
    hc_lowrank: int = 320
    """Rank of the hyper-connection input mixer."""
    indexer_heads: int = 16
    """Query heads of the QSA token indexer (it has one key head); 0 = no indexer: plain gated attention
    (what vLLM's CPU build can run: its QSA needs FlashAttention)."""
    indexer_head_dim: int = 128
    """Head size of the QSA indexer."""
    indexer_budget: int = 2048
    """Tokens the indexer selects per query."""
    indexer_compress_ratio: int = 4
    """Keys averaged into one indexer block."""
    ngram_vocab_base: int = 62_500
    """Smallest n-gram head size; 16 heads of primes from here give the table's rows (released: 20,000,000)."""
    ngram_parts: int = 8
    """Checkpoint shards of the n-gram table (released: 128)."""
    mtp_layers: int = 1
    """Multi-token-prediction layers (the released model has one)."""
    max_position: int = 262_144
    """max_position_embeddings written to config.json (tokens)."""

    def layer_types(self) -> list[str]:
        """Per layer 'linear_attention' or 'full_attention': the released 3:1 pattern, with at least one full layer
        (PLE layers stay linear attention, as transformers requires)."""
        kinds = [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(self.layers)
        ]
        if "full_attention" not in kinds:  # fewer than 4 layers: the last one that is not a PLE layer
            last = max(i for i in range(self.layers) if i + 1 not in self.ple_layer_ids())
            kinds[last] = "full_attention"
        return kinds

    def ple_layer_ids(self) -> list[int]:
        """One-based ids of the PLE layers: the second layer, as released (a linear-attention layer)."""
        return [2]

    def ngram_heads(self) -> int:
        """Rows each token gathers: (ngram_size 3 - 1) x 8 heads per n-gram."""
        return 16


def validate(shape: Qwen4ExpShape, dtype: str, scale_dtype: str = "float32") -> None:
    """Raise Qwen4ExpShapeError with one line when `shape` cannot make a `dtype` checkpoint."""
    check_common(shape, dtype, scale_dtype, Qwen4ExpShapeError, may_be_zero=("indexer_heads",))
    if shape.layers < 2:
        raise Qwen4ExpShapeError(f"layers={shape.layers}: Qwen4Exp needs at least 2 (the PLE layer is layer 2)")
    if shape.heads % shape.kv_heads or shape.linear_value_heads % shape.linear_key_heads:
        raise Qwen4ExpShapeError("heads must be a multiple of kv_heads, linear_value_heads of linear_key_heads")
    if shape.hc_count < 2:
        raise Qwen4ExpShapeError(f"hc_count={shape.hc_count}: Qwen4Exp needs at least 2 residual streams")
    if shape.indexer_budget % shape.indexer_compress_ratio:
        raise Qwen4ExpShapeError("indexer_budget must be a multiple of indexer_compress_ratio")
    if shape.indexer_heads and rotary_dim(shape) > shape.indexer_head_dim:
        raise Qwen4ExpShapeError(
            f"indexer_head_dim={shape.indexer_head_dim} is below the rotary size {rotary_dim(shape)}"
        )
    if dtype == "fp8":
        _check_fp8_blocks(shape)


def _check_fp8_blocks(shape: Qwen4ExpShape) -> None:
    sizes = {
        "hidden": shape.hidden,
        "moe_intermediate": shape.moe_intermediate,
        "shared_intermediate": shape.shared_intermediate,
        "heads*head_dim": shape.heads * shape.head_dim,
        "kv_heads*head_dim": shape.kv_heads * shape.head_dim,
        "linear_key_heads*linear_head_dim": shape.linear_key_heads * shape.linear_head_dim,
        "linear_value_heads*linear_head_dim": shape.linear_value_heads * shape.linear_head_dim,
    }
    if shape.indexer_heads:
        sizes["(indexer_heads+1)*indexer_head_dim"] = (shape.indexer_heads + 1) * shape.indexer_head_dim
    check_fp8_blocks(sizes, Qwen4ExpShapeError)


PARTIAL_ROTARY_FACTOR = 0.25
"""Share of each attention head that is rotated (Qwen3-Next and Qwen3.5 use a quarter)."""


def rotary_dim(shape: Qwen4ExpShape) -> int:
    return int(shape.head_dim * PARTIAL_ROTARY_FACTOR)


def unconverted_modules(shape: Qwen4ExpShape) -> list[str]:
    """modules_to_not_convert: Linears an FP8 Qwen checkpoint keeps bf16 that vLLM would otherwise quantize.

    vLLM builds routers, shared-expert gates, hyper-connections and convolutions without a
    quantization config, so only the head and the linear-attention b/a projections (too
    narrow for 128-row blocks) need naming; they are listed per layer as Qwen writes them.
    """
    names = ["lm_head"]
    for layer, kind in enumerate(shape.layer_types()):
        if kind == "linear_attention":
            prefix = f"model.language_model.layers.{layer}.linear_attn"
            names += [f"{prefix}.in_proj_a", f"{prefix}.in_proj_b"]
    return names


def text_config(shape: Qwen4ExpShape, dtype: str, special_ids: dict[str, int]) -> dict:
    """The text_config object of config.json."""
    config = {
        "model_type": "qwen4_exp_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        "layer_types": shape.layer_types(),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": shape.linear_head_dim,
        "linear_num_key_heads": shape.linear_key_heads,
        "linear_num_value_heads": shape.linear_value_heads,
        "linear_value_head_dim": shape.linear_head_dim,
        "max_position_embeddings": shape.max_position,
        "moe_intermediate_size": shape.moe_intermediate,
        "mtp_num_hidden_layers": shape.mtp_layers,
        "norm_topk_prob": True,
        "num_attention_heads": shape.heads,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        },
        "shared_expert_intermediate_size": shape.shared_intermediate,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab,
        "hc_count": shape.hc_count,
        "hc_lowrank": shape.hc_lowrank,
        "ple_layer_ids": shape.ple_layer_ids(),
        "ple_embed_dim": shape.ngram_heads() * NGRAM_ROW_ELEMS,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": shape.ngram_heads() // 2,
        "ngram_vocab_size_base": shape.ngram_vocab_base,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": shape.ngram_parts,
        "output_gate_type": "silu",
        "dtype": "bfloat16",
    }
    if shape.indexer_heads:
        config.update(
            {
                "indexer_n_heads": shape.indexer_heads,
                "indexer_kv_heads": 1,
                "indexer_head_dim": shape.indexer_head_dim,
                "indexer_budget": shape.indexer_budget,
                "indexer_compress_ratio": shape.indexer_compress_ratio,
            }
        )
    if dtype == "bf16":
        # Without a quantization_config vLLM would hold the table in bf16; this keeps the 160-byte FP8 rows.
        config["ple_embedding_dtype"] = "float8_e4m3fn"
    return config


def hf_config(shape: Qwen4ExpShape, dtype: str, special_ids: dict[str, int]) -> dict:
    """config.json of the checkpoint (the FP8 quantization_config for fp8)."""
    config = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": "qwen4_exp",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": text_config(shape, dtype, special_ids),
    }
    if dtype == "fp8":
        config["quantization_config"] = fp8_quantization_config(unconverted_modules(shape))
    return config
