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
from bigmoe_pager.core.prefetch_chain import CANCELS, FORWARD, PUBLISHED, QUIET, STEPPED, TIMEOUTS, PrefetchChain
from bigmoe_pager.core.round_sync import CANCELLED, DECIDED
from bigmoe_pager.core.step_kernel import StepKernelError
from bigmoe_pager.settings import PagerSettings, SettingsError
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


def unbuildable(self, device, ring_words=0, hot_ms=0, goal_write=False):
    raise HostCopierError("host copier: no C compiler")


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

    plain_launch, plain_prefetch, plain_acquire = ForwardRounds.launch, ExpertPager.prefetch, ExpertPager.acquire

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

    def acquire(self, topk_ids, chain=None):
        got = plain_acquire(self, topk_ids, chain)
        if chain is not None and chain.round is not None:  # the step decided and published the next layer's round
            rounds, index = chain.round.rounds, chain.round.target - chain.round.rounds.first
            wait(rounds.mailboxes[index], *rounds.progress[index])
        return got

    monkeypatch.setattr(ForwardRounds, "launch", launch)
    monkeypatch.setattr(ExpertPager, "prefetch", prefetch)
    monkeypatch.setattr(ExpertPager, "acquire", acquire)
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


def cold_trace(length: int, layers_n: int, width: int, experts: int, seed: int) -> torch.Tensor:
    """Proposals of `width` distinct experts from the upper half of the ids, per row and layer."""
    rng = random.Random(seed)
    rows = [[rng.sample(range(experts // 2, experts), width) for _ in range(layers_n)] for _ in range(length)]
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("idle_every,policy,carried", [(4, "lru", True), (5, "lfu-duel", True), (4, "lfu-duel", False)])
def test_while_every_gate_is_closed_the_kernel_decides_two_forwards_in_n_and_a_useful_predictor_reopens_them(
    idle_every, policy, carried
):
    """BIGMOE_PREFETCH_IDLE_EVERY: proposals that are never used close every layer's gate; from then on the kernel
    claims no round in the forwards it sits out, drops the stale would-fetch marks in the first forward of each pair
    (its round leaves the gate's scores as they were) and judges in the second. With the chain's words carried from
    forward to forward (as on the device), each forward it will sit out is declared quiet at the end of the one before:
    the kernel then leaves at once and the steps settle nothing (no claim word moves, no round is cancelled); with a
    fresh chain each forward (no declaration seen) it cancels the rounds it sits out itself, so the steps find them
    settled. Either way the steps decide exactly as with a round every forward. Once the steps use what was proposed,
    the gates reopen and the rounds copy every forward again."""
    experts, slots, layers_n, width, closed_half, forwards = 40, 10, 3, 4, 24, 56
    predicted = cold_trace(forwards + 1, layers_n, width, experts, idle_every)
    ours, theirs = layers_twice(layers_n, experts, slots, policy)
    cursor = torch.zeros(layers_n, dtype=torch.int64)
    idle = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 1, idle_every=idle_every)
    every = ForwardRounds([p for p, _ in theirs[1:]], 1, predicted, cursor, 1)
    rng = random.Random(idle_every)
    skipped, dropped, quiet, decided_at_the_end = 0, 0, 0, []
    chain = chain_at(layers_n, 0, -1)

    def scores(layers):
        return [(int(p.vram.used_score), int(p.vram.wasted_score)) for p, _ in layers[1:]]

    def gates_closed(layers) -> bool:
        return all(u * 75 < w * 25 for u, w in scores(layers))

    for forward in range(1, forwards + 1):
        cursor += 1
        closed_before, before = gates_closed(ours), scores(ours)
        phase = forward % idle_every
        if not carried:
            chain = chain_at(layers_n, forward, layers_n - 1)
        chain.flags[FORWARD], chain.flags[STEPPED:] = forward, forward
        ref_chain = chain_at(layers_n, forward, layers_n - 1)
        declared = int(chain.flags[QUIET + forward % 2]) == forward
        assert declared == (carried and forward > 1 and closed_before and phase >= 2), forward
        claims_before = [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]]
        idle.launch(chain.flags, 1)
        every.launch(ref_chain.flags, 1)
        claims = [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]]
        if declared:
            assert claims == claims_before, (forward, claims)  # left at once: nothing claimed, nothing cancelled
            skipped, quiet = skipped + 1, quiet + 1
        elif closed_before and phase >= 2:
            assert claims == [forward * 4 + CANCELLED] * (layers_n - 1), (forward, claims)  # cancelled, not claimed
            skipped += 1
        else:
            assert all(c == forward * 4 + DECIDED for c in claims), (forward, claims)
            if closed_before and phase == 0:
                assert scores(ours) == before, forward  # stale marks dropped, nothing judged
                dropped += 1
        if forward > forwards - 8:
            decided_at_the_end.append(closed_before)
        chain.flags[FORWARD] = ref_chain.flags[FORWARD] = forward - 1  # the forward's first step counts it
        cancels = int(chain.flags[CANCELS])
        for layer in range(layers_n):
            row = int(cursor[layer]) - 1
            if layer == 0 or forward <= closed_half:  # routing that never uses what was proposed
                proposed = set(predicted[row, max(0, layer - 1)].tolist())
                ids = [rng.choice([e for e in range(experts // 2 + 6) if e not in proposed]) for _ in range(width)]
            else:  # routing that uses exactly what was proposed for this layer
                ids = predicted[row, layer - 1].tolist()
            ids = torch.tensor([ids], dtype=torch.int32)
            a = ours[layer][0].acquire(ids, chain.signal(layer, first=layer == 0, joinless=True))
            b = theirs[layer][0].acquire(ids, ref_chain.signal(layer, first=layer == 0, joinless=True))
            if forward <= closed_half:
                assert torch.equal(a.remapped, b.remapped) and torch.equal(a.miss_slots, b.miss_slots), forward
        assert int(chain.flags[TIMEOUTS]) == 0
        if declared:  # the steps settled nothing
            assert int(chain.flags[CANCELS]) == cancels and claims == claims_before, forward
        if forward == closed_half:
            assert gates_closed(ours) and gates_closed(theirs)
            for (a, sa), (b, sb) in zip(ours, theirs):  # closed rounds move no expert: the same tables and hits
                assert torch.equal(a.vram.expert_slot, b.vram.expert_slot)
                assert torch.equal(sa.device_counts, sb.device_counts)  # (the open gate's first rounds copied)
            copied_when_closed = [int(s.snapshot(0)["vram"].prefetched) for _, s in ours[1:]]
    assert skipped >= 6 and dropped >= 2
    assert quiet >= 6 if carried else quiet == 0
    assert not any(decided_at_the_end)  # the gates reopened: every forward decides again
    copied = [int(s.snapshot(0)["vram"].prefetched) for _, s in ours[1:]]
    assert all(now > then for now, then in zip(copied, copied_when_closed)), (copied, copied_when_closed)


def test_idle_forwards_are_skipped_by_one_program_every_n_of_at_least_3():
    predicted = torch.randint(0, 40, (9, 3, 5), dtype=torch.int32)
    ours, _ = layers_twice(3, 40, 8, "lru")
    cursor = torch.ones(3, dtype=torch.int64)
    for programs, every in ((1, 2), (2, 4), (1, 1)):
        with pytest.raises(ForwardRoundsError, match="every N >= 3"):
            ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, programs, idle_every=every)
    assert PagerSettings.from_env({"BIGMOE_PREFETCH_IDLE_EVERY": "16"}).prefetch_idle_every == 16
    with pytest.raises(SettingsError, match=r"BIGMOE_PREFETCH_IDLE_EVERY='2' is not valid; expected 0 \(off\)"):
        PagerSettings.from_env({"BIGMOE_PREFETCH_IDLE_EVERY": "2"})


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


@pytest.mark.parametrize("programs", [1, 3])
def test_a_round_of_a_quiet_forward_claims_nothing_and_cancels_itself(programs):
    """A forward declared quiet (its QUIET word holds its number) has no rounds, whoever runs them: each round cancels
    itself instead of claiming (so the copying programs stop waiting for a decision), copies nothing, and nothing
    times out."""
    predicted = torch.randint(0, 40, (9, 3, 5), dtype=torch.int32)
    ours, _ = layers_twice(3, 40, 8, "lru")
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, torch.ones(3, dtype=torch.int64), programs)
    chain = chain_at(3, 5, 2)
    chain.flags[QUIET + 5 % 2] = 5
    rounds.launch(chain.flags, 1, max_spins=3)
    assert [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]] == [5 * 4 + CANCELLED] * 2
    assert all((lists["exp"] < 0).all() for lists in rounds.lists)
    assert all(int(p.vram.kernel_state()["copied"].sum()) == 0 for p, _ in ours[1:])
    assert int(chain.flags[TIMEOUTS]) == 0
    chain = chain_at(3, 6, 2)
    chain.flags[QUIET + 6 % 2] = 4  # an older forward's declaration: this one's rounds claim and decide
    rounds.launch(chain.flags, 1, max_spins=3)
    assert [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]] == [6 * 4 + DECIDED] * 2


@pytest.mark.parametrize("published", [0, 1])
def test_the_steps_of_a_quiet_forward_settle_only_while_a_host_copy_may_be_under_way(published):
    """In a quiet forward the joinless steps settle nothing (no claim moves, none is cancelled) and decide as they
    would after a cancelled round; while an earlier forward's host copy may still be under way (PUBLISHED set) they
    settle as in any joinless forward, cancelling the unclaimed rounds."""
    experts, slots, layers_n = 40, 8, 3
    ours, theirs = layers_twice(layers_n, experts, slots, "lru")
    chain, ref = chain_at(layers_n, 6, -1), chain_at(layers_n, 6, -1)
    chain.flags[QUIET + 7 % 2], chain.flags[PUBLISHED] = 7, published
    rng = random.Random(published)
    for forward in (7, 9):
        chain.flags[FORWARD], ref.flags[FORWARD] = forward - 1, forward - 1
        chain.flags[QUIET + forward % 2] = forward
        claims = [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]]
        for layer in range(layers_n):
            ids = step_ids(rng, experts, 1, 4, list(range(8)))
            a = ours[layer][0].acquire(ids, chain.signal(layer, first=layer == 0, joinless=True))
            b = theirs[layer][0].acquire(ids, ref.signal(layer, first=layer == 0, joinless=True))
            assert torch.equal(a.remapped, b.remapped) and torch.equal(a.miss_slots, b.miss_slots), (forward, layer)
        after = [int(p.vram.kernel_state()["claim"]) for p, _ in ours[1:]]
        if published:
            assert after == [forward * 4 + CANCELLED] * 2 and int(chain.flags[CANCELS]) == 2 * (1 + (forward == 9))
        else:
            assert after == claims and int(chain.flags[CANCELS]) == 0
        assert [int(p.vram.kernel_state()["claim"]) for p, _ in theirs[1:]] == [forward * 4 + CANCELLED] * 2
    assert int(chain.flags[TIMEOUTS]) == 0


def test_a_step_that_never_publishes_is_given_up_on_counted():
    predicted = torch.randint(0, 40, (9, 3, 5), dtype=torch.int32)
    ours, _ = layers_twice(3, 40, 8, "lru")
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, torch.ones(3, dtype=torch.int64), 2)
    chain = chain_at(3, 4, 0)  # layer 1's step has not published
    rounds.launch(chain.flags, 1, max_spins=3)
    assert int(chain.flags[TIMEOUTS]) == 1  # the round into layer 2 waited, gave up, and ran (a wrong proposal)
    assert int(ours[2][0].vram.kernel_state()["claim"]) == 4 * 4 + DECIDED


@pytest.mark.parametrize("policy,tokens", [("lru", 1), ("lfu-duel", 2)])
def test_a_step_decides_and_publishes_the_next_layer_s_round_as_the_kernel_would(policy, tokens):
    """BIGMOE_PREFETCH_IN_STEP: layer 0's step, with layer 1's round riding on it, counts the forward once (its round
    program, not the step's end), and decides and publishes what the one-node kernel's round into layer 1 does."""
    experts, slots, layers_n = 40, 10, 3
    predicted = torch.randint(-1, experts, (11, layers_n, 6), dtype=torch.int32)
    ours, theirs = layers_twice(layers_n, experts, slots, policy)
    cursor = torch.full((layers_n,), 3 + tokens, dtype=torch.int64)
    boxes = [HostCopier.mailbox(slots, torch.device("cpu"), layers_n - 1) for _ in range(2)]
    in_step = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 1, boxes[0], 0)
    kernel = ForwardRounds([p for p, _ in theirs[1:]], 1, predicted, cursor, 1, boxes[1], 0)
    ids = step_ids(random.Random(tokens), experts, tokens, 4, list(range(12)))
    chain, ref_chain = PrefetchChain(layers_n, "cpu"), chain_at(layers_n, 1, 0)
    ours[0][0].acquire(ids, chain.signal(0, first=True, round=in_step.in_step(1)))
    theirs[0][0].acquire(ids, ref_chain.signal(0, first=False))  # (the forward is counted already)
    kernel.launch(ref_chain.flags, tokens, max_spins=1)  # layer 2's round gives up on layer 1's step: not compared
    assert chain.forwards == 1 and chain.stepped(0) == 0  # counted once; a step with a round publishes no STEPPED
    assert int(ours[1][0].vram.kernel_state()["claim"]) == 1 * 4 + DECIDED
    for field in STATE:
        assert torch.equal(getattr(ours[1][0].vram, field), getattr(theirs[1][0].vram, field)), field
    for word in SYNC_WORDS:
        assert torch.equal(ours[1][0].vram.kernel_state()[word], theirs[1][0].vram.kernel_state()[word]), word
    assert torch.equal(boxes[0][0], boxes[1][0]) and int(boxes[0][0][0]) == 1  # the same list, under forward 1
    assert int(ours[2][0].vram.kernel_state()["claim"]) == 0  # layer 2's round is layer 1's step's business


def test_a_round_rides_only_on_the_step_before_it_with_mailboxes():
    predicted = torch.randint(0, 40, (9, 3, 5), dtype=torch.int32)
    ours, _ = layers_twice(3, 40, 8, "lru")
    cursor = torch.ones(3, dtype=torch.int64)
    with pytest.raises(ForwardRoundsError, match="need mailboxes"):
        ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 1).in_step(1)
    rounds = ForwardRounds([p for p, _ in ours[1:]], 1, predicted, cursor, 1, HostCopier.mailbox(8, "cpu", 2), 0)
    with pytest.raises(ForwardRoundsError, match="no round here"):
        rounds.in_step(3)
    chain = PrefetchChain(3, "cpu")
    with pytest.raises(StepKernelError, match="decides layer 1's round, not 2's"):
        ours[0][0].acquire(torch.tensor([[1, 2]]), chain.signal(0, first=True, round=rounds.in_step(2)))
    other, _ = layers_twice(1, 48, 8, "lru")
    with pytest.raises(StepKernelError, match="has 48 experts, its next layer 40"):
        other[0][0].acquire(torch.tensor([[1, 2]]), chain.signal(0, first=True, round=rounds.in_step(1)))


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
    one-node kernel ("one-node-host") or by the step before each round (BIGMOE_PREFETCH_IN_STEP, "in-step"): there
    the test waits for the thread after each round, as the GPU's step polls for it (the interpreter's step polls
    once). A host copier that cannot be built ("host-unbuilt", "in-step-unbuilt") leaves one warning line and the
    joinless rounds."""
    trace = traces.named_trace(family, 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    launches = recorded_launches(monkeypatch)
    served = host_copies_waited_for(monkeypatch)
    results = {}
    modes = ("joinless", "one-node", "host", "one-node-host", "in-step", "host-unbuilt", "in-step-unbuilt")
    for mode in modes:
        if mode == "host-unbuilt":
            monkeypatch.setattr(HostCopier, "__init__", unbuildable)
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREFETCH_JOINLESS": "1",
            "BIGMOE_PREFETCH_ONE_NODE": "1" if mode.startswith("one-node") else "0",
            "BIGMOE_PREFETCH_HOST_COPIER": "1" if "host" in mode else "0",
            "BIGMOE_PREFETCH_IN_STEP": "1" if mode.startswith("in-step") else "0",
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
        if mode in ("host", "one-node-host", "in-step"):
            assert live.copier.stats()["rounds"] == forwards * (layers_n - 1) == len(served)
            live.copier.close()
            served.clear()
        if mode.endswith("-unbuilt"):
            assert live.copier is None and not live.host and not live.in_step
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


@pytest.mark.parametrize(
    "env,in_step",
    [
        ({"BIGMOE_PREFETCH_IN_STEP": "1"}, True),
        ({"BIGMOE_PREFETCH_IN_STEP": "1", "BIGMOE_PREFETCH_ONE_NODE": "1"}, False),  # the one-node kernel decides
        ({"BIGMOE_PREFETCH_IN_STEP": "1", "BIGMOE_PREFETCH_DISTANCE": "2"}, False),  # a step decides the next only
    ],
)
def test_rounds_in_the_steps_imply_the_host_copier_unless_another_placement_is_asked(tmp_path: Path, env, in_step):
    trace = traces.named_trace("standard", 16, 3, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    _, _, _, live = captured_model({"BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"), **env}, 3)
    assert live.in_step is in_step and live.host is True and live.joinless is True
    settings = PagerSettings.from_env(env)
    assert PagerSettings.from_env(settings.to_env()) == settings


@pytest.mark.parametrize(
    "env,ignored",
    [
        ({"BIGMOE_PREFETCH_ONE_NODE": "1", "BIGMOE_PREFETCH_HOST_COPIER": "1"}, False),
        ({"BIGMOE_PREFETCH_ONE_NODE": "1"}, True),  # its several copy programs cannot sit out alike
        ({"BIGMOE_PREFETCH_HOST_COPIER": "1"}, True),  # per-layer rounds: no kernel a forward to skip
    ],
)
def test_idle_skipping_outside_the_one_node_kernel_with_the_host_copier_says_it_is_ignored(
    tmp_path: Path, caplog, env, ignored
):
    trace = traces.named_trace("standard", 16, 3, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    env = {"BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"), "BIGMOE_PREFETCH_IDLE_EVERY": "8", **env}
    captured_model(env, 3)
    lines = [r.message for r in caplog.records if "IDLE_EVERY" in r.message]
    assert lines == (
        [
            "bigmoe: BIGMOE_PREFETCH_IDLE_EVERY=8 is ignored: it applies to the one-node kernel with the host copier "
            "(BIGMOE_PREFETCH_ONE_NODE=1 and BIGMOE_PREFETCH_HOST_COPIER=1)"
        ]
        if ignored
        else []
    )


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
        "BIGMOE_PREFETCH_IDLE_EVERY": "8",
    }
    layers, _, routing, live = captured_model(env, layers_n)
    run_forwards(live, layers, routing, 1)
    capturing[0] = True
    run_forwards(live, layers, routing, forwards)
    assert launches == [(1, layers_n - 1, 1 if host else 2)] * forwards  # with the programs asked for
    made = [r for r in live._rounds.values() if r is not None]
    assert [r.idle_every for r in made] == [8 if host else 0]  # idle forwards are skipped by the one program only
    if host:
        assert live.copier.stats()["layers"] == layers_n - 1
        live.copier.close()
