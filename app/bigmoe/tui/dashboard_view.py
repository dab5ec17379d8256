"""What the dashboard shows, as pure functions of the plan and the polled windows: the running
history for the sparklines, the tier and per-layer tables, the endpoint lines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from bigmoe.run import curl_line

TIER_ORDER = ("vram", "ram", "ssd")
"""Tiers top to bottom (the pager's labels)."""
HISTORY = 120
"""Windows kept for the sparklines (one per poll)."""
BAR_WIDTH = 16
"""Characters of a hit-rate bar."""
OWN_REQUESTS = re.compile(r'"GET /(metrics|health) HTTP')
"""Access-log lines of the dashboard's own polls, left out of the log view (they stay in the file)."""


def log_lines_to_show(lines: list[str]) -> list[str]:
    return [line for line in lines if not OWN_REQUESTS.search(line)]


@dataclass
class History:
    """What the dashboard remembers across polls."""

    tpot_ms: list[float] = field(default_factory=list)
    """TPOT of each window that made tokens (ms)."""
    tokens_per_s: list[float] = field(default_factory=list)
    """tok/s of every window."""
    last_tpot_ms: float | None = None
    """The latest window's TPOT that made tokens (ms)."""
    last_ttft_ms: float | None = None
    """The latest window's TTFT that started requests (ms)."""
    tier_hit: dict[str, float] = field(default_factory=dict)
    """Tier -> hit rate of the latest window that looked it up."""
    layer_hit: dict[str, dict[str, float]] = field(default_factory=dict)
    """Tier -> layer -> hit rate of the latest window that looked that layer up."""
    prefetch_trouble: dict[str, int] = field(default_factory=dict)
    """watch.PREFETCH_SERIES' names -> how many since the dashboard started."""

    def add(self, window) -> None:
        self.tokens_per_s = (self.tokens_per_s + [window.tokens_per_s])[-HISTORY:]
        if window.tpot_ms is not None:
            self.tpot_ms = (self.tpot_ms + [window.tpot_ms])[-HISTORY:]
            self.last_tpot_ms = window.tpot_ms
        if window.ttft_ms is not None:
            self.last_ttft_ms = window.ttft_ms
        self.tier_hit.update(window.hit_rate)
        for tier, layers in window.layer_hit_rate.items():
            self.layer_hit.setdefault(tier, {}).update(layers)
        for name, added in window.prefetch_trouble.items():
            self.prefetch_trouble[name] = self.prefetch_trouble.get(name, 0) + added


def bar(rate: float | None, width: int = BAR_WIDTH) -> Text:
    if rate is None:
        return Text("·" * width, style="dim")
    full = round(max(0.0, min(1.0, rate)) * width)
    return Text("█" * full, style="green") + Text("░" * (width - full), style="dim")


def _pct(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.0%}"


def slots_of(plan, tier: str) -> str:
    """How much of a layer's experts a tier holds under the plan."""
    if tier == "vram":
        return f"{plan.vram_slots}/{plan.experts}"
    if tier == "ram":
        return f"{plan.ram_slots}/{plan.experts}"
    return f"{plan.experts}/{plan.experts}" if plan.ssd_source != "none" else "–"


def tiers_table(history: History, plan) -> Table:
    table = Table(expand=True, show_edge=False, pad_edge=False, box=None)
    table.add_column("tier", style="bold", no_wrap=True)
    table.add_column("slots", justify="right", no_wrap=True)
    table.add_column("hit", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)
    if not plan.pager:
        table.add_row("all", f"{plan.experts}/{plan.experts}", "100%", Text("resident", style="dim"))
        return table
    for tier in TIER_ORDER:
        if tier == "ssd" and plan.ssd_source == "none":
            continue
        rate = history.tier_hit.get(tier)
        table.add_row(tier.upper(), slots_of(plan, tier), _pct(rate), bar(rate))
    return table


def layers_table(history: History, plan) -> Table:
    """Per MoE layer: the residency of each tier (slots of experts) and its latest hit rate."""
    table = Table(expand=True, show_edge=False, pad_edge=False, box=None)
    table.add_column("layer", justify="right", no_wrap=True)
    tiers = [t for t in TIER_ORDER[:2]] if plan.pager else []
    for tier in tiers:
        table.add_column(f"{tier.upper()} {slots_of(plan, tier)}", justify="right", no_wrap=True)
        table.add_column("", no_wrap=True)
    if not plan.pager:
        table.add_column("residency")
        for layer in range(plan.layers):
            table.add_row(str(layer), f"{plan.experts}/{plan.experts} resident")
        return table
    for layer in range(plan.layers):
        cells: list = [str(layer)]
        for tier in tiers:
            rate = history.layer_hit.get(tier, {}).get(str(layer))
            cells += [_pct(rate), bar(rate, 10)]
        table.add_row(*cells)
    return table


def endpoint_text(endpoint: str, model: str, pid: int, plan, api_key: str | None) -> Text:
    text = Text()
    text.append("endpoint ", style="bold")
    text.append(endpoint, style="cyan")
    text.append(f"   model {model}   pid {pid}\n")
    text.append(
        f"plan: {plan.device}, {plan.expert_dtype} experts, {plan.vram_slots} VRAM and {plan.ram_slots} RAM slots of "
        f"{plan.experts} per layer, compress {'on' if plan.compress else 'off'}, context {plan.context}\n",
        style="dim",
    )
    text.append(curl_line(endpoint, model, api_key))
    return text


def speed_title(history: History) -> str:
    tpot = "–" if history.last_tpot_ms is None else f"{history.last_tpot_ms:.2f} ms"
    ttft = "–" if history.last_ttft_ms is None else f"{history.last_ttft_ms:.0f} ms"
    trouble = history.prefetch_trouble
    waits, late = trouble.get("prefetch_waits_given_up", 0), trouble.get("prefetch_late_drains", 0)
    told = f"  prefetch: {waits} waits gave up, {late} late copies" if waits or late else ""
    return f"TPOT {tpot}  (TTFT {ttft}){told}"


def rate_title(history: History) -> str:
    now = history.tokens_per_s[-1] if history.tokens_per_s else None
    peak = max(history.tokens_per_s, default=None)
    return f"tok/s {'–' if now is None else f'{now:.1f}'}  (peak {'–' if peak is None else f'{peak:.1f}'})"
