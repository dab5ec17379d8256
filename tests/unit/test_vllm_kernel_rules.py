"""What the paged layer accepts of vLLM's MoE layer: proven kernels only, the shared expert left to vLLM's
runner, the MTP drafter's layers counted after the model's, and graph sizes with speculative tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed")

from bigmoe_pager.adapters.vllm import device as vllm_device  # noqa: E402
from bigmoe_pager.adapters.vllm import glue as vllm_glue  # noqa: E402
from bigmoe_pager.adapters.vllm.glue import EngineModeError  # noqa: E402
from vllm.config import CompilationConfig  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402


@pytest.mark.parametrize(
    "platform, experts, backend, monolithic, refused",
    [
        ("cuda", "TritonExperts", "TRITON", False, False),
        ("cuda", "TritonExperts", None, False, False),  # bf16 on CUDA: Triton without an FP8 backend
        ("cuda", "TritonOrDeepGemmExperts", "DEEPGEMM", False, True),  # DeepGEMM re-lays out the block scales
        ("cuda", "FlashInferExperts", "FLASHINFER_CUTLASS", False, True),
        ("cuda", "MarlinExperts", "MARLIN", False, True),
        ("cuda", "TrtLlmFp8Experts", "FLASHINFER_TRTLLM", True, True),  # routes inside: never reaches the pager
        ("cuda", "TritonWNA16Experts", None, False, True),  # a Triton subclass with its own weight format
        ("cpu", "CPUUnquantizedExperts", None, False, False),
        ("cpu", "X86CPUUnquantizedExperts", None, False, False),  # the AMX subclass: prepack isa "amx"
        ("cpu", "ArmCPUUnquantizedExperts", None, False, True),  # never run here
        ("cpu", "CPUExpertsFp8", "CPU", False, False),
        ("cpu", "CPUExpertsFp8W8A8", "CPU_W8A8", False, True),  # re-quantizes scales at load
        ("cpu", None, None, False, True),
    ],
)
def test_only_proven_kernels_are_served(platform, experts, backend, monolithic, refused):
    why = vllm_glue.kernel_refusal(platform, experts, backend, monolithic, 7)
    assert (why is not None) == refused
    if refused:
        assert "\n" not in why and "MoE layer 7" in why
        if platform == "cuda":
            assert "--moe-backend triton" in why and (backend or experts or "") in why


def test_the_hint_names_a_backend_vllm_accepts():
    """--moe-backend triton is a value of vLLM's KernelConfig.moe_backend (the CLI flag's type)."""
    from typing import get_args

    from vllm.config.kernel import MoEBackend

    assert "triton" in get_args(MoEBackend)
    assert vllm_glue.MOE_BACKEND_HINT.endswith("--moe-backend triton")


def test_the_real_triton_class_is_the_proven_name():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    for name in vllm_glue.PROVEN_EXPERTS["cpu"]:
        assert hasattr(cpu_moe, name), name
    assert issubclass(cpu_moe.X86CPUUnquantizedExperts, cpu_moe.CPUUnquantizedExperts)  # slot_installer's prepack
    try:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:  # the CPU build may not import Triton's kernels
        pytest.skip("TritonExperts is not importable in this build")
    assert TritonExperts.__name__ in vllm_glue.PROVEN_EXPERTS["cuda"]


def _layer(can_overlap: bool):
    return SimpleNamespace(_moe_index=2, quant_method=SimpleNamespace(mk_can_overlap_shared_experts=can_overlap))


def test_the_shared_expert_stays_with_vllms_runner():
    vllm_glue.check_shared_experts(_layer(False))  # one GPU: MoERunner computes it before or beside the call
    with pytest.raises(EngineModeError, match="expert parallelism"):
        vllm_glue.check_shared_experts(_layer(True))


@pytest.mark.parametrize("fused", [0, 1])
def test_a_shared_expert_fused_into_the_routed_ones_is_refused(fused):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    manager = SimpleNamespace(num_fused_shared_experts=fused)
    assert "num_fused_shared_experts" in ExpertMapManager.__init__.__code__.co_varnames  # vLLM's own field
    if not fused:
        vllm_glue.check_unfused_shared_expert(manager, 3)
        return
    with pytest.raises(EngineModeError, match="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"):
        vllm_glue.check_unfused_shared_expert(manager, 3)


def test_fusion_is_off_on_this_platform():
    """vLLM fuses the shared expert only with ROCm AITER; the CPU (and CUDA) builds never do."""
    from vllm._aiter_ops import rocm_aiter_ops

    assert not rocm_aiter_ops.is_fusion_moe_shared_experts_enabled()


def test_the_shared_expert_rule_is_vllms():
    """vLLM's kernel runs shared experts inside only when prepare/finalize is asynchronous (all2all)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    method = SimpleNamespace(moe_kernel=None)
    assert FusedMoEMethodBase.mk_can_overlap_shared_experts.fget(method) is False


def _engine(text: dict, spec=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**text)), speculative_config=spec
    )


@pytest.mark.parametrize(
    "spec, count",
    [
        (None, 48),
        (SimpleNamespace(method="mtp", num_speculative_tokens=2), 49),
        (SimpleNamespace(method="ngram", num_speculative_tokens=3), 48),
    ],
)
def test_the_mtp_drafter_layers_are_counted_after_the_models(spec, count):
    engine = _engine({"num_hidden_layers": 48, "mtp_num_hidden_layers": 1}, spec)
    assert vllm_glue.paged_layer_count(engine) == count
    assert vllm_glue.speculative_tokens(engine) == (spec.num_speculative_tokens if spec else 0)


def _graphs(sizes: list[int], spec_tokens: int):
    cc = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=sizes,
        max_cudagraph_capture_size=max(sizes),
    )
    cc.adjust_cudagraph_sizes_for_spec_decode(spec_tokens + 1)  # what vLLM does to them with speculative decoding
    return SimpleNamespace(compilation_config=cc)


@pytest.mark.parametrize(
    "sizes, spec, slots, top_k, refused",
    [
        ([1, 2, 4], 0, 40, 10, False),
        ([1, 2, 4, 8], 2, 40, 10, True),  # rounded to [3, 6]: 6 tokens x 10 ids > 40 slots
        ([1, 2, 4], 3, 40, 10, False),  # rounded to [4]: one sequence's verification fits
        ([1, 2, 4, 8], 1, 40, 10, True),  # rounded to [2, 4, 8]: 8 tokens x 10 ids > 40 slots
    ],
)
def test_capture_sizes_count_verification_tokens(sizes, spec, slots, top_k, refused):
    engine = _graphs(sizes, spec)
    if not refused:
        vllm_device.check_graph_sizes(engine, 0, slots, top_k, spec)
        return
    with pytest.raises(EngineModeError) as e:
        vllm_device.check_graph_sizes(engine, 0, slots, top_k, spec)
    assert "\n" not in str(e.value) and f"--max-cudagraph-capture-size {slots // top_k}" in str(e.value)
    assert f"verifies {spec + 1} tokens" in str(e.value)
