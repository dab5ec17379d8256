"""What the vLLM adapter does for CUDA builds, checked on vLLM's CPU build with its own functions.

- pinned_kernel_config: inside it, vLLM's Triton MoE kernel tiles a paged chunk (S experts, a few
  tokens) exactly as it tiles the resident layer's whole step (E experts, all tokens); other kernels
  are untouched. Runs vLLM's own lookup (try_get_optimal_moe_config) and a real TritonExperts.
- require_host_driven_mode: CUDA graphs are refused in one line, eager mode accepted.
- host_allocations: the pager's host tiers land on the CPU while vLLM builds the model under an
  accelerator device context.

Fakes, named as such: a SimpleNamespace stands in for PagedRoutedExperts (a real one needs a running
engine) and for a VllmConfig, holding only what the functions read; the platform's CUDA answer is
patched where the CUDA path is under test, since this machine has no GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is needed for its MoE kernel config lookup")

from bigmoe_pager.adapters.vllm import glue as vllm_glue  # noqa: E402
from bigmoe_pager.adapters.vllm.glue import EngineModeError, pinned_kernel_config  # noqa: E402
from bigmoe_pager.core.host_pager import HostPager, TierSizes  # noqa: E402
from bigmoe_pager.core.layout import ExpertLayout  # noqa: E402

EXPERTS, SLOTS, TOP_K, HIDDEN, INTER, BLOCK = 256, 32, 8, 2048, 512, [128, 128]


def triton_experts():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        fp8_w8a8_moe_quant_config,
    )
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    moe = FusedMoEConfig(
        num_experts=SLOTS,
        experts_per_token=TOP_K,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=SLOTS,
        num_logical_experts=SLOTS,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
    )
    quant = fp8_w8a8_moe_quant_config(
        w1_scale=torch.ones(SLOTS, 8, 16), w2_scale=torch.ones(SLOTS, 16, 4), block_shape=BLOCK
    )
    return TritonExperts(moe, quant)


def fake_paged_layer(fused_experts) -> SimpleNamespace:
    """The attributes of a PagedRoutedExperts that pinned_kernel_config reads (meta tensors: shapes only)."""
    return SimpleNamespace(
        quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=fused_experts)),
        w13_weight=torch.empty(SLOTS, 2 * INTER, HIDDEN, dtype=torch.float8_e4m3fn, device="meta"),
        w2_weight=torch.empty(SLOTS, HIDDEN, INTER, dtype=torch.float8_e4m3fn, device="meta"),
        _num_experts=EXPERTS,
        top_k=TOP_K,
    )


def kernel_lookup(experts: int, tokens: int) -> dict:
    """The config the Triton kernel asks for in a call with `experts` slots and `tokens` tokens."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    return try_get_optimal_moe_config(
        (experts, 2 * INTER, HIDDEN), (experts, HIDDEN, INTER), TOP_K, "fp8_w8a8", tokens, block_shape=BLOCK
    )


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


@pytest.mark.parametrize("mode,refused", [("NONE", False), ("PIECEWISE", True), ("FULL_AND_PIECEWISE", True)])
def test_cuda_graphs_are_refused_in_one_line(monkeypatch, mode, refused):
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    fake_config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]))
    if refused:
        with pytest.raises(EngineModeError, match="--enforce-eager") as e:
            vllm_glue.require_host_driven_mode(fake_config)
        assert "\n" not in str(e.value)
    else:
        vllm_glue.require_host_driven_mode(fake_config)


def test_host_tiers_land_on_the_cpu_inside_an_accelerator_device_context():
    layout = ExpertLayout.for_moe(128, 128, torch.bfloat16)
    with torch.device("meta"):  # stands in for vLLM's `with torch.device("cuda")` around model building
        with vllm_glue.host_allocations():
            pager = HostPager(layout, TierSizes(experts=4, vram=2, ram=4), source=None)
        assert torch.empty(1).device.type == "meta"  # the model's own parameters still go to the accelerator
    assert pager.ram.device.type == "cpu" and pager.slot_table.device.type == "cpu"


def test_the_start_line_says_how_fast_loading_copied_experts_into_ram():
    """The engine log's start line carries the loader's copy rate into the RAM tier (how a slow load is told apart)."""
    from bigmoe_pager.adapters.vllm.process import LoadCopies

    copies = LoadCopies()
    assert copies.describe() == ""  # nothing copied: every expert stayed on SSD
    for _ in range(3):
        copies.add(2**29, 0.25)
    assert copies.describe() == "; loading copied 1.50 GiB of experts into RAM in 0.8 s (2.15 GB/s)"


def test_loader_copies_into_ram_run_on_one_thread_and_give_the_threads_back(monkeypatch):
    """vLLM loads with every core's intra-op thread; two engines splitting each 1 MiB copy 16 ways copied at 0.12 GB/s
    each on the H200 (run 8), so on CUDA the paged layer's copies run on one thread, and the count comes back after,
    even on a failed copy."""
    from bigmoe_pager.adapters.vllm import device
    from bigmoe_pager.adapters.vllm.experts import _one_copy_thread

    monkeypatch.setattr(device, "on_cuda", lambda: True)
    # a vLLM CPU engine run earlier in this process may have replaced it with a refusal (see the next test)
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _one_copy_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), _one_copy_thread():
            raise ValueError("a failed copy")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_loader_copies_leave_a_cpu_engines_threads_alone(monkeypatch):
    """vLLM's CPU worker binds its threads and replaces torch.set_num_threads with a refusal that logs a warning: on
    CPU the copies must not call it (once per checkpoint tensor, that would be one warning per tensor)."""
    from bigmoe_pager.adapters.vllm import device
    from bigmoe_pager.adapters.vllm.experts import _one_copy_thread

    calls = []
    monkeypatch.setattr(device, "on_cuda", lambda: False)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    with _one_copy_thread():
        pass
    assert calls == []
