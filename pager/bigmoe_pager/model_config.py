"""Numbers read from a model's Hugging Face config (a config.json dict or a transformers config object)."""

from __future__ import annotations


def moe_layer_count(config) -> int | None:
    """Decoder layers that have routed experts (Qwen's mlp_only_layers / decoder_sparse_step rules); None if unknown."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    layers = get("num_hidden_layers")
    if layers is None:
        return None
    mlp_only = set(get("mlp_only_layers") or [])
    step = int(get("decoder_sparse_step") or 1)
    return sum(1 for i in range(int(layers)) if i not in mlp_only and (i + 1) % step == 0)
