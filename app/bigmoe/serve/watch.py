"""watch: poll vLLM's /metrics and turn counter and histogram deltas into windowed rates.

TPOT, TTFT and tok/s come from vLLM's own series; tier hit rates from the
pager's `bigmoe_expert_*` series (exported through prometheus_client's
multiprocess mode, so they appear in the same /metrics), and the chained
prefetch's trouble from its `bigmoe_prefetch_*` counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

TPOT_SERIES = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
)
TTFT_SERIES = "vllm:time_to_first_token_seconds"
TOKENS_SERIES = "vllm:generation_tokens_total"
PREFETCH_SERIES = {
    "bigmoe_prefetch_chain_timeouts_total": "prefetch_waits_given_up",
    "bigmoe_prefetch_late_drains_total": "prefetch_late_drains",
}
"""The pager's chained-prefetch counters (no labels) -> their names in a Window: waits that gave up (about a second
each) and forwards that ended with a host copy still under way (every third holds prefetch back a while)."""
MIN_WINDOW_S = 1.0
"""Shortest window rates are reported over (s): a rate over milliseconds is noise (a first window of 1e-9 s
once read 3.2e10 tok/s)."""


@dataclass
class Sample:
    """Totals read from one scrape (sums in seconds, counts in events)."""

    time: float
    """Monotonic time of the scrape (s)."""
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tokens: float = 0.0
    lookups: dict[tuple[str, str], float] = field(default_factory=dict)
    """(layer, tier) -> expert lookups."""
    hits: dict[tuple[str, str], float] = field(default_factory=dict)
    """(layer, tier) -> expert hits."""
    prefetch: dict[str, float] = field(default_factory=dict)
    """PREFETCH_SERIES' window name -> its total."""


@dataclass(frozen=True)
class Window:
    """Rates over the time between two scrapes."""

    seconds: float
    """Length of the window (s)."""
    tpot_ms: float | None
    """Mean time per output token in the window (ms); None when no token was made."""
    ttft_ms: float | None
    """Mean time to first token of requests that started in the window (ms)."""
    tokens_per_s: float
    """Generated tokens per second."""
    hit_rate: dict[str, float]
    """Tier -> hits / lookups in the window, over all layers."""
    layer_hit_rate: dict[str, dict[str, float]]
    """Tier -> layer -> hit rate in the window."""
    prefetch_trouble: dict[str, int] = field(default_factory=dict)
    """PREFETCH_SERIES' window names -> how many the window added, those that grew only."""

    @property
    def idle(self) -> bool:
        """No token made, no request started and no expert looked up in the window."""
        return self.tpot_ms is None and self.ttft_ms is None and self.tokens_per_s == 0 and not self.hit_rate

    def summary(self) -> dict:
        """The window's rates, each only when the window measured it (no `None` fields)."""
        out: dict = {"window_s": round(self.seconds, 1)}
        if self.tpot_ms is not None:
            out["tpot_ms"] = round(self.tpot_ms, 3)
        if self.ttft_ms is not None:
            out["ttft_ms"] = round(self.ttft_ms, 1)
        out["tok_per_s"] = round(self.tokens_per_s, 2)
        return out | {f"hit_{tier}": round(rate, 4) for tier, rate in self.hit_rate.items()} | self.prefetch_trouble


def parse(text: str, now: float) -> Sample:
    sample = Sample(time=now)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, value = s.name, s.value
            if name.endswith("_sum") and name[:-4] in TPOT_SERIES and _preferred(name[:-4], text):
                sample.tpot_sum += value
            elif name.endswith("_count") and name[:-6] in TPOT_SERIES and _preferred(name[:-6], text):
                sample.tpot_count += value
            elif name == TTFT_SERIES + "_sum":
                sample.ttft_sum += value
            elif name == TTFT_SERIES + "_count":
                sample.ttft_count += value
            elif name == TOKENS_SERIES:
                sample.tokens += value
            elif name == "bigmoe_expert_lookups_total":
                key = (s.labels.get("layer", "?"), s.labels.get("tier", "?"))
                sample.lookups[key] = sample.lookups.get(key, 0.0) + value
            elif name == "bigmoe_expert_hits_total":
                key = (s.labels.get("layer", "?"), s.labels.get("tier", "?"))
                sample.hits[key] = sample.hits.get(key, 0.0) + value
            elif name in PREFETCH_SERIES:
                sample.prefetch[PREFETCH_SERIES[name]] = value
    return sample


def _preferred(series: str, text: str) -> bool:
    """Use the first TPOT series this vLLM exports, so none is counted twice."""
    for candidate in TPOT_SERIES:
        if candidate + "_count" in text:
            return candidate == series
    return False


def window(old: Sample, new: Sample) -> Window:
    """Rates between two scrapes; ValueError for a window shorter than MIN_WINDOW_S."""
    dt = new.time - old.time
    if dt < MIN_WINDOW_S:
        raise ValueError(f"a window of {dt:.3f} s is too short for rates (at least {MIN_WINDOW_S} s)")
    d_tpot_n = new.tpot_count - old.tpot_count
    d_ttft_n = new.ttft_count - old.ttft_count
    tiers: dict[str, list[float]] = {}
    per_layer: dict[str, dict[str, float]] = {}
    for key, lookups in new.lookups.items():
        d_lookups = lookups - old.lookups.get(key, 0.0)
        d_hits = new.hits.get(key, 0.0) - old.hits.get(key, 0.0)
        layer, tier = key
        acc = tiers.setdefault(tier, [0.0, 0.0])
        acc[0] += d_hits
        acc[1] += d_lookups
        if d_lookups > 0:
            per_layer.setdefault(tier, {})[layer] = d_hits / d_lookups
    return Window(
        seconds=dt,
        tpot_ms=(new.tpot_sum - old.tpot_sum) / d_tpot_n * 1e3 if d_tpot_n > 0 else None,
        ttft_ms=(new.ttft_sum - old.ttft_sum) / d_ttft_n * 1e3 if d_ttft_n > 0 else None,
        tokens_per_s=(new.tokens - old.tokens) / dt,
        hit_rate={tier: h / n for tier, (h, n) in tiers.items() if n > 0},
        layer_hit_rate=per_layer,
        prefetch_trouble={
            k: int(v - old.prefetch.get(k, 0.0)) for k, v in new.prefetch.items() if v > old.prefetch.get(k, 0.0)
        },
    )


class Watcher:
    """Scrapes /metrics; each poll() returns the window since the previous one it measured over."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        self.url = endpoint.rstrip("/") + "/metrics"
        self.client = httpx.Client(timeout=timeout_s)
        self.last: Sample | None = None

    def scrape(self) -> Sample:
        response = self.client.get(self.url)
        response.raise_for_status()
        return parse(response.text, time.monotonic())

    def poll(self) -> Window | None:
        """The window since the last poll, or None when there is none yet: the first scrape is the baseline,
        and a poll sooner than MIN_WINDOW_S after it keeps waiting (the baseline stays)."""
        new = self.scrape()
        if self.last is None:
            self.last = new
            return None
        if new.time - self.last.time < MIN_WINDOW_S:
            return None
        old, self.last = self.last, new
        return window(old, new)
