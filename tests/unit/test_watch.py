"""Windowed TPOT, TTFT, tok/s and tier hit rates from two /metrics scrapes."""

from __future__ import annotations

import pytest
from bigmoe.headless import stats_line
from bigmoe.serve.watch import MIN_WINDOW_S, Watcher, parse, window


def scrape(tpot_sum, tpot_n, ttft_sum, ttft_n, tokens, vram_lookups, vram_hits, ram_lookups, ram_hits) -> str:
    return f"""# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {tpot_n}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {tpot_n}
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {tpot_sum}
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_count{{engine="0",model_name="m"}} 999
vllm:request_time_per_output_token_seconds_sum{{engine="0",model_name="m"}} 999
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {ttft_n}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {ttft_sum}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
# HELP bigmoe_expert_lookups_total Experts looked up in a tier
# TYPE bigmoe_expert_lookups_total counter
bigmoe_expert_lookups_total{{layer="0",tier="vram"}} {vram_lookups / 2}
bigmoe_expert_lookups_total{{layer="1",tier="vram"}} {vram_lookups / 2}
bigmoe_expert_lookups_total{{layer="0",tier="ram"}} {ram_lookups}
# HELP bigmoe_expert_hits_total Experts found in a tier
# TYPE bigmoe_expert_hits_total counter
bigmoe_expert_hits_total{{layer="0",tier="vram"}} {vram_hits / 2}
bigmoe_expert_hits_total{{layer="1",tier="vram"}} {vram_hits / 2}
bigmoe_expert_hits_total{{layer="0",tier="ram"}} {ram_hits}
"""


def test_window_from_deltas():
    old = parse(scrape(1.0, 100, 0.5, 10, 1000, 400, 300, 100, 60), now=10.0)
    new = parse(scrape(1.5, 200, 0.9, 12, 1100, 800, 700, 100, 60), now=15.0)
    w = window(old, new)
    assert w.tpot_ms == pytest.approx(5.0)  # 0.5 s over 100 tokens, from the first TPOT series only
    assert w.ttft_ms == pytest.approx(200.0)
    assert w.tokens_per_s == pytest.approx(20.0)
    assert w.hit_rate == {"vram": pytest.approx(1.0)}  # ram tier saw no lookups in the window
    assert w.layer_hit_rate["vram"] == {"0": pytest.approx(1.0), "1": pytest.approx(1.0)}


def test_idle_window_has_no_latency():
    a = parse(scrape(1.0, 100, 0.5, 10, 1000, 400, 300, 100, 60), now=1.0)
    w = window(a, parse(scrape(1.0, 100, 0.5, 10, 1000, 400, 300, 100, 60), now=2.0))
    assert w.tpot_ms is None and w.ttft_ms is None and w.tokens_per_s == 0 and w.hit_rate == {}
    assert w.idle
    assert "tpot_ms" not in w.summary() and None not in w.summary().values()


IDLE = (1.0, 100, 0.5, 10, 1000, 400, 300, 100, 60)
BUSY = (1.5, 200, 0.9, 12, 1100, 800, 700, 100, 60)


class FakeScrapes(Watcher):
    """A Watcher whose scrapes are given (text, monotonic time) pairs instead of HTTP answers."""

    def __init__(self, scrapes):
        self.last = None
        self.scrapes = iter(scrapes)

    def scrape(self):
        text, now = next(self.scrapes)
        return parse(text, now)


def test_first_poll_is_a_baseline_and_short_windows_report_no_rate():
    watcher = FakeScrapes(
        [(scrape(*IDLE), 100.0), (scrape(*BUSY), 100.000000001), (scrape(*BUSY), 100.5), (scrape(*BUSY), 105.0)]
    )
    assert watcher.poll() is None  # no window yet: the first scrape is the baseline
    assert watcher.poll() is None  # 1e-9 s: once read tok_per_s=3.2e10
    assert watcher.poll() is None  # still shorter than MIN_WINDOW_S; the baseline stays
    w = watcher.poll()
    assert w.seconds == pytest.approx(5.0) and w.tokens_per_s == pytest.approx(20.0)


def test_window_shorter_than_the_minimum_is_refused():
    a = parse(scrape(*IDLE), now=1.0)
    with pytest.raises(ValueError, match="too short"):
        window(a, parse(scrape(*BUSY), now=1.0 + MIN_WINDOW_S / 2))


def polls(windows):
    """A watcher stand-in whose poll() hands out `windows` in order."""
    it = iter(windows)
    return type("W", (), {"poll": lambda self: next(it)})()


def test_idle_server_prints_its_state_once_then_only_changes():
    idle = window(parse(scrape(*IDLE), now=0.0), parse(scrape(*IDLE), now=10.0))
    busy = window(parse(scrape(*IDLE), now=0.0), parse(scrape(*BUSY), now=10.0))
    lines = []
    watcher, was_idle = polls([None, idle, idle, idle, busy, idle, idle]), False
    for _ in range(7):
        was_idle = stats_line(watcher, lambda event, fields: lines.append(fields), was_idle)
    assert lines[0] == {"state": "idle"} and lines[2] == {"state": "idle"} and len(lines) == 3
    assert lines[1]["tok_per_s"] == pytest.approx(10.0) and lines[1]["tpot_ms"] == pytest.approx(5.0)
    assert all(None not in line.values() for line in lines)


def with_prefetch(text: str, waits: float, late: float) -> str:
    """A scrape with the pager's chained-prefetch counters (adapters.vllm.stats.CHAIN_SERIES) added."""
    return text + (
        "# HELP bigmoe_prefetch_chain_timeouts_total Waits of the chained prefetch that gave up\n"
        "# TYPE bigmoe_prefetch_chain_timeouts_total counter\n"
        f"bigmoe_prefetch_chain_timeouts_total {waits}\n"
        "# HELP bigmoe_prefetch_late_drains_total Forwards that ended with a host copy still under way\n"
        "# TYPE bigmoe_prefetch_late_drains_total counter\n"
        f"bigmoe_prefetch_late_drains_total {late}\n"
    )


@pytest.mark.parametrize(
    "before,after,told",
    [
        ((0, 0), (0, 0), {}),  # a healthy window says nothing of prefetch
        ((1, 0), (4, 3), {"prefetch_waits_given_up": 3, "prefetch_late_drains": 3}),
        ((4, 3), (5, 3), {"prefetch_waits_given_up": 1}),
    ],
)
def test_a_window_tells_the_prefetch_trouble_it_saw_and_the_dashboard_keeps_count(before, after, told):
    """Waits that gave up (about a second each) and late host copies (every third holds prefetch back a while) are
    what a user of chained prefetch needs to see beside the TPOT they explain: in the headless stats line and the
    dashboard's TPOT title, only when there were any."""
    from bigmoe.tui.dashboard_view import History, speed_title

    old = parse(with_prefetch(scrape(*IDLE), *before), now=10.0)
    new = parse(with_prefetch(scrape(*BUSY), *after), now=15.0)
    w = window(old, new)
    assert w.prefetch_trouble == told
    assert {k: v for k, v in w.summary().items() if k.startswith("prefetch")} == told
    history = History()
    history.add(w)
    history.add(w)
    title = speed_title(history)
    if told:
        waits, late = (2 * told.get(k, 0) for k in ("prefetch_waits_given_up", "prefetch_late_drains"))
        assert title.endswith(f"prefetch: {waits} waits gave up, {late} late copies")
    else:
        assert "prefetch" not in title
