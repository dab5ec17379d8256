"""BIGMOE_PREFETCH_JOINLESS: a round and the next layer's step meet through device words, not a graph join
(core.round_sync). Here in Triton's interpreter, where every launch runs to its end in order, each interleaving
a GPU can produce is set up by hand: the round decides first (the step then decides and copies exactly as after a
join), the step comes first (the round is cancelled and changes nothing), a copy the step needs is still under way
(the step waits, then copies it itself, counted), a slot under copy is never taken, and a claimed round that never
decides is given up on, counted. A slot a drain holds for a late host copy is copied by a step without a wait and
given to no other expert, and every LATE_LIMIT-th late drain holds the rounds back a while. The adapter's joinless
forward prefetches what a joined one does and joins once.
tests/gpu/test_round_sync_gpu.py runs it captured on the GPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core.copy_kernel import record_blocks
from bigmoe_pager.core.prediction import LivePredictions
from bigmoe_pager.core.prefetch_chain import CANCELS, FORWARD, LATE_LIMIT, OPEN, TIMEOUTS, PrefetchChain
from bigmoe_pager.core.round_sync import CANCELLED, CLAIMED, DECIDED, HELD
from bigmoe_pager.settings import PagerSettings
from test_host_rounds import LateCopies
from test_live_predictor import EXPERTS
from test_prefetch_chain import captured_model, run_forwards
from test_step_kernel import ACQUIRED, LAYOUT, STATE, pager_pair, records, slot_bytes, step_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

FORWARD_NO = 5  # the forward under way (counted by its first layer's step)


def joined_and_joinless(experts: int, slots: int, policy: str, seed: int):
    """The same layer twice, both fused with the admit kernel: one joined as today, one joinless."""
    (joinless, jstats), (joined, pstats) = pager_pair(experts, slots, policy, 3, records(experts, seed=seed))
    for pager in (joinless, joined):
        pager.fused = True
        pager.vram.use_kernel = True
    chain = PrefetchChain(layers=2, device="cpu")
    chain.flags[FORWARD] = FORWARD_NO
    return (joined, pstats), (joinless, jstats), chain


def assert_same(a, b, got_a, got_b, note):
    for field in ACQUIRED:
        assert torch.equal(getattr(got_a, field), getattr(got_b, field)), (note, field)
    for field in STATE:
        assert torch.equal(getattr(a.vram, field), getattr(b.vram, field)), (note, field)
    want, got = slot_bytes(a), slot_bytes(b)
    assert all(torch.equal(want[n], got[n]) for n in want), note


def sync_words(pager):
    state = pager.vram.kernel_state()
    return state["claim"], state["copied"], state["target"]


def filled(pager):
    return pager.vram.kernel_state()["filled"]


def next_forward(chain):
    """As the forward's first step would: count the next forward (the claim word of the one before stays)."""
    chain.flags[FORWARD] += 1


def step_giving_up(pager, ids, chain, spins: int):
    """A joinless step of layer 1 that polls `spins` times before it gives up on a round."""
    pager.sync_max_spins = spins
    return pager.acquire(ids, chain.signal(1, first=False, joinless=True))


@pytest.mark.parametrize("policy", ["lru", "lfu-duel"])
def test_a_round_that_decides_first_is_stepped_on_as_after_a_join(policy):
    rng = random.Random(3)
    (joined, pstats), (joinless, jstats), chain = joined_and_joinless(40, 12, policy, seed=3)
    hot = rng.sample(range(40), 10)
    for forward in range(12):
        predicted = torch.tensor(rng.sample(range(40), 6), dtype=torch.int64)
        ids = step_ids(rng, 40, 1, 4, hot)
        joined.prefetch(predicted)
        joinless.prefetch(predicted, chain_flags=chain.flags)
        claim, copied, target = sync_words(joinless)
        assert int(claim) == int(chain.flags[FORWARD]) * 4 + DECIDED
        assert torch.equal(copied, target)  # the interpreter's copy is done when the launch returns
        got_a = joined.acquire(ids)
        got_b = joinless.acquire(ids, chain.signal(1, first=False, joinless=True))
        assert_same(joined, joinless, got_a, got_b, forward)
        next_forward(chain)
    assert torch.equal(pstats.device_counts, jstats.device_counts) and int(pstats.snapshot(0)["vram"].prefetched) > 0
    assert int(chain.flags[CANCELS]) == int(chain.flags[TIMEOUTS]) == 0
    filled = int(pstats.snapshot(0)["vram"].prefetched)
    assert int(sync_words(joinless)[1].sum()) == filled * record_blocks(LAYOUT)


@pytest.mark.parametrize("behind", [0, 5])
def test_a_round_into_a_slot_still_being_copied_sets_its_goal_past_that_copy(behind):
    """An earlier round's copy into a slot may still be under way when the next forward's round takes it (the
    host's copies are ordered by nothing but the drain): the new goal must lie past the old one, or a step would
    take the old copy's end for the new expert's bytes."""
    rng = random.Random(9)
    _, (joinless, _), chain = joined_and_joinless(40, 12, "lru", seed=9)
    blocks = record_blocks(LAYOUT)
    took = 0
    for _ in range(8):
        _, copied, target = sync_words(joinless)
        target.copy_(copied + behind)  # every slot `behind` blocks short of its last goal
        old = target.clone()
        got = joinless.prefetch(torch.tensor(rng.sample(range(40), 6)), chain_flags=chain.flags)
        taken = got.slots[got.slots >= 0]
        took += taken.numel()
        assert torch.equal(target[taken], old[taken] + blocks)
        assert torch.equal(copied[taken], old[taken] - behind + blocks)  # the interpreter's copy is done at return
        joinless.acquire(step_ids(rng, 40, 1, 4, list(range(40))), chain.signal(1, first=False, joinless=True))
        next_forward(chain)
    assert took > 0


def test_a_step_that_comes_first_cancels_the_round_which_then_changes_nothing():
    rng = random.Random(5)
    (alone, astats), (joinless, jstats), chain = joined_and_joinless(40, 12, "lfu-duel", seed=5)
    hot = rng.sample(range(40), 10)
    for forward in range(8):
        ids = step_ids(rng, 40, 1, 4, hot)
        got_a = alone.acquire(ids)  # no round at all
        got_b = joinless.acquire(ids, chain.signal(1, first=False, joinless=True))
        assert int(sync_words(joinless)[0]) == int(chain.flags[FORWARD]) * 4 + CANCELLED
        late = joinless.prefetch(torch.tensor(rng.sample(range(40), 6)), chain_flags=chain.flags)
        assert (late.slots < 0).all() and (late.experts < 0).all()
        assert_same(alone, joinless, got_a, got_b, forward)
        next_forward(chain)
    assert int(chain.flags[CANCELS]) == 8 and int(chain.flags[TIMEOUTS]) == 0
    assert torch.equal(astats.device_counts, jstats.device_counts)


def test_a_needed_copy_still_under_way_is_waited_for_then_copied_by_the_step_itself():
    (joined, pstats), (joinless, jstats), chain = joined_and_joinless(40, 12, "lru", seed=7)
    predicted = torch.tensor([3, 9, 21, 30])
    joined.prefetch(predicted)
    joinless.prefetch(predicted, chain_flags=chain.flags)
    slot = int(joinless.vram.expert_slot[21])
    _, copied, target = sync_words(joinless)
    target[slot] = copied[slot] + 7  # as if the round's copy had written only part of the slot
    for buf in slot_bytes(joinless).values():
        buf[slot].fill_(0)
    ids = torch.tensor([[21, 3, 1, 2]], dtype=torch.int32)
    got_a = joined.acquire(ids)
    got_b = step_giving_up(joinless, ids, chain, 4)
    assert_same(joined, joinless, got_a, got_b, "late copy")  # the step's own copy of expert 21
    assert int(chain.flags[TIMEOUTS]) == 1
    assert jstats.snapshot()["vram"].prefetch_late == 1  # the one needed copy still under way; joined: never seen
    assert pstats.snapshot()["vram"].prefetch_late == 0


@pytest.mark.parametrize("copying", [True, False])
def test_a_slot_this_forward_s_round_filled_is_never_taken_for_a_miss(copying):
    """Whether its copy is still under way or done: every program of the step must exclude the same slots."""
    (_, _), (joinless, _), chain = joined_and_joinless(40, 6, "lru", seed=9)
    joinless.acquire(torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32))  # slots 0-5 hold experts 0-5
    _, copied, target = sync_words(joinless)
    oldest = int(joinless.vram.expert_slot[0])  # LRU's victim: all six were used at the same step, lowest first
    filled(joinless)[oldest] = FORWARD_NO
    target[oldest] = copied[oldest] + (3 if copying else 0)
    got = step_giving_up(joinless, torch.tensor([[1, 2, 10, -1, -1, -1]], dtype=torch.int32), chain, 4)
    assert int(got.loaded) == 1 and int(got.miss_slots[0]) != oldest
    assert int(joinless.vram.expert_slot[0]) == oldest  # expert 0 stays where its copy goes on
    assert int(chain.flags[TIMEOUTS]) == 0


def hold_late(pager, slot: int, behind: int) -> None:
    """As a drain leaves a slot whose host copy it gave up on: the copy `behind` blocks short of its goal (0: it has
    landed since, and no drain has released the slot yet), the slot held."""
    _, copied, target = sync_words(pager)
    target[slot] = copied[slot] + behind
    filled(pager)[slot] = HELD


def test_a_needed_slot_held_for_a_late_host_copy_is_copied_by_the_step_at_once_not_waited_for_again():
    """Run 38: a host copy that outlived its forward cost a second's wait in every later step that hit its slot.
    Held by the drain, the slot is copied by the step without a wait (no timeout counted), with the right bytes."""
    (joined, pstats), (joinless, jstats), chain = joined_and_joinless(40, 12, "lru", seed=7)
    predicted = torch.tensor([3, 9, 21, 30])
    joined.prefetch(predicted)
    joinless.prefetch(predicted, chain_flags=chain.flags)
    next_forward(chain)
    slot = int(joinless.vram.expert_slot[21])
    hold_late(joinless, slot, behind=7)
    for buf in slot_bytes(joinless).values():
        buf[slot].fill_(0)  # the late copy has written nothing yet
    ids = torch.tensor([[21, 3, 1, 2]], dtype=torch.int32)
    got_a = joined.acquire(ids)
    got_b = step_giving_up(joinless, ids, chain, 4)
    assert_same(joined, joinless, got_a, got_b, "held slot")  # the step's own copy of expert 21
    assert int(chain.flags[TIMEOUTS]) == 0 and int(filled(joinless)[slot]) == HELD
    assert jstats.snapshot()["vram"].prefetch_late == 1  # still counted: the step copied what the prefetch had not


@pytest.mark.parametrize("behind", [3, 0])
def test_a_slot_held_for_a_late_host_copy_is_never_taken_for_a_miss_or_a_prefetch(behind):
    """Whether the late copy is still under way or has landed unseen: until a drain releases the slot it keeps its
    expert, even as the policy's first victim (the late bytes would land over another expert's)."""
    (_, _), (joinless, _), chain = joined_and_joinless(40, 6, "lru", seed=9)
    joinless.acquire(torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32))  # slots 0-5 hold experts 0-5
    oldest = int(joinless.vram.expert_slot[0])  # LRU's victim: all six were used at the same step, lowest first
    next_forward(chain)
    hold_late(joinless, oldest, behind)
    got = step_giving_up(joinless, torch.tensor([[1, 2, 10, -1, -1, -1]], dtype=torch.int32), chain, 4)
    assert int(got.loaded) == 1 and int(got.miss_slots[0]) != oldest
    next_forward(chain)
    rounds = joinless.prefetch(torch.tensor([11, 12]), chain_flags=chain.flags)
    taken = rounds.slots[rounds.slots >= 0]
    assert taken.numel() > 0 and oldest not in taken.tolist()
    assert int(joinless.vram.expert_slot[0]) == oldest and int(chain.flags[TIMEOUTS]) == 0


@pytest.mark.parametrize("late_drains", [LATE_LIMIT - 1, LATE_LIMIT])
def test_rounds_fetch_nothing_once_enough_drains_found_host_copies_late(late_drains):
    """Run 38: where the copy engines' work stopped landing beside the kernels, every forward's drain waited its
    second. After LATE_LIMIT such drains a round judges and marks what it would fetch as always but takes nothing,
    and counts no open gate (so the forwards can be quiet); below it, a round fetches as always."""
    rng = random.Random(4)
    (_, _), (joinless, _), chain = joined_and_joinless(40, 12, "lru", seed=4)
    copies = LateCopies(chain)
    for _ in range(late_drains):  # forwards whose drains found a host copy late, landed since
        copies.end_forward(late=True)
        next_forward(chain)
    held_back = late_drains >= LATE_LIMIT
    hot = rng.sample(range(40), 10)
    taken = 0
    for _ in range(4):
        predicted = torch.tensor(rng.sample(range(40), 6), dtype=torch.int64)
        taken += int((joinless.prefetch(predicted, chain_flags=chain.flags).slots >= 0).sum())
        joinless.acquire(step_ids(rng, 40, 1, 4, hot), chain.signal(1, first=False, joinless=True))
        next_forward(chain)
    assert int(chain.flags[TIMEOUTS]) == late_drains and (taken == 0) == held_back  # (the drains' own)
    if held_back:  # judged and marked: the gate's scores go on; no open gate counted
        assert int(joinless.vram.admit_state()["would_fetch"].sum()) > 0 and int(chain.flags[OPEN]) == 0
    else:
        assert int(chain.flags[OPEN]) > 0


def test_rounds_fetch_again_once_a_hold_back_is_over():
    """Since session 50 a hold-back lasts the chain's hold_forwards forwards, twice as many the next time (before, the
    engine's life): a server that met a passing stall prefetches again. Each forward's round proposes two experts no
    slot holds and its step uses them (so the gate stays open): whether the round fetched, forward by forward. The
    first forward after a hold-back is quiet (core.prefetch_chain: the held rounds counted no open gate), so fetching
    resumes one forward later."""
    rng = random.Random(6)
    (_, _), (joinless, _), _ = joined_and_joinless(40, 12, "lru", seed=6)
    hold = 2
    chain = PrefetchChain(layers=2, device="cpu", hold_forwards=hold)
    copies = LateCopies(chain)

    def forward(late: bool = False) -> bool:
        next_forward(chain)
        absent = [e for e in range(40) if int(joinless.vram.expert_slot[e]) < 0]
        wanted = rng.sample(absent, 2)
        taken = joinless.prefetch(torch.tensor(wanted), chain_flags=chain.flags).slots
        joinless.acquire(torch.tensor([wanted], dtype=torch.int32), chain.signal(1, first=False, joinless=True))
        copies.end_forward(late)
        return bool((taken >= 0).any())

    fetched = [forward(late=True) for _ in range(LATE_LIMIT)] + [forward() for _ in range(hold + 2)]
    fetched += [forward(late=True) for _ in range(LATE_LIMIT)] + [forward() for _ in range(2 * hold + 2)]
    late = [True] * LATE_LIMIT
    assert fetched == late + [False] * (hold + 1) + [True] + late + [False] * (2 * hold + 1) + [True]
    assert int(chain.flags[TIMEOUTS]) == 2 * LATE_LIMIT  # the drains' own: no step or round gave up


def test_a_step_with_too_few_idle_slots_waits_for_the_copies_and_gives_up_counted():
    (_, _), (joinless, _), chain = joined_and_joinless(40, 4, "lru", seed=11)
    joinless.acquire(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32))
    _, copied, target = sync_words(joinless)
    filled(joinless)[:4] = FORWARD_NO  # every slot filled by this forward's round, and still under copy:
    target[:4] = copied[:4] + 2  # a miss has nowhere to go until those copies are done
    got = step_giving_up(joinless, torch.tensor([[8, -1, -1, -1]], dtype=torch.int32), chain, 3)
    assert int(got.loaded) == 0 and int(got.remapped[0, 0]) == -1
    assert int(chain.flags[TIMEOUTS]) == 1
    target[:4] = copied[:4]  # the copies finish: the next step waits for none and takes a slot
    got = step_giving_up(joinless, torch.tensor([[8, -1, -1, -1]], dtype=torch.int32), chain, 3)
    assert int(got.loaded) == 1 and int(chain.flags[TIMEOUTS]) == 1


def test_a_claimed_round_that_never_decides_is_given_up_on_counted():
    (_, _), (joinless, _), chain = joined_and_joinless(40, 8, "lru", seed=13)
    claim, _, _ = sync_words(joinless)
    claim.fill_(FORWARD_NO * 4 + CLAIMED)
    got = step_giving_up(joinless, torch.tensor([[1, 2]], dtype=torch.int32), chain, 3)
    assert int(got.loaded) == 2 and int(chain.flags[TIMEOUTS]) == 1 and int(chain.flags[CANCELS]) == 0
    assert int(claim) == FORWARD_NO * 4 + CLAIMED


def test_the_first_layer_of_a_forward_never_settles_a_round():
    chain = PrefetchChain(layers=2, device="cpu")
    assert chain.signal(0, first=True, joinless=True).joinless is False
    assert chain.signal(1, first=False, joinless=True).joinless is True
    assert chain.signal(1, first=False).joinless is False


def test_a_joinless_round_needs_the_admit_kernel():
    (joined, _), _, chain = joined_and_joinless(20, 6, "lru", seed=1)
    joined.vram.use_kernel = False
    with pytest.raises(ValueError, match="decided by the admit kernel only"):
        joined.prefetch(torch.tensor([1, 2]), chain_flags=chain.flags)


def test_the_setting_reads_and_round_trips():
    assert PagerSettings.from_env({}).prefetch_joinless is False
    on = PagerSettings.from_env({"BIGMOE_PREFETCH_JOINLESS": "1"})
    assert on.prefetch_joinless is True and PagerSettings.from_env(on.to_env()) == on


# ---- the adapter's joinless forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layers_n,forwards,family", [(3, 4, "topic-shift"), (5, 3, "standard")])
def test_a_joinless_forward_prefetches_what_a_joined_one_does_and_joins_once(
    tmp_path: Path, monkeypatch, layers_n, forwards, family
):
    trace = traces.named_trace(family, 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace, traces.predictions(trace, 0.8, 0.5, EXPERTS))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    joins = []
    plain_join = LivePredictions.join

    def counted(self, device):
        joins.append(self.chained)
        plain_join(self, device)

    monkeypatch.setattr(LivePredictions, "join", counted)
    results = {}
    for mode in ("joined", "joinless"):
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREFETCH_CHAIN": "1",
            "BIGMOE_PREFETCH_JOINLESS": "1" if mode == "joinless" else "0",
        }
        layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
        signals = []
        capturing[0] = False
        run_forwards(live, layers, routing, 1)  # eager: the flags are made
        capturing[0] = True
        joins.clear()
        run_forwards(live, layers, routing, forwards, on_step=lambda layer, turn: signals.append(turn.chain))
        results[mode] = (
            [stats.snapshot(i)["vram"] for i in range(layers_n)],
            [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
        )
        assert [s.joinless for s in signals] == [mode == "joinless" and i > 0 for i in range(layers_n)] * forwards
        if mode == "joinless":  # joined only by close_chain, while the chain is still open, once a forward
            assert joins.count(True) == forwards
            claims = [int(layer.pager.pager.vram.kernel_state()["claim"]) for layer in layers]
            assert claims[1:] == [forwards * 4 + DECIDED] * (layers_n - 1)  # every round decided before its step
        else:
            assert joins.count(True) >= forwards * (layers_n - 1)
        assert live._chain.timeouts == 0 and live.chain_cancels == 0 and not live.live.chained
    (plain_counts, plain_layers), (sync_counts, sync_layers) = results["joined"], results["joinless"]
    assert plain_counts == sync_counts and sum(c.prefetched for c in sync_counts) > 0
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(plain_layers, sync_layers):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)
