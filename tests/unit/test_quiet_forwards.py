"""Quiet forwards (core.prefetch_chain): after a joinless forward whose rounds found every gate closed and left no
copy under way, the next forward's rounds claim and take nothing and its steps settle nothing. In Triton's
interpreter, over each way a joinless forward's rounds are copied (their kernels, the host copier's thread from each
round or from the one-node kernel): the pager decides and counts what it does without quiet forwards while every
gate stays closed, and a gate that reopens ends them, a forward later."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.prefetch_chain import PrefetchChain
from test_forward_rounds import host_copies_waited_for
from test_live_predictor import EXPERTS
from test_prefetch_chain import captured_model, run_forwards
from test_step_kernel import slot_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

MODES = {  # how a joinless forward's rounds are copied: (BIGMOE_PREFETCH_ONE_NODE, BIGMOE_PREFETCH_HOST_COPIER)
    "kernels": ("0", "0"),
    "host": ("0", "1"),
    "one-node-host": ("1", "1"),
}
LAYERS = 3


def run(tmp_path: Path, capturing: list, predicted: np.ndarray, trace: np.ndarray, mode: str, forwards: int) -> dict:
    """`forwards` captured forwards of one token each (after an eager one); per forward whether it was quiet, and the
    prefetches so far."""
    traces.save_trace(tmp_path / "r.npz", trace, predicted)
    one_node, host = MODES[mode]
    env = {
        "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
        "BIGMOE_PREFETCH_JOINLESS": "1",
        "BIGMOE_PREFETCH_ONE_NODE": one_node,
        "BIGMOE_PREFETCH_HOST_COPIER": host,
    }
    layers, stats, routing, live = captured_model(env, LAYERS, admit_kernel=True)
    capturing[0] = False
    run_forwards(live, layers, routing, 1)  # eager: the flags are made
    capturing[0] = True
    quiet, prefetched = [], []
    for _ in range(forwards):
        declared = live._chain.quiet  # the forward the last one declared quiet (0: none)
        run_forwards(live, layers, routing, 1)
        quiet.append(declared == live._chain.forwards)
        prefetched.append(sum(stats.snapshot(i)["vram"].prefetched for i in range(LAYERS)))
    assert live._chain.timeouts == 0 and live.chain_cancels == 0
    if live.copier is not None:
        live.copier.close()
    return {
        "quiet": quiet,
        "prefetched": prefetched,
        "counts": [stats.snapshot(i)["vram"] for i in range(LAYERS)],
        "layers": [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
    }


@pytest.fixture
def capturing(monkeypatch) -> list:
    """[whether a capture is under way], as the forwards see it; host copies are waited for as a GPU step polls."""
    state = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state[0])
    host_copies_waited_for(monkeypatch)
    return state


@pytest.fixture
def quiet_forwards(monkeypatch):
    """A switch: off, no forward's end declares the next one quiet (the build before quiet forwards)."""
    declare = PrefetchChain.end_forward

    def switch(on: bool) -> None:
        monkeypatch.setattr(PrefetchChain, "end_forward", declare if on else lambda self: None)

    return switch


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_at_recall_0_forwards_go_quiet_and_the_pager_decides_as_without_them(
    tmp_path, capturing, quiet_forwards, mode, family
):
    trace = traces.named_trace(family, 64, LAYERS, EXPERTS, 2)
    wrong = traces.predictions(trace, 0.0, None, EXPERTS)
    quiet_forwards(False)
    loud = run(tmp_path, capturing, wrong, trace, mode, 10)
    quiet_forwards(True)
    calm = run(tmp_path, capturing, wrong, trace, mode, 10)
    assert not any(loud["quiet"])
    assert sum(calm["quiet"]) >= 7 and not calm["quiet"][0]  # every gate closes at its first judgment
    assert calm["counts"] == loud["counts"] and calm["prefetched"] == loud["prefetched"]
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(calm["layers"], loud["layers"]):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_gate_that_reopens_ends_the_quiet_forwards(tmp_path, capturing, quiet_forwards, mode):
    """Wrong proposals for the first 8 tokens, then right ones: the gates close, forwards go quiet, and once a quiet
    forward's round judges its marks used the next forwards prefetch again, as without quiet forwards."""
    trace = traces.named_trace("topic-shift", 64, LAYERS, EXPERTS, 2)
    predicted = traces.predictions(trace, 1.0, None, EXPERTS)
    predicted[:9] = traces.predictions(trace, 0.0, None, EXPERTS)[:9]  # row 0 is the eager forward's
    quiet_forwards(False)
    loud = run(tmp_path, capturing, predicted, trace, mode, 20)
    quiet_forwards(True)
    calm = run(tmp_path, capturing, predicted, trace, mode, 20)
    assert any(calm["quiet"][:8]) and not any(loud["quiet"])
    switched = loud["prefetched"][7]
    assert loud["prefetched"][-1] > switched and calm["prefetched"][-1] > calm["prefetched"][7]
    last_quiet = max(i for i, q in enumerate(calm["quiet"]) if q)
    assert last_quiet < 19 and calm["prefetched"][-1] > calm["prefetched"][last_quiet]
    assert all(not q for q in calm["quiet"][last_quiet + 1 :])
