"""Counters of the paged layers of this process: summed for callers in-process, and
exported as Prometheus series (multiprocess mode) so they reach vLLM's /metrics."""

from __future__ import annotations

from bigmoe_pager.adapters.vllm_glue import all_layers

_counters: dict[str, object] = {}


def pager_stats() -> dict[str, dict[str, float]]:
    """Counters of every paged layer of this process, summed per tier (empty when the pager is off)."""
    layers = all_layers()
    totals: dict[str, dict[str, float]] = {}
    for paged in layers:
        for tier, c in paged.pager.stats.items():
            t = totals.setdefault(tier, {"lookups": 0, "hits": 0, "bytes_moved": 0, "read_seconds": 0.0, "errors": 0})
            t["lookups"] += c.lookups
            t["hits"] += c.hits
            t["bytes_moved"] += c.bytes_moved
            t["read_seconds"] += c.read_seconds
            t["errors"] += c.errors
    return totals


def experts_kernel_name() -> str | None:
    """Class name of the MoE kernel vLLM runs on the slots of this process's paged layers (None: pager off)."""
    layers = all_layers()
    first = layers[0] if layers else None
    if first is None:
        return None
    kernel = getattr(first.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return type(experts if experts is not None else first.quant_method).__name__


def export_stats(layer, tiers: dict | None = None) -> None:
    """Add this layer's counter deltas to the pager's Prometheus series (multiprocess mode).

    tiers: the layer's counters per tier if already read (device-driven layers), else layer.pager.stats.
    """
    counters = _prometheus()
    if counters is None:
        return
    last = getattr(layer, "_exported", None)
    if last is None:
        last = layer._exported = {}
    label = str(layer._moe_index)
    for tier, c in (tiers if tiers is not None else layer.pager.stats).items():
        now = (c.lookups, c.hits, c.bytes_moved, c.read_seconds, c.errors)
        before = last.get(tier, (0, 0, 0, 0.0, 0))
        for series, new, old in zip(("lookups", "hits", "bytes", "read_seconds", "errors"), now, before):
            if new != old:
                counters[series].labels(layer=label, tier=tier).inc(new - old)
        last[tier] = now


def _prometheus():
    if "ready" in _counters:
        return _counters.get("series")
    _counters["ready"] = True
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    labels = ["layer", "tier"]
    _counters["series"] = {
        "lookups": Counter("bigmoe_expert_lookups", "Experts looked up in a tier", labels),
        "hits": Counter("bigmoe_expert_hits", "Experts found in a tier", labels),
        "bytes": Counter("bigmoe_expert_bytes", "Bytes moved out of a tier into the one above", labels),
        "read_seconds": Counter("bigmoe_expert_read_seconds", "Seconds spent reading from a tier", labels),
        "errors": Counter("bigmoe_expert_errors", "Failed reads from a tier", labels),
    }
    return _counters["series"]
