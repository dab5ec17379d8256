"""BIGMOE_PREFETCH_DISTANCE: in a joinless forward, layer l's round prefetches into layer l+D, so its copies have D
layers of compute to land in; the model's first layer also fills layers 1 .. D-1. Here in Triton's interpreter
(every launch runs to its end in order), with replayed and live proposals, copied by kernels or by the host copier:
every later layer gets exactly one round a forward, made on the right layer's state, each decided before its step,
and every expert's slot holds that expert's bytes. tests/gpu/test_round_sync_gpu.py runs joinless forwards on the GPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.prediction import LivePredictions
from bigmoe_pager.core.round_sync import DECIDED
from test_forward_rounds import host_copies_waited_for
from test_live_predictor import EXPERTS
from test_pager import make_layout, make_records
from test_prefetch_chain import captured_model, run_forwards
from test_step_kernel import slot_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds


def rounds_fed(monkeypatch, layers) -> list[tuple[int | None, int]]:
    """(the MoE index a round must follow, the MoE index it prefetches into) of every round fed from now on."""
    index_of = {id(layer.pager): layer._moe_index for layer in layers}
    fed: list[tuple[int | None, int]] = []
    plain_feed, plain_feed_ids = LivePredictions.feed, LivePredictions.feed_ids

    def feed(self, hidden, next_router, top_p, next_pager=None, after=None):
        if next_pager is not None:
            fed.append((after, index_of[id(next_pager)]))
        return plain_feed(self, hidden, next_router, top_p, next_pager, after)

    def feed_ids(self, make_ids, next_pager, source, after=None):
        fed.append((after, index_of[id(next_pager)]))
        return plain_feed_ids(self, make_ids, next_pager, source, after)

    monkeypatch.setattr(LivePredictions, "feed", feed)
    monkeypatch.setattr(LivePredictions, "feed_ids", feed_ids)
    return fed


def assert_every_slot_holds_its_expert(layers) -> None:
    layout = make_layout(False)
    records = make_records(layout, EXPERTS, seed=7)  # what test_live_predictor.model loads into every layer
    for layer in layers:
        pager = layer.pager.pager
        held = slot_bytes(pager)
        for expert, slot in enumerate(pager.vram.expert_slot.tolist()):
            if slot < 0:
                continue
            for c in layout.components:
                want = records[expert, c.offset : c.offset + c.nbytes]
                assert torch.equal(held[c.name][slot][: c.nbytes], want), (layer._moe_index, expert, slot, c.name)


@pytest.mark.parametrize("copies", ["kernel", "host"])
@pytest.mark.parametrize("proposals", ["replayed", "live"])
@pytest.mark.parametrize("distance,layers_n", [(2, 5), (3, 5), (2, 2)])
def test_rounds_d_layers_ahead_fill_every_later_layer_once_and_keep_every_slot_right(
    tmp_path: Path, monkeypatch, distance, layers_n, proposals, copies
):
    forwards = 3
    trace = traces.named_trace("topic-shift", 64, layers_n, EXPERTS, 2)
    predicted = traces.predictions(trace, 0.8, 0.5, EXPERTS) if proposals == "replayed" else None
    traces.save_trace(tmp_path / "r.npz", trace, predicted)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    served = host_copies_waited_for(monkeypatch) if copies == "host" else []
    env = {
        "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
        "BIGMOE_PREFETCH_DISTANCE": str(distance),
        "BIGMOE_PREFETCH_HOST_COPIER": "1" if copies == "host" else "0",
        **({"BIGMOE_PREDICT": "router"} if proposals == "live" else {}),
    }
    layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
    fed = rounds_fed(monkeypatch, layers)
    run_forwards(live, layers, routing, 1)  # eager: the flags are made, one round a layer into the next
    assert fed == [(None, i + 1) for i in range(layers_n - 1)]
    capturing[0] = True
    fed.clear()
    served.clear()
    run_forwards(live, layers, routing, forwards)

    first = [(0, target) for target in range(1, min(distance, layers_n - 1) + 1)]
    later = [(source, source + distance) for source in range(1, layers_n - distance)]
    assert fed == (first + later) * forwards  # each later layer once a forward, from layer target - distance
    claims = [int(layer.pager.pager.vram.kernel_state()["claim"]) for layer in layers]
    assert claims[1:] == [forwards * 4 + DECIDED] * (layers_n - 1)  # decided before its step, in every forward
    assert live._chain.timeouts == 0 and live.chain_cancels == 0 and not live.live.chained
    counts = [stats.snapshot(i)["vram"] for i in range(layers_n)]
    assert sum(c.prefetched for c in counts) > 0
    assert_every_slot_holds_its_expert(layers)
    if copies == "host":
        assert len(served) == live.copier.stats()["rounds"] == forwards * (layers_n - 1)
        live.copier.close()


def test_the_one_node_kernel_keeps_the_next_layer_and_says_so(tmp_path: Path, caplog):
    trace = traces.named_trace("standard", 16, 3, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    env = {
        "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
        "BIGMOE_PREFETCH_DISTANCE": "2",
        "BIGMOE_PREFETCH_ONE_NODE": "1",
    }
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        _, _, _, live = captured_model(env, 3, admit_kernel=True)
    assert live.distance == 1 and live.joinless
    assert [r.message for r in caplog.records if "BIGMOE_PREFETCH_DISTANCE" in r.message] == [
        "bigmoe: BIGMOE_PREFETCH_DISTANCE=2 is not built into the one-node kernel (BIGMOE_PREFETCH_ONE_NODE=1); "
        "its rounds prefetch into the next layer"
    ]


@pytest.mark.parametrize("raw,distance", [("0", 1), ("1", 1), ("4", 4)])
def test_a_distance_of_zero_or_one_is_the_next_layer_and_more_implies_joinless(tmp_path: Path, raw, distance):
    _, _, _, live = captured_model({"BIGMOE_PREFETCH_DISTANCE": raw}, 2)
    assert live.distance == distance and live.joinless == (distance > 1)
