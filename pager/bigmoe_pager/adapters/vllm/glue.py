"""What the paged RoutedExperts needs from around it: layer numbering, the engine
mode it can serve, the SSD source, the kernel's slot layout and tile config
(routing trace/replay: routing.py; counters: stats.py; what the process holds: process.py).
Imports vLLM only inside functions that run in an engine process; where vLLM
builds differ (CPU 0.32/0.33, CUDA 0.25), the difference lives in one named
function here."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

import torch
from bigmoe_pager import model_config
from bigmoe_pager.core.host_pager import InstallSlot
from bigmoe_pager.core.hot_profile import HotProfile, ProfileError
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.settings import PagerSettings, SettingsError

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


class EngineModeError(RuntimeError):
    """vLLM runs in a mode the host-driven pager cannot serve; the message is one line."""


def describe(settings: PagerSettings, on_device: bool) -> str:
    vram = ",".join(map(str, settings.vram_slots)) or "all"
    ram = ",".join(map(str, settings.ram_slots)) or "all"
    if on_device:
        mode = (
            "device-driven paging: decode runs in CUDA graphs for batches whose tokens x top-k fit the VRAM slots "
            "(--max-cudagraph-capture-size); bigger steps run outside graphs, in token chunks; "
            f"{settings.eviction} eviction"
        )
    else:
        mode = "host-driven paging: on CUDA it needs --enforce-eager"
    if not settings.ram_slots:
        return f"VRAM slots {vram}, every expert in RAM (no SSD tier); {mode}"
    source = str(settings.paging_file) if settings.paging_file else "the checkpoint in place"
    codec = {True: "on", False: "off", None: "as the paging file was written"}[settings.use_codec()]
    return f"VRAM slots {vram}, RAM slots {ram}, SSD tier reads {source}, codec {codec}; {mode}"


def require_host_driven_mode(vllm_config) -> None:
    """Refuse CUDA graphs on CUDA: the pager decides on the host each step (.tolist()), which a graph cannot replay.

    vLLM's CPU build has no CUDA graphs (its compiled model calls the pager through an opaque op).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        raise EngineModeError(
            f"bigmoe: the expert pager pages from the host each step and cannot run inside CUDA graphs "
            f"(cudagraph_mode={getattr(mode, 'name', mode)}); "
            "start vLLM with --enforce-eager (LLM(enforce_eager=True)), "
            "or BIGMOE_CUDA_GRAPHS=1 for the device-driven pager, which runs in graphs"
        )


def host_allocations():
    """A context in which tensors made without a device land on the CPU.

    vLLM builds the model under `with torch.device(<accelerator>)`, so a RAM tier or a
    read buffer allocated there without a device would land in GPU memory.
    """
    return torch.device("cpu")


def moe_layer_count(hf_config) -> int:
    return model_config.moe_layer_count(hf_config) or 0


def paged_layer_count(vllm_config) -> int:
    """MoE layers this process builds: the model's, then the MTP draft's when vLLM's speculative method is MTP.

    vLLM builds the target model first and the MTP drafter after it in the same worker
    (gpu_model_runner.load_model), so the drafter's MoE layers take the last indices.
    """
    text = vllm_config.model_config.hf_text_config
    spec = getattr(vllm_config, "speculative_config", None)
    mtp = getattr(spec, "method", None) == "mtp" and bool(getattr(spec, "num_speculative_tokens", 0))
    return moe_layer_count(text) + (model_config.mtp_layer_count(text) if mtp else 0)


def speculative_tokens(vllm_config) -> int:
    """Draft tokens per sequence and step (0 without speculative decoding); a verification step has this + 1."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


# ---- which MoE kernel vLLM chose ------------------------------------------------------

PROVEN_EXPERTS = {
    "cuda": ("TritonExperts",),
    "cpu": ("CPUUnquantizedExperts", "X86CPUUnquantizedExperts", "CPUExpertsFp8"),
}
"""MoE kernels (vLLM's experts class, exact name) the pager is proven token-identical with, per platform.
CUDA: Triton keeps w13/w2 and their block scales as the checkpoint has them, so a raw record is a slot.
CPU: the kernels whose per-expert prepack slot_installer reproduces: the portable vector one, its AMX subclass
(vLLM picks it on CPUs with AMX tiles; prepack isa "amx") and FP8's."""

MOE_BACKEND_HINT = "start vLLM with --moe-backend triton"
"""vLLM 0.33's KernelConfig.moe_backend (CLI --moe-backend) that selects Triton's FP8/bf16 MoE kernel."""


def kernel_refusal(
    platform: str, experts_class: str | None, backend: str | None, monolithic: bool, moe_index: int
) -> str | None:
    """Why the pager must not run over this MoE kernel (one line), or None when it is a proven one.

    platform: "cuda" or "cpu"; experts_class: type name of the kernel's fused experts; backend: the
    FP8 backend vLLM picked (quant_method.fp8_backend), if any; monolithic: kernels that route inside
    (forward_monolithic), which never pass through the paged forward.
    """
    proven = PROVEN_EXPERTS.get(platform, ())
    if not monolithic and experts_class in proven:
        return None
    chosen = experts_class or "no modular kernel"
    if backend:
        chosen = f"the {backend} backend ({chosen})"
    hint = MOE_BACKEND_HINT if platform == "cuda" else "set BIGMOE_PAGER=0 on this CPU"
    inside = ", which routes inside the kernel" if monolithic else ""
    return (
        f"bigmoe: vLLM runs MoE layer {moe_index} with {chosen}{inside}; "
        f"the expert pager is proven only with {', '.join(proven) or 'no kernel on ' + platform}, "
        f"whose weights keep the checkpoint's layout; {hint}"
    )


def check_kernel(layer) -> None:
    """Refuse, at the first forward (vLLM's profile run, before serving), a MoE kernel the pager is not proven with."""
    from vllm.platforms import current_platform

    method = layer.quant_method
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    backend = getattr(method, "fp8_backend", None)
    why = kernel_refusal(
        "cuda" if current_platform.is_cuda() else "cpu" if current_platform.is_cpu() else "other",
        type(experts).__name__ if experts is not None else None,
        getattr(backend, "value", backend),
        bool(getattr(method, "is_monolithic", False)),
        layer._moe_index,
    )
    if why is None and getattr(experts, "_use_zentorch", False):
        why = (
            f"bigmoe: vLLM runs MoE layer {layer._moe_index} with zentorch's CPU kernel, which the pager is not "
            "proven with; set BIGMOE_PAGER=0"
        )
    if why is not None:
        raise EngineModeError(why)
    if layer._moe_index == 0:
        log.warning(
            "bigmoe: MoE layers run vLLM's %s (%s backend)",
            type(experts).__name__,
            getattr(backend, "value", backend) or "default",
        )


def check_unfused_shared_expert(expert_map_manager, moe_index: int) -> None:
    """Refuse a shared expert fused into the routed experts (an extra expert every token uses).

    vLLM 0.32/0.33 fuses it only with ROCm AITER (fused_moe/utils.py resolve_layer_fused_shared_expert,
    rocm_aiter_ops.is_fusion_moe_shared_experts_enabled); on CUDA and CPU the shared expert stays a
    separate MLP that vLLM's runner computes.
    """
    fused = int(getattr(expert_map_manager, "num_fused_shared_experts", 0) or 0)
    if fused:
        raise EngineModeError(
            f"bigmoe: vLLM fused {fused} shared expert(s) into MoE layer {moe_index}'s routed "
            "experts; the pager pages routed experts only: set "
            "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"
        )


def check_shared_experts(layer) -> None:
    """The paged call must not compute the shared expert: vLLM's runner does, unless the kernel overlaps it.

    vLLM (0.32/0.33) hands `shared_experts` to every routed-experts call of a layer that has one, but the
    modular kernel only runs it inside when its prepare/finalize is asynchronous (expert-parallel
    all2all: `mk_can_overlap_shared_experts`); otherwise MoERunner runs it before the call or on its
    side stream. So with one GPU the paged op drops it; with an overlapping kernel it is refused.
    """
    if getattr(layer.quant_method, "mk_can_overlap_shared_experts", False):
        raise EngineModeError(
            f"bigmoe: MoE layer {layer._moe_index}'s kernel computes the shared expert inside the "
            "routed call (expert-parallel all2all); the expert pager serves one GPU without expert "
            "parallelism: drop --enable-expert-parallel and data parallelism"
        )


# ---- the SSD tier -------------------------------------------------------------------


def open_source(process, vllm_config, layout: ExpertLayout, decoder_layer: int, experts: int, ram: int):
    """The SSD source for one layer (from the process's stores), or None when every expert has a RAM record."""
    if ram >= experts:
        return None
    settings = process.settings
    model_dir = Path(vllm_config.model_config.model)
    if settings.paging_file is not None:
        return process.stores.paging_file_source(
            settings.paging_file, model_dir, layout, decoder_layer, experts, settings.use_codec()
        )
    return process.stores.checkpoint_source(model_dir, layout, decoder_layer)


def load_hot_profile(settings: PagerSettings, num_experts: int) -> HotProfile | None:
    """The saved hot-expert profile the settings name, read and checked (None when none is named)."""
    if settings.hot_profile is None:
        return None
    try:
        return HotProfile.load(settings.hot_profile, num_experts=num_experts)
    except ProfileError as e:
        raise SettingsError(f"BIGMOE_HOT_PROFILE: {e}") from None


def warm_order(profile: HotProfile | None, moe_index: int) -> list[int] | None:
    """Experts in order of heat from a saved profile (hottest first), to fill RAM at load."""
    if profile is None or moe_index >= profile.num_layers:
        return None  # no profile, or a layer it did not see (the MTP drafter's, say): filled in expert order
    return [int(e) for e in profile.hottest(moe_index)]


# ---- kernel slots -----------------------------------------------------------------------


def slot_installer(layer) -> InstallSlot:
    """Writes one expert's raw record into kernel slot s, in the layout the kernel expects.

    vLLM's CPU kernel prepacks weights after loading; one expert prepacked alone
    gives exactly that expert's slice of the prepacked tensor, so page-in
    prepacks the expert. Other kernels read the raw layout: on CUDA (vLLM 0.25,
    Hopper) block-FP8 experts run the Triton kernel, whose weight processing keeps
    w13/w2 and their *_weight_scale_inv scales as the checkpoint has them.
    """
    prepack = _cpu_prepack(layer)
    params = {name: getattr(layer, name) for name in layer._layout._by_name}
    # Without an SSD tier a RAM record never changes after loading, so a copy from it may still be in
    # flight when the host moves on. With one, a later read may overwrite the record: copy synchronously.
    asynchronous = layer.pager.source is None and all(p.is_cuda for p in params.values())

    def install(slot: int, views: dict[str, torch.Tensor]) -> None:
        for name, param in params.items():
            src = views[name]
            if prepack is not None and name in ("w13_weight", "w2_weight"):
                src = prepack(name, src)
            param.data[slot].copy_(src, non_blocking=asynchronous)

    return install


def pinned_kernel_config(layer, num_tokens: int, dtype: torch.dtype):
    """A context in which vLLM's Triton MoE kernel tiles every chunk as it tiles the unpaged layer's step.

    The Triton kernel picks BLOCK_SIZE_M/N, swap-AB, warps and stages from a table keyed by
    (experts, intermediate) and the call's token count. The paged layer has S experts and
    may split the step into chunks, so it would get other tiles than the resident layer; its
    per-token arithmetic then may round differently. Forcing the config vLLM picks for all E
    experts at the step's token count keeps each output row's arithmetic the same (activation
    quantization, both GEMMs and the top-k sum are per token). Other kernels: no change.
    """
    experts = _triton_experts(layer)
    if experts is None:
        return contextlib.nullcontext()
    from vllm.model_executor.layers.fused_moe import override_config
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    full = layer._num_experts
    w13 = (full, *layer.w13_weight.shape[1:])
    w2 = (full, *layer.w2_weight.shape[1:])
    config = try_get_optimal_moe_config(
        w13, w2, layer.top_k, experts.quant_config.config_name(dtype), num_tokens, block_shape=experts.block_shape
    )
    return override_config(config)


def _triton_experts(layer):
    """vLLM's TritonExperts behind this layer's MoE kernel, or None (CPU kernels, other backends)."""
    kernel = getattr(layer.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    # Not imported here: a build that never loaded the Triton experts (vLLM's CPU build) has none.
    module = sys.modules.get("vllm.model_executor.layers.fused_moe.experts.triton_moe")
    if experts is None or module is None:
        return None
    return experts if isinstance(experts, module.TritonExperts) else None


def _cpu_prepack(layer):
    kernel = getattr(layer.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8, CPUUnquantizedExperts
    except ImportError:
        return None
    if isinstance(experts, CPUExpertsFp8):
        # FP8 on CPU (AMX): VNNI-packed per expert; the block scales stay as loaded.
        return lambda name, weight: torch.ops._C.convert_weight_packed(weight.unsqueeze(0).contiguous())[0]
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    isa = experts.isa
    padded = layer.w13_weight.shape[1] // 2

    def prepack(name: str, weight: torch.Tensor) -> torch.Tensor:
        w = weight.unsqueeze(0)
        inter = w.shape[1] // 2 if name == "w13_weight" else w.shape[2]
        if inter != padded:
            w = _pad_intermediate(name, w, inter, padded)
        return cpu_prepack_moe_weight(w.contiguous(), isa)[0]

    return prepack


def _pad_intermediate(name: str, w: torch.Tensor, inter: int, padded: int) -> torch.Tensor:
    if name == "w13_weight":
        out = w.new_zeros(1, 2 * padded, w.shape[2])
        out[:, :inter] = w[:, :inter]
        out[:, padded : padded + inter] = w[:, inter:]
        return out
    out = w.new_zeros(1, w.shape[1], padded)
    out[:, :, :inter] = w
    return out


def concat_outputs(outs: list):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0)
    if isinstance(first, tuple):
        return tuple(None if parts[0] is None else torch.cat(parts, dim=0) for parts in zip(*outs))
    raise RuntimeError(
        f"bigmoe: cannot split a batch whose MoE output is {type(first).__name__}; raise BIGMOE_VRAM_SLOTS"
    )
