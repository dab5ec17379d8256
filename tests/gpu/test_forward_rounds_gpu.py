"""BIGMOE_PREFETCH_ONE_NODE on the GPU: a whole forward of paged layers captured in one CUDA graph whose replayed
rounds run as one kernel on the side stream (core.forward_rounds), forked after the first step and joined once.
Replayed with a routing trace (the routing hook's rows, its proposals at recall 0.8), with a stand-in for each
layer's compute between the steps: every replay leaves each id's slot holding its expert's bytes, the kernel is one
launch a forward, every round is decided or cancelled, no wait gives up, copies finish, and rounds are used.
BIGMOE_PREFETCH_HOST_COPIER (mode "host"): the same forward with a round forked a layer, each publishing its list to
the host thread (core.host_copier), which copies it with the copy engines; with BIGMOE_PREFETCH_ONE_NODE too
("one-node-host"), decided by the one-node kernel's one program and copied by the host thread; and so with each round
decided two layers ahead of its step (BIGMOE_PREFETCH_DISTANCE=2, "one-node-host-dist2"). All must keep every slot
as right."""

from __future__ import annotations

import time

import pytest
import torch
from bigmoe_pager.core.prefetch_chain import STEPPED
from bigmoe_pager.core.round_sync import CANCELLED, DECIDED
from test_forward_rounds import recorded_launches
from test_prefetch_chain_gpu import assert_slots_hold, replayed_model

pytestmark = pytest.mark.gpu


MODES = {
    "one-node": {"prefetch_one_node": True},
    "host": {"prefetch_host_copier": True},
    "one-node-host": {"prefetch_one_node": True, "prefetch_host_copier": True},
    "one-node-host-dist2": {"prefetch_one_node": True, "prefetch_host_copier": True, "prefetch_distance": 2},
}


def host_start(predictor, stats) -> tuple[int, int, int] | None:
    """Before the replays: (rounds the host copier has served, experts it has copied, experts the rounds admitted);
    None where no host thread copies."""
    if predictor.copier is None:
        return None
    served = predictor.copier.stats()
    return served["rounds"], served["experts"], stats.snapshot()["vram"].prefetched


def caught_up(copier, experts: int, seconds: float = 2.0) -> dict:
    """The host copier's stats once it has copied `experts` experts, or after `seconds`: no step waits for a round
    that copies nothing, so the thread may still be reading the last forward's mailboxes when the replay is done."""
    deadline = time.monotonic() + seconds
    served = copier.stats()
    while served["experts"] < experts and time.monotonic() < deadline:
        time.sleep(0.01)
        served = copier.stats()
    return served


def assert_copies_landed(layers, predictor, stats, start: tuple[int, int, int] | None, replays: int) -> None:
    """Every round's copy finished by the last forward's end, and the host copier (where it copies) copied every
    expert the replays' rounds admitted, once, without an error. A round's list is the mailbox's until the next
    forward's round of that layer replaces it; a list with entries is waited for by the forward's drain, an empty
    one by nothing, so the thread may see two forwards' empty rounds as one (run 41: 145-147 of 150 rounds seen on
    an H100, every expert copied): the rounds it counts are at most those published."""
    for layer in layers[1:]:
        state = layer.pager.pager.vram.kernel_state()
        assert torch.equal(state["copied"], state["target"])
    if start is not None:
        rounds0, copied0, admitted0 = start
        admitted = stats.snapshot()["vram"].prefetched - admitted0
        served = caught_up(predictor.copier, copied0 + admitted)
        words = predictor._chain.flags[:STEPPED].tolist()  # the chain's words, for the message
        assert served["error"] == 0 and served["experts"] - copied0 == admitted, (served, admitted, words)
        assert 0 < served["rounds"] - rounds0 <= replays * (len(layers) - 1), (served, words)


def whole_forward(layers, routing, predictor, tokens: int, k: int, compute: int):
    """Each layer's call as the adapter runs it (replay the rows, page, fork, `compute` GEMMs), once eagerly (Triton
    compiles; nothing chains outside a capture, and the flags are made), then captured whole. Returns (graph, the
    replayed ids a layer, the steps' slot ids a layer)."""
    work = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros((tokens, 64), dtype=torch.bfloat16, device="cuda")
    placeholder = torch.zeros((tokens, k), dtype=torch.int64, device="cuda")
    ids = [torch.zeros((tokens, k), dtype=torch.int32, device="cuda") for _ in layers]
    out = [torch.empty_like(i) for i in ids]

    def forward() -> None:
        for i, layer in enumerate(layers):
            ids[i].copy_(routing.hook(i, placeholder))
            with predictor.ahead(layer, x, ids[i].numel()) as turn:
                out[i].copy_(layer.pager.step(ids[i], turn.chain))
                turn()
                for _ in range(compute):
                    torch.mm(work, work)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph, ids, out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "experts,vram,k,tokens,policy,compute",
    [(64, 16, 4, 1, "lru", 4), (128, 32, 8, 2, "lfu-duel", 4), (128, 24, 8, 1, "lfu-duel", 0)],
)
def test_a_one_node_forward_keeps_every_slot_right_and_settles_every_round(
    tmp_path, monkeypatch, experts, vram, k, tokens, policy, compute, mode
):
    layers_n, replays = 6, 30
    layout, records, layers, routing, predictor, stats = replayed_model(
        tmp_path, layers_n, experts, vram, k, "topic-shift", 0.8, policy, **MODES[mode]
    )
    launches = recorded_launches(monkeypatch)
    graph, ids, out = whole_forward(layers, routing, predictor, tokens, k, compute)
    start = host_start(predictor, stats)
    once = [] if mode in ("host", "in-step") else [(1, layers_n - 1)]
    assert [(first, last) for first, last, _ in launches] == once  # captured once: one a forward (none: per layer)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        chosen = [i.cpu() for i in ids]
        assert_slots_hold(layers, layout, records, chosen, out)
    assert predictor._chain.forwards == replays and predictor.chain_timeouts == 0
    for layer in layers[1:]:
        state = layer.pager.pager.vram.kernel_state()
        assert int(state["claim"]) in (replays * 4 + DECIDED, replays * 4 + CANCELLED)
    assert_copies_landed(layers, predictor, stats, start, replays)
    counts = [stats.snapshot(i)["vram"] for i in range(layers_n)]
    if compute:
        assert sum(c.prefetch_used for c in counts) > 0  # rounds landed before their steps and were used
    assert predictor.chain_cancels <= replays * (layers_n - 1)


@pytest.mark.parametrize("mode", ["one-node", "one-node-host"])
def test_one_node_forwards_queued_back_to_back_give_up_no_wait(tmp_path, mode):
    """Run 36: the overlap probe queued 64 one-node forwards at recall 0.8 without a sync between them and never
    finished; the test above syncs after every replay. Here the forwards are queued at once, as a server's decode
    steps are, and synced once: no wait may give up, every copy lands, and the slots hold the last forward's experts.
    """
    layers_n, replays = 12, 48
    layout, records, layers, routing, predictor, stats = replayed_model(
        tmp_path, layers_n, 128, 32, 8, "standard", 0.8, "lru", **MODES[mode]
    )
    graph, ids, out = whole_forward(layers, routing, predictor, 1, 8, 4)
    start = host_start(predictor, stats)
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert_slots_hold(layers, layout, records, [i.cpu() for i in ids], out)
    assert predictor._chain.forwards == replays and predictor.chain_timeouts == 0
    assert_copies_landed(layers, predictor, stats, start, replays)


def test_host_copies_that_never_land_keep_every_slot_right_and_hold_the_rounds_back(tmp_path, monkeypatch):
    """Run 38: after a torch.profiler session the host copier's copies stopped landing beside the kernels, and every
    forward waited a second a late copy. Here one layer's mailbox is never served, so its copies never land: every
    replay still leaves each id's slot holding its expert's bytes (a step copies a held slot itself), the drains stop
    counting late ones at LATE_LIMIT (the rounds then hold back, and since no late copy lands the hold-back does not
    end), and the forwards after that give up no wait. Written in session 48, passed on an H100 in run 39. The
    replayed end kernel also leaves the chain's words in pinned host memory, where the server's export thread reads
    them (session 49; passed on an H100 in run 40)."""
    from bigmoe_pager.adapters.vllm import host_copies
    from bigmoe_pager.core.prefetch_chain import LATE_LIMIT

    served = host_copies.serve_pager
    monkeypatch.setattr(
        host_copies, "serve_pager", lambda copier, pager, box: None if pager.layer == 2 else served(copier, pager, box)
    )
    layers_n = 6
    layout, records, layers, routing, predictor, stats = replayed_model(
        tmp_path, layers_n, 128, 32, 8, "topic-shift", 0.8, "lru", **MODES["one-node-host"]
    )
    graph, ids, out = whole_forward(layers, routing, predictor, 1, 8, 4)
    for _ in range(12):
        graph.replay()
        torch.cuda.synchronize()
        assert_slots_hold(layers, layout, records, [i.cpu() for i in ids], out)
    assert predictor.chain_late == LATE_LIMIT
    chain = predictor._chain
    assert predictor.chain_seen == {
        "timeouts": predictor.chain_timeouts,
        "cancels": predictor.chain_cancels,
        "late": LATE_LIMIT,
        "forward": chain.forwards,
        "resume": chain.resume,
    }
    assert chain.forwards < chain.resume
    gave_up, start = predictor.chain_timeouts, time.monotonic()
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert predictor.chain_timeouts == gave_up and time.monotonic() - start < 1.0
    assert_slots_hold(layers, layout, records, [i.cpu() for i in ids], out)


def test_a_hold_back_ends_doubles_and_outlasts_a_late_copy_on_the_gpu_as_in_the_interpreter():
    """tests/unit/test_host_rounds.py's hold-back story (three hold-backs, the last outlasting a late copy) with the
    chain and its drains on the GPU: the same forwards hold back, and `seen` (pinned host memory) says the same."""
    from test_host_rounds import check_hold_back_story, hold_back_story

    check_hold_back_story(hold_back_story("cuda"))
