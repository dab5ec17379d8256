"""Speculative decoding with the model's MTP head: what it asks of the expert slots (its vLLM flag: vllm_command).

vLLM counts a CUDA graph's batch in tokens, and a verification step of speculative decoding has
(speculative tokens + 1) tokens per sequence (vLLM 0.33 config/vllm.py uniform_decode_query_len), so
the captured batch stays VRAM slots / top-k tokens and holds that many tokens / (tokens + 1)
sequences. One sequence's verification step must fit the slots, or it could never run in a graph
(vLLM's FULL decode graphs refuse to start then: compilation.py adjust_cudagraph_sizes_for_spec_decode).
The MTP drafter's own MoE layer(s) are paged like the model's, with the same slots per layer.
"""

from __future__ import annotations

MAX_SPECULATIVE_TOKENS = 3
"""Largest --speculative-tokens: the MTP settings issue 14 asks the pager to be shown with (1 to 3)."""


def mtp_layers(tokens: int, mtp_moe_layers: int) -> int:
    """MoE layers the drafter adds to the paged ones (the model's MTP decoder layers; Flash-Next has one)."""
    return mtp_moe_layers if tokens > 0 else 0


def graph_tokens(vram_slots: int, top_k: int) -> int:
    """The largest batch (tokens) vLLM may capture in a CUDA graph: every one of its expert ids fits the slots."""
    return max(1, vram_slots // top_k)


def verify_slots(tokens: int, top_k: int) -> int:
    """VRAM slots per layer that one sequence's verification step needs ((tokens + 1) x top-k expert ids)."""
    return (tokens + 1) * top_k


def refusal(tokens: int, model: str, mtp_moe_layers: int, vram_slots: int, top_k: int, graphs: bool) -> str | None:
    """Why this speculative setting cannot run as planned (one line), or None."""
    if tokens <= 0:
        return None
    if mtp_moe_layers <= 0:
        return f"--speculative-tokens {tokens}: {model} has no MTP head to draft with; use --speculative-tokens 0"
    need = verify_slots(tokens, top_k)
    if graphs and vram_slots < need:
        return (
            f"--speculative-tokens {tokens}: one sequence's verification step has {tokens + 1} tokens x "
            f"top-{top_k} = {need} expert ids, more than the {vram_slots} VRAM slots per layer; lower "
            "--speculative-tokens or give more VRAM"
        )
    return None


def capture_reason(tokens: int, vram_slots: int, top_k: int) -> str:
    """The argv reason's words for the captured batch under speculative decoding."""
    if tokens <= 0:
        return ""
    size = graph_tokens(vram_slots, top_k)
    return (
        f"; with {tokens} speculative tokens each sequence's verification step has {tokens + 1} tokens, so a "
        f"captured batch holds {size // (tokens + 1)} sequence(s); --speculative-config runs vLLM's MTP drafter, "
        "whose MoE layer is paged with the same slots"
    )
