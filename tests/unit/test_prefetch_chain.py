"""BIGMOE_PREFETCH_CHAIN: a forward captured whole forks its prefetch rounds once; each later round waits on the
device for its layer's step (core.prefetch_chain). Here in Triton's interpreter, where everything runs in order:
a fused step publishes itself (and the forward's first counts the forward) without changing anything it decides or
copies; the wait returns once the step of this forward is published and gives up, counted, otherwise; and the
adapter, in a chained forward, hands each layer's step its signal and makes each round wait for the layer before,
prefetching exactly what the unchained forward prefetches. tests/gpu/test_prefetch_chain_gpu.py captures it."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core.pager import PagerError
from bigmoe_pager.core.prefetch_chain import FORWARD, STEPPED, TIMEOUTS, PrefetchChain
from bigmoe_pager.settings import PagerSettings
from test_live_predictor import EXPERTS, hidden, model, predictor
from test_step_kernel import ACQUIRED, STATE, pager_pair, records, slot_bytes, step_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds


# ---- the step publishes; the wait waits -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "experts,slots,tokens,k,policy,programs",
    [(40, 10, 1, 8, "lru", 3), (30, 5, 3, 4, "lfu", 5), (40, 8, 3, 4, "lfu-duel", 2)],
)
def test_a_chained_step_publishes_itself_and_decides_and_copies_as_an_unchained_one(
    experts, slots, tokens, k, policy, programs
):
    rng = random.Random(experts + slots)
    rec = records(experts, seed=experts)
    (chained, cstats), (plain, pstats) = pager_pair(experts, slots, policy, programs, rec)
    plain.fused = True  # both fused: the chain is the only difference
    chain = PrefetchChain(layers=3, device="cpu")
    hot = rng.sample(range(experts), max(k, experts // 4))
    for forward in range(1, 25):
        ids = step_ids(rng, experts, tokens, k, hot)
        a, b = plain.acquire(ids), chained.acquire(ids, chain.signal(1, first=forward % 2 == 1))
        for field in ACQUIRED:
            assert torch.equal(getattr(a, field), getattr(b, field)), (forward, field)
        for field in STATE:
            assert torch.equal(getattr(plain.vram, field), getattr(chained.vram, field)), (forward, field)
        want, got = slot_bytes(plain), slot_bytes(chained)
        assert all(torch.equal(want[n], got[n]) for n in want), forward
        assert chain.forwards == (forward + 1) // 2  # counted by the signals marked first only
        assert chain.stepped(1) == chain.forwards and chain.stepped(0) == chain.stepped(2) == 0
    assert torch.equal(pstats.device_counts, cstats.device_counts)


def test_only_a_fused_step_can_publish(tmp_path: Path):
    rec = records(12, seed=3)
    (_, _), (plain, _) = pager_pair(12, 4, "lru", 2, rec)
    assert plain.publishes(4) is False
    with pytest.raises(PagerError, match="only a fused step publishes"):
        plain.acquire(torch.tensor([[1, 2]]), PrefetchChain(1, "cpu").signal(0, first=True))


@pytest.mark.parametrize("published,timeouts", [(True, 0), (False, 1)])
def test_the_wait_returns_once_the_step_of_this_forward_is_published_and_gives_up_counted_otherwise(
    published, timeouts
):
    chain = PrefetchChain(layers=2, device="cpu")
    chain.flags[FORWARD] = 7
    chain.flags[STEPPED + 1] = 7 if published else 6  # 6: the step of the forward before
    chain.wait_stepped(1, max_spins=5)
    assert int(chain.flags[TIMEOUTS]) == timeouts
    chain.wait_stepped(0, max_spins=3)  # layer 0 never stepped in this forward
    assert int(chain.flags[TIMEOUTS]) == timeouts + 1


def test_a_chain_signal_or_wait_names_a_layer_of_the_chain():
    chain = PrefetchChain(layers=2, device="cpu")
    with pytest.raises(IndexError, match="outside the chain's 2 layers"):
        chain.signal(2, first=False)
    with pytest.raises(IndexError, match="outside the chain's 2 layers"):
        chain.wait_stepped(-1)


def test_the_setting_reads_and_round_trips():
    assert PagerSettings.from_env({}).prefetch_chain is False
    on = PagerSettings.from_env({"BIGMOE_PREFETCH_CHAIN": "1"})
    assert on.prefetch_chain is True and PagerSettings.from_env(on.to_env()) == on


# ---- the adapter's chained forward ----------------------------------------------------------------------------------


def fused_model(layers: int, vram: int):
    made = model(layers, vram)
    for layer in made[0]:
        layer.pager.pager.fused = True  # the GPU's default; on CPU the interpreter runs the same kernel
    return made


def captured_model(env: dict, layers_n: int, admit_kernel: bool = False):
    """Fused paged layers, and the process's routing and predictor over them, in forwards taken as captured whole
    (env: more BIGMOE_* settings); admit_kernel: rounds decide with the admit kernel (a joinless round needs it).
    Returns (layers, stats, routing, predictor)."""
    routing = Routing(PagerSettings.from_env({"BIGMOE_PAGER": "1", **env}))
    layers, _, _, stats = fused_model(layers_n, 6)
    for layer in layers if admit_kernel else ():
        layer.pager.pager.vram.use_kernel = True
    live = predictor(layers, env, routing)
    live.whole_forward_captured = lambda: True
    return layers, stats, routing, live


def run_forwards(live, layers, routing, forwards: int, tokens: int = 1, top: int = 2, on_step=None):
    """As the adapter runs a whole forward: each layer replays its rows, steps with its Turn's signal, forks."""
    for f in range(forwards):
        for layer in layers:
            ids = routing.hook(layer._moe_index, torch.zeros(tokens, top, dtype=torch.int64))
            with live.ahead(layer, hidden(tokens, f * 10 + layer._moe_index), ids.numel()) as turn:
                if on_step is not None:
                    on_step(layer, turn)
                layer.pager.step(ids, turn.chain)
                turn()


@pytest.mark.parametrize("layers_n,forwards", [(3, 4), (5, 3)])
def test_a_chained_forward_orders_each_round_after_the_step_before_and_prefetches_what_forks_do(
    tmp_path: Path, monkeypatch, layers_n, forwards
):
    trace = traces.named_trace("topic-shift", 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]  # an eager forward first, as vLLM's profile run and warm-up come before its captures
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    results = {}
    chain_wait = PrefetchChain.wait_stepped
    for chained in (False, True):
        env = {"BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"), "BIGMOE_PREFETCH_CHAIN": "1" if chained else "0"}
        env["BIGMOE_PREFETCH_CHAINED_ONLY"] = "0"  # the eager forward prefetches in both: they start alike
        layers, stats, routing, live = captured_model(env, layers_n)
        signals, waits = [], []

        def waited(self, layer, max_spins=None):
            waits.append((layer, self.stepped(layer), self.forwards))  # the step it waits for is published
            chain_wait(self, layer, max_spins)

        monkeypatch.setattr(PrefetchChain, "wait_stepped", waited)
        capturing[0] = False
        run_forwards(live, layers, routing, 1)  # eager: nothing chains; the flags are made
        capturing[0] = True  # then as in vLLM's FULL captures
        run_forwards(live, layers, routing, forwards, on_step=lambda layer, turn: signals.append(turn.chain))
        results[chained] = (
            [stats.snapshot(i)["vram"] for i in range(layers_n)],
            [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
        )
        if not chained:
            assert signals == [None] * (layers_n * forwards) and waits == []
            continue
        assert [(s.layer, s.first) for s in signals] == [(i, i == 0) for i in range(layers_n)] * forwards
        # the first round of a forward is forked after layer 0's step; each later one waits for the step before it
        assert waits == [(i, f, f) for f in range(1, forwards + 1) for i in range(1, layers_n - 1)]
        assert live._chain.forwards == forwards and live._chain.timeouts == 0
        assert live.chain_timeouts == 0 and not live.live.chained  # closed after the last layer
    (plain_counts, plain_layers), (chain_counts, chain_layers) = results[False], results[True]
    assert plain_counts == chain_counts and sum(c.prefetched for c in chain_counts) > 0
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(plain_layers, chain_layers):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)


@pytest.mark.parametrize(
    "case", ["piece", "eager", "a layer not fused", "too many ids", "setting off", "no uncaptured forward first"]
)
def test_a_forward_that_cannot_chain_forks_a_round_a_layer(tmp_path: Path, monkeypatch, caplog, case):
    trace = traces.named_trace("standard", 16, 3, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 1.0, 1.0, EXPERTS))
    env = {
        "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
        "BIGMOE_PREFETCH_CHAIN": "0" if case == "setting off" else "1",
    }
    routing = Routing(PagerSettings.from_env({"BIGMOE_PAGER": "1", **env}))
    layers, _, _, stats = fused_model(3, 6)
    if case == "a layer not fused":
        layers[2].pager.pager.fused = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: case != "eager")
    live = predictor(layers, env, routing)
    live.whole_forward_captured = lambda: case != "piece"
    if case != "no uncaptured forward first":
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
            run_forwards(live, layers, routing, 1)  # vLLM's profile run: makes the chain's flags (where on)
    before = sum(stats.snapshot(i)["vram"].prefetched for i in range(3))
    signals = []
    tokens = 4 if case == "too many ids" else 1  # 8 ids, more than the 6 slots: no fused step
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        if case == "too many ids":
            for layer in layers:
                with live.ahead(layer, hidden(tokens, 0), tokens * 2) as turn:
                    signals.append(turn.chain)
        else:
            run_forwards(live, layers, routing, 2, on_step=lambda layer, turn: signals.append(turn.chain))
    assert all(s is None for s in signals) and not live.live.chained
    assert (live._chain is None) is (case in ("setting off", "no uncaptured forward first"))
    # with the chain on, only forwards captured whole prefetch (BIGMOE_PREFETCH_CHAINED_ONLY unset); off, every one
    prefetched = sum(stats.snapshot(i)["vram"].prefetched for i in range(3)) - before
    assert (prefetched > 0) is (case not in ("piece", "eager")), prefetched
    told = [r.getMessage() for r in caplog.records if "forked" in r.getMessage()]
    if case in ("a layer not fused", "too many ids"):
        assert told == [
            "bigmoe: in CUDA graph captures, prefetch rounds are forked once a layer (not every layer's "
            "step is fused, so the rounds cannot be chained)"
        ]
    elif case == "no uncaptured forward first":
        assert told == [
            "bigmoe: in CUDA graph captures, prefetch rounds are forked once a layer (the chain's flags were not "
            "made by an uncaptured forward first)"
        ]
    else:
        assert told == []
