"""BIGMOE_PREFETCH_JOINLESS on the GPU: a whole forward of paged layers captured in one CUDA graph, its live router's
rounds on one side-stream branch joined once, at the forward's end; each step settles the round into its table on
the device (core.round_sync). Replayed with new hidden states and ids, with a stand-in for each layer's compute
between the steps (so rounds land in time, or late, as inside vLLM): every replay leaves each id's slot holding its
expert's bytes, every round is decided or cancelled exactly once, no wait gives up, rounds that landed were used, and
the steps count as late (stats' prefetch_late) at most the experts the rounds prefetched.
The joinless graph may decide otherwise than a joined one (a late round is cancelled, a slot under copy is not
taken), so what is compared is what tokens depend on: the bytes each id's slot holds. With copies="host"
(BIGMOE_PREFETCH_HOST_COPIER) each round publishes its list after its admit and the host copier's thread copies it
with the copy engines: the slots must hold as right, and the thread must serve every round without an error. With
distance=2 (BIGMOE_PREFETCH_DISTANCE) each round is made two layers ahead of its step, from the router of that layer on
the state two layers before."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.round_sync import CANCELLED, DECIDED
from test_prefetch_chain_gpu import assert_slots_hold, model_inputs, paged_model, routed_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("copies,distance", [("kernel", 1), ("host", 1), ("kernel", 2), ("host", 2)])
@pytest.mark.parametrize(
    "experts,vram,k,tokens,policy,compute",
    [(64, 16, 4, 1, "lru", 4), (128, 32, 8, 2, "lfu-duel", 4), (128, 24, 8, 1, "lfu-duel", 0)],
)
def test_a_joinless_whole_forward_capture_keeps_every_slot_right_and_settles_every_round(
    experts, vram, k, tokens, policy, compute, copies, distance
):
    """compute: matmuls of 2048 x 2048 between a layer's step and the next (0: the steps back to back, so most
    rounds come late and are cancelled)."""
    layers_n = 6
    layout, g, records, weights, x, ids = model_inputs(experts, k, tokens, layers_n)
    work = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    layers, predictor, stats = paged_model(
        layout,
        records,
        layers_n,
        vram,
        k,
        True,
        weights,
        policy,
        joinless=True,
        host=copies == "host",
        distance=distance,
    )
    out = [torch.empty_like(i) for i in ids]

    def forward() -> None:  # as the adapter runs each layer's call: page (settling, publishing), fork or chain, compute
        for i, layer in enumerate(layers):
            with predictor.ahead(layer, x, ids[i].numel()) as turn:
                out[i].copy_(layer.pager.step(ids[i], turn.chain))
                turn()
                for _ in range(compute):
                    torch.mm(work, work)

    rng = random.Random(experts)

    def new_inputs() -> list[torch.Tensor]:
        return routed_inputs(x, ids, weights, experts, k, g, rng)

    new_inputs()
    forward()  # eager (Triton compiles here; nothing chains outside a capture, and the flags are made)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    replays = 30
    for _ in range(replays):
        chosen = new_inputs()
        graph.replay()
        torch.cuda.synchronize()
        assert_slots_hold(layers, layout, records, chosen, out)
    assert predictor.fork_placements == ["once a forward (chained rounds, joined once)"]
    assert predictor._chain.forwards == replays and predictor.chain_timeouts == 0
    for layer in layers[1:]:  # the last forward's round into each later layer was decided or cancelled
        claim = int(layer.pager.pager.vram.kernel_state()["claim"])
        assert claim in (replays * 4 + DECIDED, replays * 4 + CANCELLED)
        state = layer.pager.pager.vram.kernel_state()
        assert torch.equal(state["copied"], state["target"])  # every copy finished by the forward's end
    counts = [stats.snapshot(i)["vram"] for i in range(layers_n)]
    if compute:
        assert sum(c.prefetch_used for c in counts) > 0  # rounds landed before their steps and were used
    assert predictor.chain_cancels <= replays * (layers_n - 1)
    # Only a needed expert a round was still copying counts as late: never more than the rounds prefetched, and
    # (every id's slot counted alike would be) far fewer than the steps' hits.
    assert 0 <= sum(c.prefetch_late for c in counts) <= sum(c.prefetched for c in counts)
    if copies == "host":
        served = predictor.copier.stats()
        assert served["error"] == 0 and served["rounds"] == replays * (layers_n - 1)
        predictor.copier.close()
