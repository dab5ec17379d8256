"""pinned_kernel_config: inside it, vLLM's Triton MoE kernel tiles a paged chunk (S experts, a few tokens)
exactly as it tiles the resident layer's whole step (E experts, all tokens); other kernels are untouched.

Runs vLLM's own config lookup (try_get_optimal_moe_config) and a real TritonExperts; the layer is a
fake standing in for PagedRoutedExperts (a real one needs a running engine), holding what the
function reads: the kernel, the slot parameters' shapes, the expert count and top-k.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is needed for its MoE kernel config lookup")

from bigmoe_pager.adapters.vllm_glue import pinned_kernel_config  # noqa: E402

EXPERTS, SLOTS, TOP_K, HIDDEN, INTER, BLOCK = 256, 32, 8, 2048, 512, [128, 128]


def triton_experts():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType, fp8_w8a8_moe_quant_config)
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    moe = FusedMoEConfig(num_experts=SLOTS, experts_per_token=TOP_K, hidden_dim=HIDDEN, intermediate_size=INTER,
                         num_local_experts=SLOTS, num_logical_experts=SLOTS, activation=MoEActivation.SILU,
                         device="cpu", routing_method=RoutingMethodType.Renormalize,
                         moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)
    quant = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(SLOTS, 8, 16), w2_scale=torch.ones(SLOTS, 16, 4),
                                      block_shape=BLOCK)
    return TritonExperts(moe, quant)


def fake_paged_layer(fused_experts) -> SimpleNamespace:
    """The attributes of a PagedRoutedExperts that pinned_kernel_config reads (meta tensors: shapes only)."""
    return SimpleNamespace(
        quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=fused_experts)),
        w13_weight=torch.empty(SLOTS, 2 * INTER, HIDDEN, dtype=torch.float8_e4m3fn, device="meta"),
        w2_weight=torch.empty(SLOTS, HIDDEN, INTER, dtype=torch.float8_e4m3fn, device="meta"),
        _num_experts=EXPERTS, top_k=TOP_K,
    )


def kernel_lookup(experts: int, tokens: int) -> dict:
    """The config the Triton kernel asks for in a call with `experts` slots and `tokens` tokens."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    return try_get_optimal_moe_config((experts, 2 * INTER, HIDDEN), (experts, HIDDEN, INTER), TOP_K, "fp8_w8a8", tokens,
                                      block_shape=BLOCK)


CASES = [(1024, 4), (100, 3)]  # (tokens of the step, tokens of one chunk)


@pytest.mark.parametrize("step_tokens,chunk_tokens", CASES)
def test_chunks_run_the_resident_layers_tiles(step_tokens, chunk_tokens):
    resident = kernel_lookup(EXPERTS, step_tokens)
    assert kernel_lookup(SLOTS, chunk_tokens) != resident, "without the pin the chunk would get other tiles"
    with pinned_kernel_config(fake_paged_layer(triton_experts()), step_tokens, torch.bfloat16):
        assert kernel_lookup(SLOTS, chunk_tokens) == resident
    from vllm.model_executor.layers.fused_moe import get_config

    assert get_config() is None  # the override ends with the step


def test_other_kernels_are_left_alone():
    from vllm.model_executor.layers.fused_moe import get_config

    with pinned_kernel_config(fake_paged_layer(SimpleNamespace()), 1024, torch.bfloat16):
        assert get_config() is None
