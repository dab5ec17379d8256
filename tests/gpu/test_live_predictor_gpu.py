"""The live predictor on the GPU as vLLM's graphs hold it: as PIECEWISE pieces (layer l's call captured in one graph,
layer l+1's in another: the side stream must be forked and joined inside the first capture, else it fails with
unjoined work) and as one FULL graph (both calls in one capture: the join waits for layer l+1's call). Each replay must
leave every id's slot holding its expert, and when layer l+1 routes as its router does on layer l's state, the
proposals must be what it uses."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bigmoe_pager.adapters.vllm.predictor import Predictor
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prediction import LivePredictions, conditional_nodes_available, predict_next
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings
from duel_testkit import duel_state  # tests/unit (on pytest's pythonpath)

pytestmark = pytest.mark.gpu

HIDDEN = 64


def started(layout, records, index: int, vram: int, stats: PagerStats, policy: str = "lru") -> DeviceLayerPager:
    experts = records.shape[0]
    sizes = TierSizes(experts, vram, experts)
    pager = DeviceLayerPager(layout, sizes, "cuda", layer=index, stats=stats, policy=policy)
    views = pager.ram_views()
    for e in range(experts):
        for name, part in layout.views(records[e]).items():
            views[name][pager.ram_slot_for_load(e)].copy_(part)
            pager.mark_loaded(e, name)
    pager.start(layout.slot_buffers(vram, "cuda"))
    return pager


@pytest.mark.parametrize("capture", ["pieces", "whole"])
@pytest.mark.parametrize("experts,vram,k,tokens", [(64, 16, 4, 1), (256, 32, 8, 2)])
def test_proposals_captured_with_a_layer_feed_the_next_layer(experts, vram, k, tokens, capture):
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    g = torch.Generator().manual_seed(experts)
    records = torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=g) & 0x77
    stats = PagerStats(2, "cuda")
    runners: dict = {}
    weights = [torch.randn(experts, HIDDEN, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    layers = []
    for i in range(2):
        layer = SimpleNamespace(
            layer_name=f"model.layers.{i}.mlp.experts",
            _moe_index=i,
            _num_experts=experts,
            moe_config=SimpleNamespace(experts_per_token=k),
            pager=started(layout, records, i, vram, stats),
            _runners=runners,
        )
        runners[layer.layer_name] = SimpleNamespace(gate=SimpleNamespace(weight=weights[i]))
        layers.append(layer)
    settings = PagerSettings(enabled=True, predict="router")
    predictor = Predictor(
        settings,
        Routing(settings),
        lambda i: layers[i + 1] if i == 0 else None,
        on_device=True,
        whole_forward_captured=lambda: capture == "whole",
    )
    x = torch.zeros((tokens, HIDDEN), dtype=torch.bfloat16, device="cuda")
    ids = [torch.zeros((tokens, k), dtype=torch.int32, device="cuda") for _ in range(2)]
    out = [torch.empty_like(i) for i in ids]

    def piece(i: int) -> None:  # as the adapter runs a layer's call: page, fork the next layer's prefetch, compute
        with predictor.ahead(layers[i], x) as fork:
            out[i].copy_(layers[i].pager.step(ids[i]))
            fork()

    rng = random.Random(experts)

    def new_inputs() -> list[torch.Tensor]:
        x.copy_(torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16))
        chosen = [torch.tensor([rng.sample(range(experts), k) for _ in range(tokens)], dtype=torch.int32)]
        chosen.append(predict_next(x, weights[1], k).to("cpu", torch.int32))  # layer 1 routes as its router does
        for target, value in zip(ids, chosen):
            target.copy_(value)
        return chosen

    new_inputs()
    piece(0)  # warm-up outside the graphs (Triton compiles here)
    piece(1)
    groups = [[0], [1]] if capture == "pieces" else [[0, 1]]  # pieces: the side stream must join inside piece 0
    graphs = [torch.cuda.CUDAGraph() for _ in groups]
    for graph, group in zip(graphs, groups):
        with torch.cuda.graph(graph):
            for i in group:
                piece(i)
    before = stats.snapshot(1)["vram"]
    for _ in range(20):
        chosen = new_inputs()
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        for i in range(2):
            pager = layers[i].pager
            for expert, slot in zip(chosen[i].flatten().tolist(), out[i].flatten().cpu().tolist()):
                for c in layout.components:
                    got = pager.buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu()
                    assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (i, expert, slot)
    after = stats.snapshot(1)["vram"]
    assert after.prefetched > before.prefetched
    assert after.prefetch_used > before.prefetch_used
    assert after.misses - before.misses < (after.lookups - before.lookups) // 4  # the proposals were what it used


def _table_state(pager: DeviceLayerPager) -> list[torch.Tensor]:
    t = pager.pager.vram
    kept = [t.expert_slot, t.slot_expert, t.last_use, t.use_count, t.used_score, t.wasted_score]
    return [x.clone() for x in kept + list(duel_state(t).values())]


@pytest.mark.skipif(not conditional_nodes_available(), reason="this torch has no CUDA graph conditional nodes")
@pytest.mark.parametrize("policy", ["lru", "lfu-fast", "lfu-duel"])
def test_skipped_closed_rounds_in_a_graph_leave_the_pager_as_running_every_round(policy):
    """skip_closed puts each round in a conditional node on the next pager's gate: replays switching from a useless
    predictor (the gate closes, rounds are skipped) to a perfect one (explore rounds reopen it) must leave the tables,
    the counters and every slot's bytes as the same graph without the conditional node does."""
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    experts, vram, k, explore = 64, 16, 4, 8
    g = torch.Generator().manual_seed(5)
    records = torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=g) & 0x77
    runs = {}
    ids = [torch.zeros((1, k), dtype=torch.int32, device="cuda") for _ in range(2)]
    proposal = torch.full((k,), -1, dtype=torch.int64, device="cuda")
    x = torch.zeros((1, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for skip in (False, True):
        stats = PagerStats(2, "cuda")
        pagers = [started(layout, records, i, vram, stats, policy) for i in range(2)]
        for p in pagers:
            p.pager.vram.explore_every = explore
        live = LivePredictions(skip_closed=skip)
        out = [torch.empty_like(i) for i in ids]

        def forward(pagers=pagers, live=live, out=out) -> None:
            out[0].copy_(pagers[0].step(ids[0]))
            live.feed_ids(lambda: proposal.clone(), pagers[1], x)
            live.join(x.device)
            out[1].copy_(pagers[1].step(ids[1]))

        forward()  # Triton compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        runs[skip] = (graph, pagers, stats, out)
    rng = random.Random(3)
    skipped_rounds = 0
    for t in range(12 * explore):
        chosen = [rng.sample(range(experts), k) for _ in range(2)]
        useful = t >= 6 * explore
        guess = chosen[1] if useful else rng.sample([e for e in range(experts) if e not in chosen[1]], k)
        for target, value in zip(ids, chosen):
            target.copy_(torch.tensor([value], dtype=torch.int32))
        proposal.copy_(torch.tensor(guess))
        for graph, *_ in runs.values():
            graph.replay()
        torch.cuda.synchronize()
        (_, plain, plain_stats, _), (_, skipping, skip_stats, out) = runs[False], runs[True]
        for a, b in zip(_table_state(plain[1]), _table_state(skipping[1])):
            assert torch.equal(a, b), t
        assert np.array_equal(plain_stats.read(), skip_stats.read()), t
        assert int(plain[1].pager.vram.gate_closed) == int(skipping[1].pager.vram.gate_closed), t
        for i in range(2):
            for expert, slot in zip(chosen[i], out[i].flatten().tolist()):
                for c in layout.components:
                    got = skipping[i].buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu()
                    assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (t, i, expert)
        skipped_rounds = int(skipping[1].pager.vram.gate_closed)
    assert skipped_rounds >= 3 * explore  # the useless half closed the gate: those rounds were skipped
    assert skip_stats.snapshot(1)["vram"].prefetch_used > 0  # and the perfect half reopened it
