"""The live predictor on the GPU as vLLM's graphs hold it: as PIECEWISE pieces (layer l's call captured in one graph,
layer l+1's in another: the side stream must be forked and joined inside the first capture, else it fails with
unjoined work) and as one FULL graph (both calls in one capture: the join waits for layer l+1's call). Each replay must
leave every id's slot holding its expert, and when layer l+1 routes as its router does on layer l's state, the
proposals must be what it uses."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from bigmoe_pager.adapters.vllm.predictor import Predictor
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prediction import LivePredictions, predict_next
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings

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


def whole_forward_predictor(settings: PagerSettings, layers: list) -> Predictor:
    """The process's predictor over `layers` (in MoE order) in forwards captured whole (vLLM's FULL graphs)."""
    return Predictor(
        settings,
        Routing(settings),
        lambda i: layers[i + 1] if i + 1 < len(layers) else None,
        on_device=True,
        whole_forward_captured=lambda: True,
    )


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
