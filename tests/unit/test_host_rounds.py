"""BIGMOE_PREFETCH_HOST_COPIER at the pager (core.host_rounds): a joinless round publishes its decided list, the host
copier's thread copies it, a forward's end drains the copies. In Triton's interpreter, with the copier's CPU mode.

The live predictor's rounds (BIGMOE_PREDICT=router) published to the host must move exactly what joinless rounds that
copy with a kernel move: the same counters, tables and slot bytes. tests/unit/test_forward_rounds.py runs the replayed
rounds and the one-node kernel's publication the same way; tests/gpu/test_forward_rounds_gpu.py runs them captured."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.adapters.vllm.device import held_back_line
from bigmoe_pager.core.host_copier import HostCopier
from bigmoe_pager.core.host_rounds import drain_published, publish_admitted
from bigmoe_pager.core.prefetch_chain import (
    FORWARD,
    HOLD_FORWARDS,
    LATE,
    LATE_LIMIT,
    PUBLISHED,
    TIMEOUTS,
    PrefetchChain,
    forwards_held,
)
from bigmoe_pager.core.round_sync import HELD
from test_forward_rounds import chain_at, copier_rounds, host_copies_waited_for
from test_live_predictor import EXPERTS
from test_prefetch_chain import captured_model, run_forwards
from test_step_kernel import slot_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds


@pytest.mark.parametrize("layers_n,forwards,family", [(3, 4, "topic-shift"), (4, 3, "standard")])
def test_the_live_predictor_s_rounds_copied_by_the_host_move_what_kernel_copies_move(
    tmp_path: Path, monkeypatch, layers_n, forwards, family
):
    trace = traces.named_trace(family, 64, layers_n, EXPERTS, 2)
    traces.save_trace(tmp_path / "r.npz", trace)  # no predictions: the live predictor proposes
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    served = host_copies_waited_for(monkeypatch)
    results = {}
    for host in (False, True):
        env = {
            "BIGMOE_ROUTE_REPLAY": str(tmp_path / "r.npz"),
            "BIGMOE_PREDICT": "router",
            "BIGMOE_PREFETCH_JOINLESS": "1",
            "BIGMOE_PREFETCH_HOST_COPIER": "1" if host else "0",
        }
        layers, stats, routing, live = captured_model(env, layers_n, admit_kernel=True)
        capturing[0] = False
        run_forwards(live, layers, routing, 1)  # eager: the flags are made, the mailboxes attached
        capturing[0] = True
        run_forwards(live, layers, routing, forwards)
        results[host] = (
            [stats.snapshot(i)["vram"] for i in range(layers_n)],
            [(layer.pager.pager.vram.expert_slot.clone(), slot_bytes(layer.pager.pager)) for layer in layers],
        )
        assert live._chain.timeouts == 0 and live.chain_cancels == 0
        if host:
            want = forwards * (layers_n - 1)
            assert copier_rounds(live.copier, want) == want == len(served)
            assert all(layer.pager.pager.mailbox is not None for layer in layers[1:])
            live.copier.close()
    (kernel_counts, kernel_layers), (host_counts, host_layers) = results[False], results[True]
    assert kernel_counts == host_counts and sum(c.prefetched for c in host_counts) > 0
    for (a_slots, a_bytes), (b_slots, b_bytes) in zip(kernel_layers, host_layers):
        assert torch.equal(a_slots, b_slots) and all(torch.equal(a_bytes[n], b_bytes[n]) for n in a_bytes)


def drain_words(progress: list) -> tuple[list, torch.Tensor]:
    """Per layer (copied, target, filled) tensors from (copied, target) lists, filled by forward 1, and their
    progress_words."""
    tensors = [(torch.tensor(c), torch.tensor(t), torch.ones(len(c), dtype=torch.int64)) for c, t in progress]
    return tensors, torch.tensor([[w.data_ptr() for w in layer] for layer in tensors])


def test_a_forward_s_drain_counts_each_layer_still_copying_and_holds_those_slots_until_their_copies_land():
    """drain_published at a forward's end, after a publication with entries: layers whose copies are done pass, each
    one still under way is counted in TIMEOUTS once the drain's polls are spent (the interpreter polls once) and its
    late slots are held (round_sync.HELD). The next drain waits for held slots no more (run 38: a late copy cost a
    second in every later forward), keeps PUBLISHED set while they are late, and releases each once its copy lands."""
    slots = 4
    tensors, words = drain_words(
        [
            ([5, 2, 0, 0, 0], [5, 2, 0, 0, 0]),  # done
            ([5, 1, 0, 0, 0], [5, 2, 0, 0, 0]),  # slot 1 still copying
            ([0, 0, 0, 3, 0], [0, 0, 0, 3, 0]),  # done
            ([0, 0, 0, 0, 0], [0, 0, 0, 1, 0]),  # slot 3 still copying
        ]
    )
    chain = chain_at(4, forward=3, stepped_upto=3)
    chain.flags[PUBLISHED] = 1
    drain_published(words, slots, chain.flags, max_spins=2)
    assert int(chain.flags[TIMEOUTS]) == 2 and int(chain.flags[PUBLISHED]) == 1
    assert int(chain.flags[LATE]) == 1  # one drain with late copies, however many layers
    assert np.array_equal(tensors[1][0].numpy(), [5, 1, 0, 0, 0])  # a drain writes no progress
    held = [(layer, slot) for layer, (_, _, f) in enumerate(tensors) for slot in range(slots) if f[slot] == HELD]
    assert held == [(1, 1), (3, 3)]
    drain_published(words, slots, chain.flags, max_spins=2)
    assert int(chain.flags[TIMEOUTS]) == 2 and int(chain.flags[PUBLISHED]) == 1  # held: looked at, not waited for
    tensors[1][0][1] = 2  # layer 1's late copy lands; layer 3's is still late
    drain_published(words, slots, chain.flags, max_spins=2)
    assert int(tensors[1][2][1]) == 0 and int(tensors[3][2][3]) == HELD and int(chain.flags[PUBLISHED]) == 1
    tensors[3][0][3] = 1
    drain_published(words, slots, chain.flags, max_spins=2)
    assert int(tensors[3][2][3]) == 0 and int(chain.flags[PUBLISHED]) == 0 and int(chain.flags[TIMEOUTS]) == 2
    assert int(chain.flags[LATE]) == 1  # held slots looked at again are not late again


def test_each_forward_s_end_leaves_its_counts_in_host_memory_and_the_hold_back_is_told():
    """end_forward also copies TIMEOUTS, CANCELS, LATE, FORWARD and RESUME to the chain's `seen` (pinned host memory
    on a GPU), which the server's export thread reads without a CUDA call (one beside a capture could break it): a copy
    as the forward's end left them, not a live view. At LATE_LIMIT forwards whose drain found a new host copy late, the
    export thread has one line to log (adapters.vllm.device.held_back_line), once."""
    slots = LATE_LIMIT + 1
    tensors, words = drain_words([([0] * slots, [0] * slots) for _ in range(LATE_LIMIT)])
    chain = chain_at(LATE_LIMIT, forward=3, stepped_upto=LATE_LIMIT - 1)
    lines = []
    for i in range(LATE_LIMIT):
        tensors[i][1][i] = 1  # a copy into layer i's slot i, still under way at this forward's drain
        chain.flags[PUBLISHED] = 1
        drain_published(words, slots, chain.flags, max_spins=2)
        assert chain.seen_counts()["late"] == i  # the drain's LATE is not seen before the forward's end
        chain.end_forward()
        seen = chain.seen_counts()
        resume = 3 + 1 + HOLD_FORWARDS if i + 1 == LATE_LIMIT else 0  # from the forward after this one's end
        assert seen == {"timeouts": i + 1, "cancels": 0, "late": i + 1, "forward": 3, "resume": resume}
        lines.append(held_back_line(seen, told=0))
    assert lines[:-1] == [None] * (LATE_LIMIT - 1)
    assert f"{LATE_LIMIT} forwards have ended with a host copy still under way" in lines[-1] and "\n" not in lines[-1]
    assert f"for the next {HOLD_FORWARDS} forwards" in lines[-1]
    assert held_back_line(seen, told=1) is None  # this hold-back was told already
    over = held_back_line({**seen, "forward": seen["resume"]}, told=0)  # read after its forwards
    assert "next" not in over and "until every late copy has landed" in over
    assert held_back_line(None, told=0) is None  # no forward was chained


class LateCopies:
    """One layer's progress words outside any pager (core.host_rounds.drain_published reads no more), whose host
    copies land late or on time as a test says, drained at each forward's end."""

    def __init__(self, chain: PrefetchChain, slots: int = 64) -> None:
        device = chain.flags.device
        self.chain, self.slots, self.used = chain, slots, 0
        self.copied, self.target = (torch.zeros(slots + 1, dtype=torch.int64, device=device) for _ in range(2))
        self.filled = torch.ones(slots + 1, dtype=torch.int64, device=device)
        self.words = torch.tensor([[w.data_ptr() for w in (self.copied, self.target, self.filled)]], device=device)

    def end_forward(self, late: bool = False, land: bool = True) -> None:
        """A forward's end: with `late`, a copy into a fresh slot is still under way at its drain; with `land`, every
        copy lands after the drain (the next drain releases their slots)."""
        if late:
            self.target[self.used] = self.copied[self.used] + 1
            self.used += 1
            self.chain.flags[PUBLISHED] = 1
        drain_published(self.words, self.slots, self.chain.flags, max_spins=2)
        self.chain.end_forward()
        if land:
            self.copied.copy_(self.target)


HOLD = 3  # forwards a story's first hold-back lasts


def hold_back_story(device: str) -> list[tuple[bool, int]]:
    """A chain's forwards through three hold-backs (HOLD forwards long at first): LATE_LIMIT late drains and calm
    forwards past the first's end, again past the second's (twice as long), then LATE_LIMIT more whose last copy does
    not land until the hold-back's forwards are over. Each forward's (whether its rounds held back, the forwards the
    seen words said were left after its end)."""
    chain = PrefetchChain(1, device, hold_forwards=HOLD)
    copies = LateCopies(chain)
    story = []

    def forward(late: bool = False, land: bool = True) -> None:
        chain.flags[FORWARD] += 1  # as the forward's first step counts it
        held = chain.forwards < chain.resume
        copies.end_forward(late, land)
        if chain.flags.is_cuda:
            torch.cuda.synchronize()  # (`seen` is host memory the end kernel writes: no read waits for it)
        story.append((held, forwards_held(chain.seen_counts())))

    for calm in (HOLD + 1, 2 * HOLD + 1):
        for _ in range(LATE_LIMIT):
            forward(late=True)
        for _ in range(calm):
            forward()
    for i in range(LATE_LIMIT):
        forward(late=True, land=i < LATE_LIMIT - 1)
    for _ in range(4 * HOLD + 2):
        forward(land=False)
    copies.copied.copy_(copies.target)  # the last late copy lands
    for _ in range(2):
        forward()
    return story


def test_a_hold_back_ends_after_its_forwards_doubles_each_time_and_outlasts_a_late_copy():
    """Since session 50 a hold-back ends (before, it lasted the engine's life): every LATE_LIMIT-th late drain holds
    the rounds of the next HOLD forwards back, twice as many each time after, and a hold-back does not end while a late
    copy is still under way: a drain that finds one keeps it in force for the next forward."""
    check_hold_back_story(hold_back_story("cpu"))


def check_hold_back_story(story: list[tuple[bool, int]]) -> None:
    """What hold_back_story's forwards must show, on any device."""
    late = [False] * LATE_LIMIT  # the late drains' own forwards fetch
    first = late + [True] * HOLD + [False]
    second = late + [True] * 2 * HOLD + [False]
    third = late + [True] * (4 * HOLD + 2) + [True, False]  # the copy lands after 4 * HOLD + 2: one more forward
    assert [held for held, _ in story] == first + second + third
    left = [n for _, n in story]
    assert left[: len(first)] == [0, 0, 3, 2, 1, 0, 0]  # told at the hold-back's start, then counted down
    assert left[len(first) + len(second) + LATE_LIMIT - 1] == 4 * HOLD
    assert left[-6:] == [1, 1, 1, 1, 0, 0]  # kept one forward ahead while the copy is late, then over


def test_a_drain_looks_only_after_a_publication_with_entries_and_clears_it_once_all_are_done():
    """PUBLISHED: set by a published list with entries (not by an empty one), cleared by a drain that saw every copy
    done; a drain that finds it clear returns at once, even where a copy would look under way."""
    slots = 4
    _, busy = drain_words([([0, 0, 0, 0, 0], [0, 1, 0, 0, 0])])  # would look under way
    done_tensors, done = drain_words([([0, 3, 0, 0, 0], [0, 3, 0, 0, 0])])
    chain = chain_at(2, forward=5, stepped_upto=1)
    drain_published(busy, slots, chain.flags, max_spins=2)
    assert int(chain.flags[TIMEOUTS]) == 0  # nothing published since the last full drain: not looked at
    mailbox = HostCopier.mailbox(slots, torch.device("cpu"))
    none = torch.full((slots,), -1, dtype=torch.int64)
    publish_admitted(mailbox, chain.flags, none, none, done_tensors[0][1])  # an empty list
    assert int(chain.flags[PUBLISHED]) == 0 and int(mailbox[0]) == 5
    publish_admitted(
        mailbox, chain.flags, torch.tensor([2, -1, -1, -1]), torch.tensor([1, -1, -1, -1]), done_tensors[0][1]
    )
    assert int(chain.flags[PUBLISHED]) == 1
    drain_published(done, slots, chain.flags, max_spins=2)
    assert int(chain.flags[PUBLISHED]) == 0 and int(chain.flags[TIMEOUTS]) == 0


def test_a_published_list_with_holes_is_copied_whole(tmp_path: Path):
    """publish_admitted with -1 entries between listed ones (admit's lists are prefixes; a list with holes must
    still lose nothing): the count reaches the last listed entry and the copier copies every listed one."""
    slots, pitch = 6, 64
    records = torch.arange(8 * pitch, dtype=torch.int64).remainder(251).to(torch.uint8).view(8, pitch)
    dst = torch.zeros(slots, pitch, dtype=torch.uint8)
    copied = torch.zeros(slots, dtype=torch.int64)
    target = torch.tensor([0, 11, 0, 13, 0, 0], dtype=torch.int64)
    mailbox = HostCopier.mailbox(slots, torch.device("cpu"))
    copier = HostCopier(torch.device("cpu"))
    try:
        copier.add_layer(mailbox, records, pitch, [(0, pitch, dst)], copied, slots)
        chain = chain_at(2, forward=7, stepped_upto=0)
        rows = torch.tensor([-1, 5, -1, 2], dtype=torch.int64)
        listed = torch.tensor([-1, 1, -1, 3], dtype=torch.int64)
        publish_admitted(mailbox, chain.flags, rows, listed, target)
        assert int(mailbox[0]) == 7 and int(mailbox[1]) == 4
        end = time.monotonic() + 5
        while copier.stats()["rounds"] < 1:
            assert time.monotonic() < end, "the copier did not serve the round"
            time.sleep(0.001)
        assert torch.equal(dst[1], records[5]) and torch.equal(dst[3], records[2])
        assert torch.equal(copied, target) and not dst[[0, 2, 4, 5]].any()
    finally:
        copier.close()
