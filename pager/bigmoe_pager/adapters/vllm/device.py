"""The paged layer's device-driven mode: on CUDA the GPU decides and copies, and decode replays in CUDA graphs.

A decode step whose top-k ids fit in the VRAM slots (batch x top-k <= slots)
pages with one fused kernel per layer and no host sync, so vLLM captures it in
its CUDA graphs (FULL and PIECEWISE). vLLM only captures batches up to
max_cudagraph_capture_size tokens; the plugin refuses to start when that times
top-k exceeds a layer's slots. Bigger steps (prefill, large batches) run outside
graphs: the ids are read on the host once and the step is cut into token ranges,
or (BIGMOE_PREFILL_BUFFER=1) the kernel runs once over a VRAM buffer of the whole
layer, filled with the experts the step needs.

Around the layers, per process (DeviceParts, held by the PagerProcess): the SSD service (one for every layer, built at
the first forward, after loading), and a thread that exports the counters to
Prometheus every second and stops the server if an SSD read failed for good
(a replayed graph cannot raise; the failed step's output must not be trusted).
That thread makes no CUDA call: vLLM captures graphs in the global capture mode,
where any CUDA call from another thread invalidates the capture (seen on the
H200); the last MoE layer's step copies the counters to page-locked host memory.

The default on CUDA (BIGMOE_CUDA_GRAPHS=0 selects the host-driven pager). On the
H200 it is token- and logprob-identical to the unpaged model under CUDA graphs, in
every tier mix, once vLLM itself is made reproducible (docs/pager.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
from bigmoe_pager.adapters.vllm import glue
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_copier import HostCopierError
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.pinned import pinned_empty
from bigmoe_pager.core.prefetch_chain import forwards_held, hold_backs
from bigmoe_pager.core.ram_tier import ServiceFetch
from bigmoe_pager.core.ssd_service import SsdError, SsdService
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")

EXPORT_PERIOD_S = 1.0  # seconds between counter exports and SSD health checks


class DeviceParts:
    """What device-driven paging keeps once per process, beside its layers."""

    def __init__(self) -> None:
        self.stats: PagerStats | None = None
        """Counters of every paged layer, one table on the CUDA device (made with the first layer)."""
        self.mirror: torch.Tensor | None = None
        """Page-locked host copy of `stats`: the last layer's step copies the table there (a graph replays the
        copy), so the exporter thread reads plain memory and never calls CUDA, which would break a capture in
        progress on the engine's thread."""
        self.last_layer = 0
        """MoE index of the last paged layer (its step refreshes the mirror)."""
        self.layer_buffer: dict[str, torch.Tensor] | None = None
        """One buffer of every expert of a layer, shared by all paged layers (BIGMOE_PREFILL_BUFFER=1)."""
        self.ssd: SsdService | None = None
        """The SSD service over every layer whose RAM tier is partial (None without an SSD tier)."""
        self.started = False
        """Whether the first forward has started slots, SSD service and exporter."""
        self.layers: list = []
        """The device-driven layers, once started."""
        self.exporter: threading.Thread | None = None
        self.told_hold_backs = 0
        """The prefetch rounds' hold-backs the exporter has logged (held_back_line)."""
        self.lock = threading.Lock()


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def wanted(settings: PagerSettings) -> bool:
    """Device-driven paging: on CUDA, unless the settings' rule picks the host-driven pager (PagerSettings.host_driven,
    the rule the app's plan also follows). Off CUDA: the host-driven pager, proven token-identical in eager mode."""
    return on_cuda() and not settings.host_driven


def check_graph_sizes(vllm_config, moe_index: int, slots: int, top_k: int, spec_tokens: int = 0) -> None:
    """Refuse CUDA graphs captured for batches whose ids can outnumber this layer's slots.

    vLLM's capture sizes count tokens, and with speculative decoding a verification step already
    counts spec_tokens + 1 per sequence (config/vllm.py _set_cudagraph_sizes, compilation.py
    adjust_cudagraph_sizes_for_spec_decode), so tokens x top-k is the bound either way; spec_tokens
    only shapes the advice.
    """
    cc = vllm_config.compilation_config
    mode = getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode))
    biggest = max(cc.cudagraph_capture_sizes or [0])
    if mode == "NONE" or biggest * top_k <= slots:
        return
    fit = max(1, slots // top_k)
    spec = (
        f"; with {spec_tokens} speculative tokens each sequence verifies {spec_tokens + 1} tokens, so that is "
        f"at most {fit // (spec_tokens + 1)} sequence(s) per graph"
        if spec_tokens
        else ""
    )
    raise glue.EngineModeError(
        f"bigmoe: vLLM captures CUDA graphs for batches of up to {biggest} tokens ({biggest * top_k} expert ids), "
        f"more than MoE layer {moe_index}'s {slots} VRAM slots; start vLLM with "
        f"--max-cudagraph-capture-size {fit} (or more VRAM slots, or --enforce-eager){spec}"
    )


def refuse_trace_in_graphs(settings: PagerSettings, vllm_config) -> None:
    mode = vllm_config.compilation_config.cudagraph_mode
    if settings.trace_path is not None and getattr(mode, "name", str(mode)) != "NONE":
        raise glue.EngineModeError(
            "bigmoe: BIGMOE_TRACE_PATH reads each step's routing on the host, which CUDA "
            "graphs cannot replay; record traces with --enforce-eager"
        )


def layer_pager(
    parts: DeviceParts,
    layout,
    sizes: TierSizes,
    moe_index: int,
    num_moe_layers: int,
    warm_order,
    settings: PagerSettings,
) -> DeviceLayerPager:
    """The layer's pager; its counters live in the process's one table on the current CUDA device.

    With BIGMOE_SSD_READ_AHEAD and a partial RAM tier, its predictions (a replayed trace's, through
    routing.py) also post SSD reads, so the RAM tier and the SSD service are built for posting."""
    device = torch.device("cuda", torch.cuda.current_device())
    with parts.lock:
        if parts.stats is None:
            parts.stats = PagerStats(max(num_moe_layers, moe_index + 1), device)
            parts.mirror = pinned_empty(tuple(parts.stats.device_counts.shape), torch.int64)
            parts.mirror.zero_()
        parts.last_layer = max(parts.last_layer, moe_index)
    return DeviceLayerPager(
        layout,
        sizes,
        device,
        layer=moe_index,
        stats=parts.stats,
        warm_order=warm_order,
        policy=settings.eviction,
        read_ahead=reads_ahead(settings, sizes),
        read_ahead_layers=max(1, settings.ssd_read_ahead_layers),
        prefetch_gate=settings.prefetch_min_used_percent,
        prefetch_budget=settings.prefetch_budget,
    )


def reads_ahead(settings: PagerSettings, sizes: TierSizes) -> bool:
    """Whether a layer posts SSD reads for predicted experts: asked for, and some experts live only on SSD."""
    return settings.ssd_read_ahead and sizes.ram < sizes.experts


def forward(layer, x, topk_weights, topk_ids, kernel, turn=None):
    """Page the step's experts in and run vLLM's kernel (kernel(x, weights, slot ids)) on the slots.

    turn: Predictor.ahead's Turn (None: no predictor): turn() runs once a step that fits the slots has
    issued its paging, before the kernel (the next layer's prefetch then overlaps this kernel, not these
    copies); a step that fits publishes itself to turn.chain (a chained forward's rounds).
    """
    process = layer.process
    parts: DeviceParts = process.device
    pager: DeviceLayerPager = layer.pager
    if not pager.started:
        start_all(process, topk_ids.dtype)
    if layer._moe_index == parts.last_layer:
        parts.mirror.copy_(pager.stats_table.device_counts, non_blocking=True)  # one step behind; fine for counters
    with glue.pinned_kernel_config(layer, x.shape[0], x.dtype):
        if pager.fits(topk_ids):  # captured, or run eagerly (then the step has settled its SSD reads)
            slot_ids = pager.step(topk_ids, None if turn is None else turn.chain)
            if turn is not None:
                turn()
            return kernel(x, topk_weights, slot_ids)
        if torch.cuda.is_current_stream_capturing():
            raise glue.EngineModeError(
                f"bigmoe: a CUDA graph is being captured for {topk_ids.shape[0]} tokens, whose ids can outnumber "
                f"the {pager.sizes.vram} VRAM slots; lower --max-cudagraph-capture-size"
            )
        _check_ssd(parts)
        if process.settings.prefill_buffer:
            return _whole_layer_step(parts, layer, x, topk_weights, topk_ids, kernel)
        return _chunked_step(pager, x, topk_weights, topk_ids, kernel)


def _chunked_step(pager: DeviceLayerPager, x, topk_weights, topk_ids, kernel):
    """A big step in token ranges whose experts fit the slots.

    Each range's paging has settled (`DeviceLayerPager.step`) before vLLM's kernel is called:
    that call can block on the GPU holding the GIL, which the SSD reads' host threads need.
    """
    outs = []
    for rows in pager.token_chunks(topk_ids):
        slot_ids = pager.step(topk_ids[rows])
        outs.append(kernel(x[rows], topk_weights[rows], slot_ids))
    return outs[0] if len(outs) == 1 else glue.concat_outputs(outs)


def _whole_layer_step(parts: DeviceParts, layer, x, topk_weights, topk_ids, kernel):
    """A big step over one buffer of all E experts: the needed ones copied in, vLLM's kernel run with the router's ids.

    The layer's parameters point at the buffer for the call (kernels read them when launched), so the
    kernel sees what the unpaged layer has: E experts, expert ids, the same token count and tiles.
    """
    buffers = _layer_buffer(parts, layer)
    layer.pager.fill_layer_buffer(topk_ids, buffers)
    params = {name: getattr(layer, name) for name in buffers}
    slots = {name: p.data for name, p in params.items()}
    try:
        for name, p in params.items():
            p.data = buffers[name]
        return kernel(x, topk_weights, topk_ids)
    finally:
        for name, p in params.items():
            p.data = slots[name]


def _layer_buffer(parts: DeviceParts, layer) -> dict[str, torch.Tensor]:
    """One buffer of every expert of a layer, shared by all paged layers of the process (same shapes)."""
    with parts.lock:
        if parts.layer_buffer is None:
            slots = {name: getattr(layer, name) for name in layer._layout._by_name}
            parts.layer_buffer = {name: p.new_empty((layer._num_experts, *p.shape[1:])) for name, p in slots.items()}
        return parts.layer_buffer


def start_all(process, id_dtype: torch.dtype) -> None:
    """After loading, at the first forward (vLLM's profile run, outside graphs): SSD tier, slots, warm VRAM, the
    kernels of eager steps compiled (id_dtype: the router's ids, as this forward has them), exporter."""
    parts: DeviceParts = process.device
    with parts.lock:
        if parts.started:
            return
        layers = [l for l in process.layers() if isinstance(l.pager, DeviceLayerPager)]
        fetchers = _ssd_fetchers(parts, layers, process.settings)
        for paged in layers:
            buffers = {name: getattr(paged, name).data for name in paged._layout._by_name}
            paged.pager.start(buffers, fetchers.get(paged._moe_index))
        torch.cuda.synchronize()
        warm_s = _warm_kernels(process, layers, id_dtype)
        parts.started = True
        parts.layers = layers
    _start_exporter(process)
    log.warning(
        "bigmoe: device-driven paging started for %d MoE layers%s%s; eager steps' kernels compiled in %.1f s",
        len(layers),
        " with an SSD tier" if fetchers else "",
        process.load_copies.describe(),
        warm_s,
    )


def _warm_kernels(process, layers: list, id_dtype: torch.dtype) -> float:
    """Each layer's inert steps of each size with kernel variants of its own (DeviceLayerPager.warm_kernels): in the
    router's id dtype and in int64 (the whole-layer buffer's groups), with the predictor's proposals where it runs.
    Returns the seconds taken."""
    start = time.monotonic()
    predictor = process.predictor
    for paged in layers:
        width = (predictor.top or paged.moe_config.experts_per_token) if predictor.on else 0
        paged.pager.warm_kernels((id_dtype, torch.int64), predict_width=width)
    return time.monotonic() - start


def _ssd_fetchers(parts: DeviceParts, layers: list, settings: PagerSettings) -> dict[int, ServiceFetch]:
    """One SsdService over every layer whose RAM tier is partial; its fetch per MoE layer index."""
    partial = [l for l in layers if l._ssd_source is not None]
    if not partial:
        return {}
    store = partial[0]._ssd_source.store
    rows: dict[int, torch.Tensor] = {}
    sinks: dict[int, object] = {}
    for paged in layers:
        store_layer = paged._ssd_source.layer if paged._ssd_source is not None else paged._moe_index
        rows[store_layer] = paged.pager.ram.records
        sinks[store_layer] = parts.stats.tier(paged._moe_index, "ssd")
    # Store layers no paged layer reads (the checkpoint's MTP head with speculative decoding off) get no RAM
    # slots; every paged layer found its own store layer by decoder layer number (ssd_source._moe_layer).
    unread = partial[0].pager.ram.records.new_empty((0, *partial[0].pager.ram.records.shape[1:]))
    for i in range(store.num_layers):
        rows.setdefault(i, unread)
        sinks.setdefault(i, None)
    service = SsdService.from_settings(
        store,
        [rows[i] for i in range(store.num_layers)],
        settings,
        sinks=[sinks[i] for i in range(store.num_layers)],
        read_ahead=settings.ssd_read_ahead,  # entries for posted reads; layers post only when partial
    )
    parts.ssd = service
    if service.native:
        log.info("bigmoe: SSD reads are answered by C threads (native reader, %d workers)", settings.io_workers)
    elif service.box is not None and settings.ssd_reader == "native":
        log.warning("bigmoe: BIGMOE_SSD_READER=native, but Python threads answer SSD reads: %s", service.reader_note)
    return {l._moe_index: ServiceFetch(service, l._ssd_source.layer) for l in partial}


def _check_ssd(parts: DeviceParts) -> None:
    if parts.ssd is not None:
        parts.ssd.check()


def _start_exporter(process) -> None:
    parts: DeviceParts = process.device
    if parts.exporter is not None:
        return
    parts.exporter = threading.Thread(target=_export_loop, args=(process,), name="bigmoe-export", daemon=True)
    parts.exporter.start()


def failed_part(process) -> str | None:
    """Why the server must stop now, in one line (None: nothing failed): an SSD read failed (a step would compute
    without its expert), or the host copier's thread stopped copying (every step would wait about a second for each
    prefetched slot it needs, then copy it itself)."""
    service = process.device.ssd
    if service is not None and service.failed:
        stop = "stopping the server rather than serving steps computed without it"
        try:
            service.check()
        except SsdError as e:
            return f"an expert could not be read from SSD ({e}); {stop}"
        return f"the SSD tier failed; {stop}"
    copier = process.host_copies.copier
    if copier is not None:
        try:
            copier.check()
        except HostCopierError as e:
            return f"{e}; stopping the server rather than serving every step at the pace of its timeouts"
    return None


def held_back_line(seen: dict[str, int] | None, told: int) -> str | None:
    """The line a server logs when its prefetch rounds hold back again (core.prefetch_chain: every LATE_LIMIT late
    drains), None while `told` hold-backs are all there were (or no forward was chained)."""
    if seen is None or hold_backs(seen) <= told:
        return None
    left = forwards_held(seen)  # (0 where the export thread read the words after the hold-back's forwards)
    until = f"for the next {left} forwards and " if left else ""
    return (
        f"bigmoe: prefetch holds back (hold-back {hold_backs(seen)}): {seen['late']} forwards have ended with a host "
        "copy still under way (the host copier's copies are not landing beside the kernels); experts are paged on "
        f"demand, with the same tokens, {until}until every late copy has landed, then prefetch resumes"
    )


def _export_loop(process) -> None:
    """Every EXPORT_PERIOD_S: stop the server if the SSD tier or the host copier failed; add counter deltas to the
    Prometheus series; say when the prefetch rounds hold back."""
    parts: DeviceParts = process.device
    stats: PagerStats = parts.stats
    mirror = parts.mirror.numpy()
    while True:
        time.sleep(EXPORT_PERIOD_S)
        failure = failed_part(process)
        if failure is not None:
            log.error("bigmoe: %s", failure)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if parts.ssd is not None:
            parts.ssd.collect()  # the native reader's counters into the host counts
        with stats.lock:
            counts = mirror + stats.host_counts
        for paged in parts.layers:
            process.export.export(paged, paged.pager.counters(counts))
        seen = process.predictor.chain_seen
        process.export.export_chain(seen)
        held_back = held_back_line(seen, parts.told_hold_backs)
        if held_back is not None:
            parts.told_hold_backs = hold_backs(seen)
            log.warning(held_back)
