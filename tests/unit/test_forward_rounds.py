"""BIGMOE_PREFETCH_ONE_NODE: a joinless forward's rounds as one kernel (core.forward_rounds), in Triton's interpreter.

The kernel's rounds must equal the joinless forward's per-layer rounds (admit with a claim, then a counting copy) in
every output: the decided lists, the table state, the claim and copy-progress words, the counters and the slot bytes;
and the steps after them must decide alike. A step that came first cancels its round, which then copies nothing; a
step that never published is waited for, then given up on, counted. Interleavings are set by hand: in the interpreter
a launch runs to its end before the next. tests/gpu/test_round_sync_gpu.py runs the kernel captured on the GPU."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.forward_rounds import ForwardRounds, ForwardRoundsError, shared_shape
from bigmoe_pager.core.host_copier import HostCopier, HostCopierError
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.prediction import replayed_predictions
from bigmoe_pager.core.prefetch_chain import FORWARD, STEPPED, TIMEOUTS, PrefetchChain
from bigmoe_pager.core.round_sync import CANCELLED, DECIDED
from bigmoe_pager.settings import PagerSettings
from test_live_predictor import EXPERTS
from test_prefetch_chain import captured_model, run_forwards
from test_step_kernel import STATE, pager_pair, records, slot_bytes, step_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

SYNC_WORDS = ("claim", "copied", "target", "filled")


def layers_twice(n: int, experts: int, slots: int, policy: str):
    """n layers twice over (the kernel's, the per-layer rounds'), each pair alike; each pager with its own stats."""
    ours, theirs = [], []
    for i in range(n):
        (a, sa), (b, sb) = pager_pair(experts, slots, policy, 3, records(experts, seed=10 + i))
        for pager in (a, b):
            pager.fused = True
            pager.vram.use_kernel = True
        ours.append((a, sa))
        theirs.append((b, sb))
    return ours, theirs


def chain_at(layers: int, forward: int, stepped_upto: int) -> PrefetchChain:
    chain = PrefetchChain(layers, "cpu")
    chain.flags[FORWARD] = forward
    chain.flags[STEPPED : STEPPED + stepped_upto + 1] = forward
    return chain


def assert_layers_alike(ours, theirs, note):
    for i, ((a, sa), (b, sb)) in enumerate(zip(ours, theirs)):
        for field in STATE:
            assert torch.equal(getattr(a.vram, field), getattr(b.vram, field)), (note, i, field)
        sa_state, sb_state = a.vram.kernel_state(), b.vram.kernel_state()
        for word in SYNC_WORDS:
            assert torch.equal(sa_state[word], sb_state[word]), (note, i, word)
        want, got = slot_bytes(b), slot_bytes(a)
        assert all(torch.equal(want[n], got[n]) for n in want), (note, i)
        assert torch.equal(sa.device_counts, sb.device_counts), (note, i)


def replay_and_capture(tmp_path: Path, monkeypatch, layers_n: int, family: str = "standard") -> list[bool]:
    """A replayed trace of `family` with recall-0.8 predictions at tmp_path / "r.npz", and torch's capture flag
    patched to a one-element list the test sets (False: an eager forward, True: a captured one)."""
    trace = traces.named_trace(family, 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    return capturing


def recorded_launches(monkeypatch, run: bool = True) -> list:
    """Every ForwardRounds.launch from now on, as (first, last, programs) of the kernel launched; each still runs when
    `run` (False: recorded only)."""
    launches = []
    plain = ForwardRounds.launch

    def launch(self, flags, tokens, **kw):
        launches.append((self.first, self.last, self.programs))
        if run:
            plain(self, flags, tokens, **kw)

    monkeypatch.setattr(ForwardRounds, "launch", launch)
    return launches


def unbuildable(self, device, ring_words=0, hot_ms=0):
    raise HostCopierError("host copier: no C compiler")


def copier_rounds(copier, want: int) -> int:
    """The host copier's served-round count once it reaches `want` (up to 10 s): its thread counts a round after it
    writes the round's last copy word, which is all that host_copies_waited_for waits for."""
    deadline = time.monotonic() + 10
    while copier.stats()["rounds"] < want and time.monotonic() < deadline:
        time.sleep(0.0005)
    return copier.stats()["rounds"]


def host_copies_waited_for(monkeypatch) -> list:
    """After each launch of rounds that publish (the one-node kernel's, or a pager's round with a mailbox), wait (up
    to 10 s) until the host copier has served them, as a GPU step's polls would; returns the rounds waited for."""
    served = []

    def wait(box: torch.Tensor, copied: torch.Tensor, target: torch.Tensor) -> None:
        deadline = time.monotonic() + 10
        while not torch.all(copied >= target) and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert torch.all(copied >= target), "the host copier did not serve a published round within 10 s"
        served.append(int(box[0]))

    plain_launch, plain_prefetch = ForwardRounds.launch, ExpertPager.prefetch

    def launch(self, flags, tokens, **kw):
        plain_launch(self, flags, tokens, **kw)
        if self.mailboxes is not None:
            for box, (copied, target) in zip(self.mailboxes, self.progress):
                wait(box, copied, target)

    def prefetch(self, predicted_ids, chain_flags=None):
        got = plain_prefetch(self, predicted_ids, chain_flags)
        if chain_flags is not None and self.mailbox is not None:
            state = self.vram.kernel_state()
            wait(self.mailbox, state["copied"], state["target"])
        return got

    monkeypatch.setattr(ForwardRounds, "launch", launch)
    monkeypatch.setattr(ExpertPager, "prefetch", prefetch)
    return served


@pytest.mark.parametrize(
    "policy,layers_n,tokens,programs", [("lru", 3, 1, 3), ("lfu-duel", 4, 2, 2), ("lfu", 3, 1, 5), ("lru", 2, 3, 1)]
)
def test_the_kernel_s_rounds_equal_the_per_layer_joinless_rounds_and_the_steps_after_them(
    policy, layers_n, tokens, programs
):
    experts, slots, width, trace_tokens = 40, 10, 6, 23
    rng = random.Random(layers_n * 7 + tokens)
    predicted = torch.randint(-1, experts, (trace_tokens, layers_n, width), dtype=torch.int32)
    ours, theirs = layers_twice(layers_n, experts, slots, policy)
    cursor = torch.zeros(layers_n, dtype=torch.int64)
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, programs)
    hot = rng.sample(range(experts), 12)
    for forward in range(1, 9):
        cursor += tokens  # every layer's step replayed `tokens` rows
        chain, ref_chain = chain_at(layers_n, forward, layers_n - 1), chain_at(layers_n, forward, layers_n - 1)
        rounds.launch(chain.flags, tokens)
        for layer in range(1, layers_n):
            ids = replayed_predictions(predicted, cursor[layer - 1] - tokens, layer - 1, tokens).reshape(-1)
            got = theirs[layer][0].prefetch(ids, chain_flags=ref_chain.flags)
            m = got.experts.numel()
            lists = {name: made[:m] for name, made in rounds.lists[layer - 1].items()}
            assert torch.equal(lists["exp"], got.experts) and torch.equal(lists["slot"], got.slots), (forward, layer)
            assert torch.equal(lists["evicted"], got.evicted), (forward, layer)
            assert int(ours[layer][0].vram.kernel_state()["claim"]) == forward * 4 + DECIDED
        assert_layers_alike(ours, theirs, forward)
        chain.flags[FORWARD] = ref_chain.flags[FORWARD] = forward - 1  # the forward's first step counts it
        for layer in range(layers_n):  # the steps, settling the decided rounds
            ids = step_ids(rng, experts, tokens, 4, hot)
            signal_a = chain.signal(layer, first=layer == 0, joinless=True)
            signal_b = ref_chain.signal(layer, first=layer == 0, joinless=True)
            a, b = ours[layer][0].acquire(ids, signal_a), theirs[layer][0].acquire(ids, signal_b)
            assert torch.equal(a.remapped, b.remapped) and torch.equal(a.miss_slots, b.miss_slots)
        assert_layers_alike(ours, theirs, f"{forward} after its steps")
        assert int(chain.flags[TIMEOUTS]) == 0
    assert sum(int(s.snapshot(0)["vram"].prefetched) for _, s in ours) > 0  # the rounds copied


def test_a_round_its_step_cancelled_first_copies_nothing_and_the_others_go_on():
    experts, slots = 40, 8
    predicted = torch.randint(0, experts, (9, 3, 5), dtype=torch.int32)
    ours, theirs = layers_twice(3, experts, slots, "lru")
    cursor = torch.ones(3, dtype=torch.int64)
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 3)
    chain = chain_at(3, 4, 2)
    ours[2][0].vram.kernel_state()["claim"].fill_(4 * 4 + CANCELLED)  # layer 2's step settled first
    before = {k: v.clone() for k, v in slot_bytes(ours[2][0]).items()}
    rounds.launch(chain.flags, 1)
    assert (rounds.lists[1]["exp"] < 0).all() and all(
        torch.equal(before[k], v) for k, v in slot_bytes(ours[2][0]).items()
    )
    assert int(ours[2][0].vram.kernel_state()["copied"].sum()) == 0
    assert int(ours[1][0].vram.kernel_state()["claim"]) == 4 * 4 + DECIDED and (rounds.lists[0]["exp"] >= 0).any()
    assert int(chain.flags[TIMEOUTS]) == 0


def test_a_step_that_never_publishes_is_given_up_on_counted():
    predicted = torch.randint(0, 40, (9, 3, 5), dtype=torch.int32)
    ours, _ = layers_twice(3, 40, 8, "lru")
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, torch.ones(3, dtype=torch.int64), 2)
    chain = chain_at(3, 4, 0)  # layer 1's step has not published
    rounds.launch(chain.flags, 1, max_spins=3)
    assert int(chain.flags[TIMEOUTS]) == 1  # the round into layer 2 waited, gave up, and ran (a wrong proposal)
    assert int(ours[2][0].vram.kernel_state()["claim"]) == 4 * 4 + DECIDED


def test_layers_that_cannot_share_the_kernel_are_named():
    ours, _ = layers_twice(2, 40, 8, "lru")
    other, _ = layers_twice(1, 40, 6, "lru")
    with pytest.raises(ForwardRoundsError, match="differs"):
        shared_shape([ours[0][0], other[0][0]])
    with pytest.raises(ForwardRoundsError, match="at least one round"):
        ForwardRounds([], 1, torch.zeros((2, 2, 2), dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 1)


# ---- the adapter: a forward's rounds through the kernel --------------------------------------------------------------


@pytest.mark.parametrize("layers_n,forwards,family", [(3, 4, "topic-shift"), (5, 3, "standard")])
def test_a_one_node_forward_prefetches_what_a_joinless_one_does(
    tmp_path: Path, monkeypatch, caplog, layers_n, forwards, family
):
    """Off CUDA the adapter launches the kernel once a layer (in the interpreter a launch runs to its end before the
    next step); the counts, tables and slot bytes must equal the per-layer joinless rounds'. So must those of rounds
    copied by the host thread (BIGMOE_PREFETCH_HOST_COPIER), published by each layer's round ("host"), by the
    one-node kernel ("one-node-host"): there the test waits for the thread after each round, as the GPU's step polls
    for it (the interpreter's step polls once). A host copier that cannot be built ("host-unbuilt") leaves one
    warning line and the joinless rounds."""
    trace = traces.named_trace(family, 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    launches = recorded_launches(monkeypatch)
    served = host_copies_waited_for(monkeypatch)
    results = {}
    modes = ("joinless", "one-node", "host", "one-node-host", "host-unbuilt")
    for mode in modes:
        if mode == "host-unbuilt":
            monkeypatch.setattr(HostCopier, "__init__", unbuildable)
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREFETCH_JOINLESS": "1",
            "BIGMOE_PREFETCH_ONE_NODE": "1" if mode.startswith("one-node") else "0",
            "BIGMOE_PREFETCH_HOST_COPIER": "1" if "host" in mode else "0",
        }
        layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
        capturing[0] = False
        run_forwards(live, layers, routing, 1)  # eager: the flags are made
        capturing[0] = True
        launches.clear()
        run_forwards(live, layers, routing, forwards)
        results[mode] = (
            [stats.snapshot(i)["vram"] for i in range(layers_n)],
            [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
        )
        expected = [(i, i) for i in range(1, layers_n)] * forwards if mode.startswith("one-node") else []
        assert [(first, last) for first, last, _ in launches] == expected  # a launch a round here (a forward on CUDA)
        assert live._chain.timeouts == 0 and live.chain_cancels == 0 and not live.live.chained
        if mode in ("host", "one-node-host"):
            want = forwards * (layers_n - 1)
            assert copier_rounds(live.copier, want) == want == len(served)
            live.copier.close()
            served.clear()
        if mode.endswith("-unbuilt"):
            assert live.copier is None and not live.host
            assert [r.message for r in caplog.records if "HOST_COPIER" in r.message][-1:] == [
                "bigmoe: BIGMOE_PREFETCH_HOST_COPIER: host copier: no C compiler; prefetch rounds are copied on the "
                "GPU instead"
            ]
    plain_counts, plain_layers = results["joinless"]
    for mode in modes[1:]:
        counts, kept = results[mode]
        assert plain_counts == counts and sum(c.prefetched for c in counts) > 0, mode
        for (a_slots, a_bytes), (b_slots, b_bytes) in zip(plain_layers, kept):
            assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes), mode


def test_the_setting_implies_a_joinless_chain_and_round_trips():
    on = PagerSettings.from_env({"BIGMOE_PREFETCH_ONE_NODE": "1"})
    assert on.prefetch_one_node is True and PagerSettings.from_env(on.to_env()) == on
    assert PagerSettings.from_env({}).prefetch_one_node is False


@pytest.mark.parametrize("host", [False, True])
def test_on_cuda_the_adapter_launches_one_kernel_a_forward_for_every_later_layer(tmp_path: Path, monkeypatch, host):
    """The CUDA placement, forced in the interpreter: one launch at the first layer for rounds 1 .. L-1 (here its
    waits for the later steps give up, counted, since the interpreter runs the launch to its end first). With the
    host copier (BIGMOE_PREFETCH_HOST_COPIER) the kernel only decides and publishes: one program."""
    from bigmoe_pager.adapters.vllm.predictor import Predictor

    layers_n, forwards = 4, 3
    trace = traces.named_trace("standard", 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(Predictor, "_one_kernel_a_forward", staticmethod(lambda hidden: True))
    launches = recorded_launches(monkeypatch, run=False)
    env = {
        "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
        "BIGMOE_PREFETCH_ONE_NODE": "1",
        "BIGMOE_PREFETCH_ONE_NODE_PROGRAMS": "2",
        "BIGMOE_PREFETCH_HOST_COPIER": "1" if host else "0",
    }
    layers, _, routing, live = captured_model(env, layers_n)
    run_forwards(live, layers, routing, 1)
    capturing[0] = True
    run_forwards(live, layers, routing, forwards)
    assert launches == [(1, layers_n - 1, 1 if host else 2)] * forwards  # with the programs asked for
    if host:
        assert live.copier.stats()["layers"] == layers_n - 1
        live.copier.close()
