"""Pager counters: device adds without sync, host adds from threads, one snapshot."""

from __future__ import annotations

import threading

import pytest
import torch
from bigmoe_pager.adapters.vllm.stats import CounterExport
from bigmoe_pager.core.stats import PagerStats, StatsError
from prometheus_client import CollectorRegistry


def test_device_and_host_adds_sum_in_snapshots():
    stats = PagerStats(num_layers=2)
    stats.tier(0, "vram").add(lookups=torch.tensor(8), hits=torch.tensor(6), misses=2, bytes=torch.tensor(200))
    stats.tier(0, "vram").add(lookups=torch.tensor(8), hits=torch.tensor(8))
    stats.row(1, "ram")[1] += 5
    workers = [
        threading.Thread(target=lambda: [stats.tier(1, "ssd").add_host(read_ns=10, retries=1) for _ in range(100)])
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    layer0 = stats.snapshot(0)
    assert (layer0["vram"].lookups, layer0["vram"].hits, layer0["vram"].misses, layer0["vram"].bytes) == (
        16,
        14,
        2,
        200,
    )
    assert layer0["vram"].hit_rate == pytest.approx(14 / 16)
    total = stats.snapshot()
    assert total["ssd"].read_ns == 4000 and total["ssd"].retries == 400 and total["ram"].hits == 5
    assert total["ram"].hit_rate is None  # no lookups: no rate, not a made-up one
    stats.reset()
    assert stats.read().sum() == 0


@pytest.mark.parametrize(
    "call", [lambda s: s.tier(0, "disk"), lambda s: s.tier(0, "vram").add(hitz=1), lambda s: s.row(0, "l2")]
)
def test_unknown_names_are_refused(call):
    with pytest.raises(StatsError):
        call(PagerStats(1))


def test_the_chained_prefetch_s_counts_reach_their_series_as_deltas():
    """What the export thread adds each period from Predictor.chain_seen: the counts' growth since its last call (the
    chain's words only grow), nothing before a forward was chained."""
    registry = CollectorRegistry()
    export = CounterExport(registry)

    def totals():
        return [registry.get_sample_value(f"bigmoe_prefetch_{n}_total") for n in ("chain_timeouts", "late_drains")]

    export.export_chain(None)
    assert totals() == [0.0, 0.0]
    for seen, want in [
        ((1, 0, 0), [1.0, 0.0]),
        ((3, 5, 2), [3.0, 2.0]),
        ((3, 5, 2), [3.0, 2.0]),
        ((4, 5, 3), [4.0, 3.0]),
    ]:
        export.export_chain(dict(zip(("timeouts", "cancels", "late"), seen)))
        assert totals() == want
