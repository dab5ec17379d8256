"""BIGMOE_PREFETCH_DISTANCE: in a joinless forward, layer l's round prefetches into layer l+D, so its copies have D
layers of compute to land in; the model's first layer also fills layers 1 .. D-1. Here in Triton's interpreter
(every launch runs to its end in order), with replayed and live proposals, copied by kernels or by the host copier:
every later layer gets exactly one round a forward, made on the right layer's state, each decided before its step,
and every expert's slot holds that expert's bytes. The one-node kernel (BIGMOE_PREFETCH_ONE_NODE) decides the same
rounds at the same distance. tests/gpu/test_round_sync_gpu.py runs joinless forwards two layers ahead on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.forward_rounds import ForwardRounds, ForwardRoundsError
from bigmoe_pager.core.prediction import LivePredictions, replayed_predictions
from bigmoe_pager.core.prefetch_chain import TIMEOUTS
from bigmoe_pager.core.round_sync import DECIDED
from test_forward_rounds import chain_at, host_copies_waited_for, layers_twice, recorded_launches, replay_and_capture
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
    run_forwards(live, layers, routing, 1)  # eager: the flags are made; no round (BIGMOE_PREFETCH_CHAINED_ONLY unset)
    assert fed == []
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


@pytest.mark.parametrize("distance", [2, 3])
def test_a_replayed_round_decides_the_same_at_any_distance(tmp_path: Path, monkeypatch, distance):
    """Only layer l's own step and round touch layer l's table, and a replayed round proposes the same rows from any
    earlier step of the forward: so in order (the interpreter) rounds D layers ahead decide and copy exactly what
    next-layer rounds do. The distance changes when a round runs, never what it does."""
    layers_n, forwards = 5, 3
    trace = traces.named_trace("topic-shift", 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    results = []
    for d in (1, distance):
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREFETCH_JOINLESS": "1",
            "BIGMOE_PREFETCH_DISTANCE": str(d),
        }
        layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
        capturing[0] = False
        run_forwards(live, layers, routing, 1)
        capturing[0] = True
        run_forwards(live, layers, routing, forwards)
        assert live._chain.timeouts == 0 and live.chain_cancels == 0
        results.append(
            (
                [stats.snapshot(i)["vram"] for i in range(layers_n)],
                [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
            )
        )
    (near_counts, near_layers), (far_counts, far_layers) = results
    assert near_counts == far_counts and sum(c.prefetched for c in far_counts) > 0
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(near_layers, far_layers):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)


@pytest.mark.parametrize("host", [False, True])
def test_one_node_rounds_at_a_distance_decide_what_per_layer_rounds_do(tmp_path: Path, monkeypatch, host):
    """BIGMOE_PREFETCH_ONE_NODE with a distance of 2 (launched a layer at a time here, as off CUDA): the same counts,
    tables and slot bytes as the per-layer joinless rounds two layers ahead, kernel copies or the host copier's."""
    layers_n, forwards = 5, 3
    capturing = replay_and_capture(tmp_path, monkeypatch, layers_n)
    launches = recorded_launches(monkeypatch)
    served = host_copies_waited_for(monkeypatch) if host else []
    results = {}
    for one_node in (False, True):
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREFETCH_DISTANCE": "2",
            "BIGMOE_PREFETCH_ONE_NODE": "1" if one_node else "0",
            "BIGMOE_PREFETCH_HOST_COPIER": "1" if host else "0",
        }
        layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
        run_forwards(live, layers, routing, 1)
        capturing[0] = True
        launches.clear()
        served.clear()
        run_forwards(live, layers, routing, forwards)
        capturing[0] = False
        results[one_node] = (
            [stats.snapshot(i)["vram"] for i in range(layers_n)],
            [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
        )
        # per launch: (first, last) rounds; from the first layer rounds 1-2, then one a layer, 2 ahead
        assert [(f, l) for f, l, _ in launches] == ([(1, 2), (3, 3), (4, 4)] * forwards if one_node else [])
        assert live._chain.timeouts == 0 and live.chain_cancels == 0
        if host:
            assert live.copier.stats()["rounds"] == forwards * (layers_n - 1) == len(served)
            live.copier.close()
    (plain_counts, plain_layers), (node_counts, node_layers) = results[False], results[True]
    assert plain_counts == node_counts and sum(c.prefetched for c in node_counts) > 0
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(plain_layers, node_layers):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)


@pytest.mark.parametrize("distance,late", [(1, [2, 3]), (2, [3]), (3, [])])
def test_the_kernel_waits_for_the_step_distance_layers_back_and_proposes_from_its_rows(distance, late):
    """Layer 0's step is done (its cursor past this forward's rows), layers 1-3's are not (their cursors one step
    behind). A round into layer l waits for layer max(l - distance, 0)'s step: those that wait for an unfinished one
    give up, counted; every round proposes from the rows of the step it waited for, as the per-layer rounds do."""
    experts, slots, width, tokens, layers_n = 40, 10, 6, 2, 4
    predicted = torch.randint(-1, experts, (23, layers_n, width), dtype=torch.int32)
    ours, theirs = layers_twice(layers_n, experts, slots, "lru")
    cursor = torch.tensor([9, 7, 7, 7], dtype=torch.int64)  # only layer 0's step has replayed this forward's rows
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 2, distance=distance)
    chain = chain_at(layers_n, forward=3, stepped_upto=0)
    rounds.launch(chain.flags, tokens, max_spins=2)
    assert int(chain.flags[TIMEOUTS]) == len(late)
    ref_chain = chain_at(layers_n, forward=3, stepped_upto=layers_n - 1)
    for layer in range(1, layers_n):
        source = max(layer - distance, 0)
        ids = replayed_predictions(predicted, cursor[source] - tokens, layer - 1, tokens).reshape(-1)
        got = theirs[layer][0].prefetch(ids, chain_flags=ref_chain.flags)
        m = got.experts.numel()
        assert torch.equal(rounds.lists[layer - 1]["exp"][:m], got.experts), (layer, source)
        assert torch.equal(rounds.lists[layer - 1]["slot"][:m], got.slots), (layer, source)


def test_a_launch_cannot_follow_a_step_at_or_after_its_first_round():
    ours, _ = layers_twice(3, 40, 8, "lru")
    predicted, cursor = torch.zeros((4, 3, 2), dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ForwardRoundsError, match="cannot decide layer 1"):
        ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 1, after=1, distance=2)


@pytest.mark.parametrize("raw,distance", [("0", 1), ("1", 1), ("4", 4)])
def test_a_distance_of_zero_or_one_is_the_next_layer_and_more_implies_joinless(tmp_path: Path, raw, distance):
    _, _, _, live = captured_model({"BIGMOE_PREFETCH_DISTANCE": raw}, 2)
    assert live.distance == distance and live.joinless == (distance > 1)
