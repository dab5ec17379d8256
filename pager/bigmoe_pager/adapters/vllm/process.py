"""The one object that holds what the expert pager keeps in a vLLM process.

`install(settings)` runs once per process, from the plugin's entry point, before vLLM
builds the model: it makes the PagerProcess from the settings the plugin read (the only
read of the environment in this process) and decides there whether paging is
device-driven. vLLM then builds each MoE layer; the paged layer takes the process at
construction and keeps it (`layer.process`), so everything a layer needs is reachable
from it. The custom op a layer's forward runs through finds the layer by MoE index in
`current()`, the one module-level reference.

The process owns: the settings; the paged layers in build order (the n-th built is MoE
layer n); the SSD stores the layers read, and the I/O workers of host-driven reads; the
routing trace and replay; the host copier thread (adapters.vllm.host_copies); the live
next-layer predictor; the counters' Prometheus
export; and, when paging is device-driven, the per-process device parts (counter table,
its pinned mirror, the shared whole-layer buffer, the SSD service and the exporter
thread), which start at the first forward (vLLM's profile run: after loading, before
any CUDA graph capture).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

from bigmoe_pager.adapters.vllm import glue, stats
from bigmoe_pager.adapters.vllm.device import DeviceParts, wanted
from bigmoe_pager.adapters.vllm.host_copies import HostCopies
from bigmoe_pager.adapters.vllm.predictor import Predictor
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.adapters.vllm.ssd_source import SsdStores
from bigmoe_pager.core import step_kernel
from bigmoe_pager.core.timed_reads import TimedReads
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


@dataclass
class LoadCopies:
    """What vLLM's weight loader copied into this process's RAM records while the model loaded."""

    nbytes: int = 0
    """Checkpoint bytes copied (expert weights and their scales)."""
    seconds: float = 0.0
    """Time spent inside those weight_loader calls."""

    def add(self, nbytes: int, seconds: float) -> None:
        self.nbytes += nbytes
        self.seconds += seconds

    def describe(self) -> str:
        """One clause for the start line ('' when nothing was copied: every expert stayed on SSD)."""
        if not self.nbytes:
            return ""
        gib, rate = self.nbytes / 2**30, self.nbytes / max(self.seconds, 1e-9) / 1e9
        return f"; loading copied {gib:.2f} GiB of experts into RAM in {self.seconds:.1f} s ({rate:.2f} GB/s)"


class PagerProcess:
    """The expert pager's state in one vLLM process; made once by `install`."""

    def __init__(self, settings: PagerSettings, on_device: bool):
        self.settings = settings
        """Read once when the plugin loaded; every part of the pager takes them from here."""
        self.on_device = on_device
        """Device-driven paging (the GPU decides, decode in CUDA graphs); else host-driven."""
        self.stores = SsdStores(read_retries=settings.read_retries)
        """The SSD tier's open stores (checkpoint or paging file), shared by the layers."""
        self.routing = Routing(settings)
        """Routing trace (BIGMOE_TRACE_PATH) and replay (BIGMOE_ROUTE_REPLAY)."""
        self.host_copies = HostCopies(settings)
        """The host copier thread that prefetch rounds may hand copies to (made at first use)."""
        self.predictor = Predictor(settings, self.routing, self.layer_after, on_device, host_copies=self.host_copies)
        """The live next-layer predictor (BIGMOE_PREDICT)."""
        self.export = stats.CounterExport()
        """The counters' Prometheus series (multiprocess mode, so they reach vLLM's /metrics)."""
        self.reads: TimedReads | None = None
        """I/O workers of host-driven SSD reads (made with the first layer that has an SSD tier)."""
        self.load_copies = LoadCopies()
        """vLLM's loader copies into the RAM records (reported when paging starts)."""
        self.device = DeviceParts() if on_device else None
        """Counter table, whole-layer buffer, SSD service and exporter of device-driven paging."""
        self._layers: list = []
        self._replay_layers = 0
        self._hot_profiles: dict[int, object] = {}  # per expert count: the checked BIGMOE_HOT_PROFILE, or None
        self._lock = threading.Lock()

    def warm_order(self, moe_index: int, num_experts: int) -> list[int] | None:
        """A layer's experts hottest first from the saved profile (read and checked once), or None."""
        with self._lock:
            if num_experts not in self._hot_profiles:
                self._hot_profiles[num_experts] = glue.load_hot_profile(self.settings, num_experts)
            profile = self._hot_profiles[num_experts]
        return glue.warm_order(profile, moe_index)

    def host_reads(self, source):
        """A host-driven layer's SSD source read through the process's I/O workers, with the settings' deadline
        and retries (None stays None: every expert has a RAM record)."""
        if source is None:
            return None
        with self._lock:
            if self.reads is None:
                s = self.settings
                self.reads = TimedReads(s.io_workers, s.read_timeout_s, s.read_retries)
        return self.reads.source(source)

    # ---- the MoE layers, in build order ----------------------------------------------

    def next_moe_index(self) -> int:
        """MoE layers are built in order; the n-th built is MoE layer n."""
        with self._lock:
            return len(self._layers) + self._replay_layers

    def add_layer(self, layer) -> None:
        with self._lock:
            self._layers.append(layer)

    def add_replay_layer(self) -> None:
        """A routing-replay layer takes the next MoE index (it pages nothing, so it is not in layers())."""
        with self._lock:
            self._replay_layers += 1

    def layer(self, moe_index: int):
        return self._layers[moe_index]

    def layer_after(self, moe_index: int):
        """The paged layer moe_index + 1, or None (the last layer, or layers that page nothing)."""
        return next((l for l in self.layers() if l._moe_index == moe_index + 1), None)

    def layers(self) -> list:
        """The paged layers built so far, by MoE index."""
        with self._lock:
            return list(self._layers)


_installed: PagerProcess | None = None
_install_lock = threading.Lock()


def install(settings: PagerSettings) -> PagerProcess:
    """The process's PagerProcess, made from `settings` at the first call (later calls return it)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = PagerProcess(settings, on_device=wanted(settings))
            set_gil_switch(settings)
        return _installed


def set_gil_switch(settings: PagerSettings) -> None:
    """BIGMOE_GIL_SWITCH_US (a benchmark knob): this process's GIL switch interval, with one line saying so."""
    if settings.gil_switch_us > 0:
        sys.setswitchinterval(settings.gil_switch_us / 1e6)
        log.warning("bigmoe: GIL switch interval %d us (BIGMOE_GIL_SWITCH_US)", settings.gil_switch_us)


def current() -> PagerProcess | None:
    """The process's PagerProcess, or None when the expert pager was not installed here."""
    return _installed


def pager_stats() -> dict[str, dict[str, float]]:
    """Counters of this process's paged layers, summed per tier (empty when the pager is off here)."""
    return stats.pager_stats(_installed.layers() if _installed is not None else [])


def engine_facts() -> dict:
    """What benchmark reports carry per engine beside the counters: where captures forked and joined the prefetch
    (and chained waits that gave up), and what the loader copied into RAM (bytes, seconds); empty when the pager is
    off here."""
    if _installed is None:
        return {}
    copies = _installed.load_copies
    return {
        "prefetch_joins": _installed.predictor.join_placements,
        "prefetch_forks": _installed.predictor.fork_placements,
        "prefetch_chain_timeouts": _installed.predictor.chain_timeouts,
        "prefetch_chain_cancels": _installed.predictor.chain_cancels,
        "prefetch_chain_late": _installed.predictor.chain_late,
        "prefetch_host_copier": _installed.host_copies.stats,
        "step_kernels": dict(step_kernel.COMPILED),
        "load_copy_bytes": copies.nbytes,
        "load_copy_s": round(copies.seconds, 2),
    }


def experts_kernel_name() -> str | None:
    """Class name of the MoE kernel vLLM runs on this process's paged layers (None: pager off here)."""
    return stats.experts_kernel_name(_installed.layers() if _installed is not None else [])
