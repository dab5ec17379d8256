"""The expert pager inside vLLM: a RoutedExperts whose weights are slot buffers.

vLLM builds every MoE layer's `RoutedExperts`; `install()` makes the process's
PagerProcess and registers `PagedRoutedExperts` in its place (PluggableLayer.register_oot).
The paged layer creates its parameters for S slots instead of E experts, so vLLM's own MoE
kernel runs on the slot buffers with ids remapped to slots; the experts themselves go to
the RAM tier (or stay on SSD) while vLLM loads them. Each layer keeps the PagerProcess
(`layer.process`) it was built in. This module imports vLLM: the plugin imports it only
in an engine process, after checking vLLM's version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
from bigmoe_pager.adapters.vllm import device, glue, process
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.expert_names import ExpertNameError, vllm_decoder_layer
from bigmoe_pager.core.host_pager import HostPager, TierSizes
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.settings import PagerSettings, SettingsError
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


def install(settings: PagerSettings) -> None:
    """Make the process's PagerProcess and register the paged RoutedExperts (once per process)."""
    if "RoutedExperts" in op_registry_oot:
        return
    pager = process.install(settings)
    PluggableLayer.register_oot(PagedRoutedExperts, name="RoutedExperts")
    log.warning("bigmoe: expert pager enabled (%s)", glue.describe(settings, pager.on_device))


def install_replay_only(settings: PagerSettings) -> None:
    """Benchmark only, pager off: every MoE layer routes by BIGMOE_ROUTE_REPLAY, weights as vLLM placed them.

    Lets resident and vLLM-offload runs replay the very routing a paged run replays.
    """
    if "RoutedExperts" in op_registry_oot:
        return
    if settings.trace_path is not None:
        raise SettingsError("BIGMOE_TRACE_PATH records what the pager sees; set BIGMOE_PAGER=1 to record a trace")
    process.install(settings)
    PluggableLayer.register_oot(ReplayRoutedExperts, name="RoutedExperts")
    log.warning("bigmoe: pager off; MoE routing replayed from %s (benchmark switch)", settings.route_replay)


class PagedRoutedExperts(RoutedExperts):
    """RoutedExperts over S slots; a HostPager or DeviceLayerPager keeps the right experts in them."""

    def __init__(self, layer_name, params_dtype, moe_config, quant_config, expert_map_manager, **kwargs):
        vllm_config = get_current_vllm_config()
        proc = process.current()
        settings = proc.settings
        if not proc.on_device:
            glue.require_host_driven_mode(vllm_config)
        num_experts = moe_config.num_experts
        moe_index = proc.next_moe_index()
        glue.check_unfused_shared_expert(expert_map_manager, moe_index)
        num_moe_layers = glue.paged_layer_count(vllm_config)  # the MTP drafter's layers come last
        vram, ram = settings.slots_for(moe_index, num_moe_layers, num_experts)
        if vram < moe_config.experts_per_token:
            raise SettingsError(
                f"BIGMOE_VRAM_SLOTS: layer {moe_index} has {vram} slots but each token uses "
                f"{moe_config.experts_per_token} experts; give at least {moe_config.experts_per_token}"
            )
        if proc.on_device:
            device.check_graph_sizes(
                vllm_config, moe_index, vram, moe_config.experts_per_token, glue.speculative_tokens(vllm_config)
            )
            device.refuse_trace_in_graphs(settings, vllm_config)
        slots = dict(num_experts=vram, num_local_experts=vram, num_logical_experts=vram)
        slot_config = dataclasses.replace(moe_config, **slots)
        super().__init__(layer_name, params_dtype, slot_config, quant_config, expert_map_manager, **kwargs)
        self.process = proc
        self._moe_index = moe_index
        # Ids from the router are expert ids in [0, num_experts); the kernel sees slot ids in [0, vram).
        self._num_experts = num_experts
        if device.on_cuda():
            # vLLM's Triton MoE chooses naive or aligned block assignment from tokens x top-k against the
            # global expert count; with the model's count the paged layer takes the unpaged layer's path
            # (slot ids are < it, so the aligned path's buckets just stay empty above the slots).
            self.global_num_experts = num_experts
        self._full_moe_config = moe_config
        self._decoder_layer = _decoder_layer_index(layer_name)
        self._runners = vllm_config.compilation_config.static_forward_context  # name -> MoERunner (its .gate)
        self._layout = _layout_of(self)
        sizes = TierSizes(experts=num_experts, vram=vram, ram=ram)
        order = proc.warm_order(moe_index, num_experts)
        with glue.host_allocations():
            self._ssd_source = glue.open_source(proc, vllm_config, self._layout, self._decoder_layer, num_experts, ram)
            if proc.on_device:
                self.pager = device.layer_pager(
                    proc.device, self._layout, sizes, moe_index, num_moe_layers, order, settings
                )
            else:
                self.pager = HostPager(
                    layout=self._layout,
                    sizes=sizes,
                    source=proc.host_reads(self._ssd_source),
                    pin=torch.cuda.is_available(),
                    warm_order=order,
                )
        self._ram_param_cache: dict[str, torch.nn.Parameter] = {}
        self._install_slot = None
        self._kernel_checked = False
        proc.add_layer(self)

    def get_expert_mapping(self, *args, **kwargs):
        """Checkpoint names -> params for every expert of the model, not just S of them."""
        slot_config, self.moe_config = self.moe_config, self._full_moe_config
        try:
            return super().get_expert_mapping(*args, **kwargs)
        finally:
            self.moe_config = slot_config

    # ---- loading: experts go to the RAM tier (or stay on SSD), never to the slots ----

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        name = _param_name(self, param)
        if name is None or expert_id is None or not 0 <= int(expert_id) < self._num_experts:
            return super().weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success)
        ram_slot = self.pager.ram_slot_for_load(int(expert_id))
        if ram_slot is not None:
            ram_param = self._ram_param(name, param)
            started = time.perf_counter()
            with _one_copy_thread():
                super().weight_loader(ram_param, loaded_weight, weight_name, shard_id, ram_slot, True)
            self.process.load_copies.add(loaded_weight.nbytes, time.perf_counter() - started)
            self.pager.mark_loaded(int(expert_id), name)
        return True if return_success else None

    weight_loader.supports_moe_loading = True  # as RoutedExperts.weight_loader: models check it on the bound method

    def _ram_param(self, name: str, like: torch.nn.Parameter) -> torch.nn.Parameter:
        if name not in self._ram_param_cache:
            view = self.pager.ram_views()[name]
            ram_param = torch.nn.Parameter(view, requires_grad=False)
            for key, value in vars(like).items():
                if not key.startswith("_"):
                    setattr(ram_param, key, value)
            self._ram_param_cache[name] = ram_param
        return self._ram_param_cache[name]

    # ---- forward: page in, remap, run vLLM's kernel on the slots -----------------

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if shared_experts is not None:
            glue.check_shared_experts(self)  # vLLM's runner computes it outside this call
        # An opaque op: torch.compile must not trace the host-side paging (vLLM's CPU build compiles the MoE call).
        return torch.ops.bigmoe.paged_experts(x, topk_weights, topk_ids, self._moe_index)

    def forward_monolithic(self, *args, **kwargs):
        glue.check_kernel(self)  # a kernel that routes inside never reaches the pager: always refused
        raise glue.EngineModeError(
            f"bigmoe: MoE layer {self._moe_index} runs a monolithic kernel; {glue.MOE_BACKEND_HINT}"
        )

    def paged_forward(self, x, topk_weights, topk_ids):
        """Page in the step's experts (in token chunks that fit the slots) and run vLLM's kernel on the slots."""
        if not self._kernel_checked:
            glue.check_kernel(self)
            self._kernel_checked = True
        topk_ids = self.process.routing.hook(self._moe_index, topk_ids)
        # BIGMOE_PREDICT: the next layer's experts are copied meanwhile
        with self.process.predictor.ahead(self, x, topk_ids.numel()) as turn:
            return self._page_and_run(x, topk_weights, topk_ids, turn)

    def _page_and_run(self, x, topk_weights, topk_ids, turn):
        if isinstance(self.pager, DeviceLayerPager):
            return device.forward(self, x, topk_weights, topk_ids, super().forward_modular, turn)
        if self._install_slot is None:
            self._install_slot = glue.slot_installer(self)
        host_ids = topk_ids.cpu()  # the pager decides on the host; one copy (and sync) per layer and step
        outs = []
        with glue.pinned_kernel_config(self, x.shape[0], x.dtype):
            for rows in self.pager.token_chunks(host_ids):
                slots = self.pager.prepare(host_ids[rows], self._install_slot).to(topk_ids.device, topk_ids.dtype)
                outs.append(super().forward_modular(x[rows], topk_weights[rows], slots))
        self.process.export.export(self)
        return outs[0] if len(outs) == 1 else glue.concat_outputs(outs)


class ReplayRoutedExperts(RoutedExperts):
    """RoutedExperts whose router's top-k ids are replaced by the next rows of a recorded trace (pager off)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.process = process.current()
        self._moe_index = self.process.next_moe_index()
        self.process.add_replay_layer()

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        # An opaque op: torch.compile must not fold the trace cursor's in-place advance away.
        ids = torch.ops.bigmoe.replayed_ids(topk_ids, self._moe_index)
        return super().forward_modular(x, topk_weights, ids, shared_experts, shared_experts_input)


# ---- the opaque ops the layers call (defined once, when this module is imported) ----


@torch.library.custom_op("bigmoe::paged_experts", mutates_args=())
def paged_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    out = process.current().layer(layer).paged_forward(x, topk_weights, topk_ids)
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@paged_experts.register_fake
def _(x, topk_weights, topk_ids, layer):
    return torch.empty_like(x)


@torch.library.custom_op("bigmoe::replayed_ids", mutates_args=())
def replayed_ids(topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
    return process.current().routing.hook(layer, topk_ids).clone()


@replayed_ids.register_fake
def _(topk_ids, layer):
    return torch.empty_like(topk_ids)


@contextlib.contextmanager
def _one_copy_thread():
    """torch's CPU copies on the calling thread alone, its intra-op thread count restored after.

    vLLM 0.33 loads the model with torch's full intra-op thread count (it drops to one only for serving), so each
    1 MiB copy into a RAM record is split over every core, in each of the engines that load at once: on the H200, two
    bigmoe engines copied at about 100 MB/s each (run 8, docs/benchmarks.md). One thread copies 1 MiB in well under a
    millisecond and leaves the other cores to the other engines.
    CUDA engines only: vLLM's CPU worker binds its threads to cores before loading and replaces torch.set_num_threads
    with a call that refuses (and logs a warning), and its own copies there were not slow (1.7 s for 3.1 GB).
    """
    threads = torch.get_num_threads()
    if threads == 1 or not device.on_cuda():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _param_name(layer, param) -> str | None:
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        if getattr(layer, name, None) is param:
            return name
    return None


def _layout_of(layer) -> ExpertLayout:
    """The RAM/SSD record layout: the layer's expert parameters as vLLM creates them, per expert."""
    parts = []
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        p = getattr(layer, name, None)
        if p is not None:
            parts.append((name, tuple(p.shape[1:]), p.dtype))
    return ExpertLayout.build(parts)


def _decoder_layer_index(layer_name: str) -> int:
    try:
        return vllm_decoder_layer(layer_name)
    except ExpertNameError as e:
        raise SettingsError(str(e)) from None
