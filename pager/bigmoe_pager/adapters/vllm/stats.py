"""Counters of the paged layers of this process: summed for callers in-process, and
exported as Prometheus series (multiprocess mode) so they reach vLLM's /metrics."""

from __future__ import annotations

from bigmoe_pager.core.prefetch_chain import LATE_LIMIT

SERIES = {
    "lookups": ("bigmoe_expert_lookups", "Experts looked up in a tier"),
    "hits": ("bigmoe_expert_hits", "Experts found in a tier"),
    "bytes_moved": ("bigmoe_expert_bytes", "Bytes moved out of a tier into the one above"),
    "read_seconds": ("bigmoe_expert_read_seconds", "Seconds spent reading from a tier"),
    "errors": ("bigmoe_expert_errors", "Failed reads from a tier"),
    "prefetched": ("bigmoe_expert_prefetched", "Experts copied into a tier ahead of need"),
    "prefetch_used": ("bigmoe_expert_prefetch_used", "Prefetched experts the step they were fetched for needed"),
    "prefetch_wasted_bytes": ("bigmoe_expert_prefetch_wasted_bytes", "Bytes of prefetched experts no step needed"),
    "prefetch_late": ("bigmoe_expert_prefetch_late", "Needed prefetched experts whose copy the step waited for"),
    "hurried": ("bigmoe_expert_reads_hurried", "Reads ahead a step waited for before they started, moved up the queue"),
}
"""The pager's Prometheus counters (labels: layer, tier): TierCounters field -> (series name, help)."""

CHAIN_SERIES = {
    "timeouts": ("bigmoe_prefetch_chain_timeouts", "Waits of the chained prefetch that gave up, about a second each"),
    "late": (
        "bigmoe_prefetch_late_drains",
        f"Forwards that ended with a host copy still under way; each {LATE_LIMIT}th holds prefetch back a while",
    ),
}
"""The chained prefetch's Prometheus counters (no labels): PrefetchChain.seen_counts key -> (series name, help)."""


class CounterExport:
    """The process's Prometheus series, made at the first export (None when prometheus_client is missing)."""

    def __init__(self, registry=None) -> None:
        self._registry = registry
        """Where the series register; None: prometheus_client's default registry, the one vLLM's /metrics serves."""
        self._made = False
        self._series: dict | None = None
        self._chain_before = dict.fromkeys(CHAIN_SERIES, 0)

    def export(self, layer, tiers: dict | None = None) -> None:
        """Add this layer's counter deltas to the pager's Prometheus series.

        tiers: the layer's counters per tier if already read (device-driven layers), else layer.pager.stats.
        """
        series = self._counters()
        if series is None:
            return
        last = getattr(layer, "_exported", None)
        if last is None:
            last = layer._exported = {}
        label = str(layer._moe_index)
        for tier, c in (tiers if tiers is not None else layer.pager.stats).items():
            now = tuple(getattr(c, field) for field in SERIES)
            before = last.get(tier, (0,) * len(SERIES))
            for key, new, old in zip(SERIES, now, before):
                if new != old:
                    series[key].labels(layer=label, tier=tier).inc(new - old)
            last[tier] = now

    def export_chain(self, seen: dict[str, int] | None) -> None:
        """Add the chained prefetch's counts since the last call (Predictor.chain_seen; None: no forward was chained,
        nothing to add) to their series."""
        series = self._counters()
        if series is None or seen is None:
            return
        for key in CHAIN_SERIES:
            if seen[key] > self._chain_before[key]:
                series["chain", key].inc(seen[key] - self._chain_before[key])
                self._chain_before[key] = seen[key]

    def _counters(self) -> dict | None:
        """Every series, keyed by SERIES' keys and ("chain", CHAIN_SERIES' key)."""
        if self._made:
            return self._series
        self._made = True
        try:
            from prometheus_client import REGISTRY, Counter
        except ImportError:
            return None
        registry = REGISTRY if self._registry is None else self._registry
        series = {key: Counter(name, doc, ["layer", "tier"], registry=registry) for key, (name, doc) in SERIES.items()}
        for key, (name, doc) in CHAIN_SERIES.items():
            series["chain", key] = Counter(name, doc, registry=registry)
        self._series = series
        return self._series


def pager_stats(layers: list) -> dict[str, dict[str, float]]:
    """Counters of the paged layers, summed per tier (empty without layers)."""
    totals: dict[str, dict[str, float]] = {}
    for paged in layers:
        for tier, c in paged.pager.stats.items():
            t = totals.setdefault(tier, dict.fromkeys(SERIES, 0))
            for field in SERIES:
                t[field] += getattr(c, field)
    return totals


def experts_kernel_name(layers: list) -> str | None:
    """Class name of the MoE kernel vLLM runs on the paged layers' slots (None without layers)."""
    first = layers[0] if layers else None
    if first is None:
        return None
    kernel = getattr(first.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return type(experts if experts is not None else first.quant_method).__name__
