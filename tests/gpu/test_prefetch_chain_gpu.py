"""BIGMOE_PREFETCH_CHAIN on the GPU: a whole forward of paged layers captured in one CUDA graph, its live router's
rounds on one side-stream branch (one fork, each round waiting on the device for the step before it), replayed with
new hidden states and ids: every replay leaves each id's slot holding its expert, and the chained graph makes the
same decisions (slots, counters) as the graph that forks a round a layer, fed the same inputs. No wait gives up."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.prediction import predict_next
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.settings import PagerSettings
from test_live_predictor_gpu import HIDDEN, started, whole_forward_predictor

pytestmark = pytest.mark.gpu


def paged_model(
    layout,
    records,
    layers_n: int,
    vram: int,
    k: int,
    chained: bool,
    weights,
    policy: str,
    joinless: bool = False,
    host: bool = False,
    distance: int = 1,
):
    """Paged layers with routers, and the process's predictor over them (live router proposals; chained rounds,
    and joined once a forward with `joinless`; copied by the host copier's thread with `host`; each joinless round
    `distance` layers ahead)."""
    stats = PagerStats(layers_n, "cuda")
    runners: dict = {}
    layers = []
    for i in range(layers_n):
        layer = SimpleNamespace(
            layer_name=f"model.layers.{i}.mlp.experts",
            _moe_index=i,
            _num_experts=records.shape[0],
            moe_config=SimpleNamespace(experts_per_token=k),
            pager=started(layout, records, i, vram, stats, policy),
            _runners=runners,
        )
        runners[layer.layer_name] = SimpleNamespace(gate=SimpleNamespace(weight=weights[i]))
        layers.append(layer)
    settings = PagerSettings(
        enabled=True,
        predict="router",
        prefetch_chain=chained,
        prefetch_joinless=joinless,
        prefetch_host_copier=host,
        prefetch_distance=distance,
        prefetch_chained_only=False,  # the eager forward prefetches chained or not: compared models start alike
    )
    return layers, whole_forward_predictor(settings, layers), stats


def model_inputs(experts: int, k: int, tokens: int, layers_n: int):
    """A small FP8 layout, its experts' records, one router per layer, and the hidden-state and id buffers a captured
    forward reads (layout, generator, records, weights, x, ids)."""
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    g = torch.Generator().manual_seed(experts)
    records = torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=g) & 0x77
    weights = [torch.randn(experts, HIDDEN, generator=g).to("cuda", torch.bfloat16) for _ in range(layers_n)]
    x = torch.zeros((tokens, HIDDEN), dtype=torch.bfloat16, device="cuda")
    ids = [torch.zeros((tokens, k), dtype=torch.int32, device="cuda") for _ in range(layers_n)]
    return layout, g, records, weights, x, ids


def assert_slots_hold(layers, layout, records, chosen: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    """Every layer's slot for each id it was given (out: the step's remapped ids) holds that expert's bytes."""
    for i, layer in enumerate(layers):
        for expert, slot in zip(chosen[i].flatten().tolist(), out[i].flatten().cpu().tolist()):
            for c in layout.components:
                got = layer.pager.buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu()
                assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (i, expert, slot)


def replayed_model(
    tmp_path,
    layers_n: int,
    experts: int,
    vram: int,
    k: int,
    family: str,
    recall: float,
    policy: str,
    topk: bool = False,
    **settings,
):
    """Paged layers over a routing family's trace replayed with its proposals at `recall` (precision 0.5; 1.0 with
    recall 1; with `topk`, k ids a row as a router's top-k, so at recall 0 all wrong), and the process's routing and
    predictor over them in forwards captured whole; `settings`: more PagerSettings. Returns (layout, records, layers,
    routing, predictor, stats)."""
    from bigmoe_bench import traces
    from bigmoe_pager.adapters.vllm.predictor import Predictor
    from bigmoe_pager.adapters.vllm.routing import Routing

    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    g = torch.Generator().manual_seed(experts)
    records = torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=g) & 0x77
    trace = traces.named_trace(family, 200, layers_n, experts, k)
    precision = None if topk else 1.0 if recall == 1.0 else 0.5
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, recall, precision, experts))
    config = PagerSettings(enabled=True, route_replay=tmp_path / "r.npz", **settings)
    stats = PagerStats(layers_n, "cuda")
    layers = [
        SimpleNamespace(
            layer_name=f"model.layers.{i}.mlp.experts",
            _moe_index=i,
            pager=started(layout, records, i, vram, stats, policy),
        )
        for i in range(layers_n)
    ]
    routing = Routing(config)
    predictor = Predictor(
        config,
        routing,
        lambda i: layers[i + 1] if i + 1 < len(layers) else None,
        on_device=True,
        whole_forward_captured=lambda: True,
    )
    return layout, records, layers, routing, predictor, stats


def routed_inputs(x, ids, weights, experts: int, k: int, g, rng) -> list[torch.Tensor]:
    """New hidden states into x and each layer's ids into ids: random for the first layer, much as its router routes
    the shared state for the others (three times in ten one id replaced). Returns the ids, on the CPU."""
    tokens = x.shape[0]
    x.copy_(torch.randn(tokens, HIDDEN, generator=g).to("cuda", torch.bfloat16))
    chosen = [torch.tensor([rng.sample(range(experts), k) for _ in range(tokens)], dtype=torch.int32)]
    for i in range(1, len(ids)):
        routed = predict_next(x, weights[i], k).to("cpu", torch.int32)
        if rng.random() < 0.3:
            routed[:, -1] = torch.tensor(rng.sample(range(experts), tokens))
        chosen.append(routed)
    for target, value in zip(ids, chosen):
        target.copy_(value)
    return chosen


@pytest.mark.parametrize("experts,vram,k,tokens,policy", [(64, 16, 4, 1, "lru"), (128, 32, 8, 2, "lfu-duel")])
def test_a_chained_whole_forward_capture_decides_as_forks_do_and_keeps_every_slot_right(
    experts, vram, k, tokens, policy
):
    layers_n = 6
    layout, g, records, weights, x, ids = model_inputs(experts, k, tokens, layers_n)
    runs = {}
    for chained in (False, True):
        layers, predictor, stats = paged_model(layout, records, layers_n, vram, k, chained, weights, policy)
        out = [torch.empty_like(i) for i in ids]

        def forward() -> None:  # as the adapter runs each layer's call: page (publishing), fork or chain, compute
            for i, layer in enumerate(layers):
                with predictor.ahead(layer, x, ids[i].numel()) as turn:
                    out[i].copy_(layer.pager.step(ids[i], turn.chain))
                    turn()

        rng = random.Random(experts)

        def new_inputs() -> list[torch.Tensor]:
            return routed_inputs(x, ids, weights, experts, k, g, rng)

        g.manual_seed(1000 + experts)
        new_inputs()
        forward()  # eager (Triton compiles here; nothing chains outside a capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        slots = []
        for _ in range(30):
            chosen = new_inputs()
            graph.replay()
            torch.cuda.synchronize()
            slots.append([o.cpu() for o in out])
            assert_slots_hold(layers, layout, records, chosen, out)
        runs[chained] = slots, [stats.snapshot(i)["vram"] for i in range(layers_n)]
        if chained:
            assert predictor.fork_placements == ["once a forward (chained rounds)"]
            assert predictor._chain.forwards == 30 and predictor.chain_timeouts == 0
            assert all(predictor._chain.stepped(i) == 30 for i in range(layers_n))
        else:
            assert predictor.fork_placements == [] and predictor.chain_timeouts is None
    (plain_slots, plain_counts), (chain_slots, chain_counts) = runs[False], runs[True]
    assert all(torch.equal(a, b) for fa, fb in zip(plain_slots, chain_slots) for a, b in zip(fa, fb))
    assert plain_counts == chain_counts
    assert sum(c.prefetch_used for c in chain_counts) > 0  # the rounds ran and were used
