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


def mtp_layer_count(config) -> int:
    """Decoder layers of the multi-token-prediction head (vLLM's Qwen4ExpMTP: mtp_num_hidden_layers, default 1)."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = get(key)
        if value is not None:
            return int(value)
    return 1
