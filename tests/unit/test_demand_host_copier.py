"""BIGMOE_DEMAND_HOST_COPIER: a fused step hands its misses to the host copier's thread and waits for them.

Run by Triton's interpreter beside the copier's CPU mode (memcpy, release stores): step by step the step must equal
the two-launch path (outputs, table state, counters, slot bytes), every miss must have been copied by the thread (its
urgent count), and a copier that never copies must cost time, never bytes: the step copies the misses itself and
counts them."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.host_copier import MISS_SELF, MISS_SEQ, HostCopier
from bigmoe_pager.core.host_rounds import serve_misses
from test_round_sync import assert_same
from test_step_kernel import pager_pair, records, slot_bytes, step_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

CPU = torch.device("cpu")
PATIENT = 1 << 20  # polls before a step gives up on the host: the thread copies a tiny expert in microseconds


@pytest.fixture
def copier():
    c = HostCopier(CPU, ring_words=1 << 12)
    yield c
    c.close()


@pytest.mark.parametrize(
    "experts,slots,tokens,k,policy,programs",
    [(40, 10, 1, 8, "lru", 3), (30, 5, 3, 4, "lfu", 2), (64, 16, 2, 4, "lfu-duel", 3)],
)
def test_a_step_whose_misses_the_host_copies_equals_the_two_launch_path(
    copier, experts, slots, tokens, k, policy, programs
):
    rng = random.Random(experts + slots)
    (fused, fstats), (plain, pstats) = pager_pair(experts, slots, policy, programs, records(experts, seed=slots))
    serve_misses(copier, fused)
    fused.sync_max_spins = PATIENT
    hot = rng.sample(range(experts), max(k, experts // 4))
    loaded = 0
    for step in range(20):
        ids = step_ids(rng, experts, tokens, k, hot)
        a, b = plain.acquire(ids), fused.acquire(ids)
        assert_same(plain, fused, a, b, step)  # outputs, table state, slot bytes
        loaded += int(b.loaded)
    state = fused.vram.kernel_state()
    assert torch.equal(pstats.device_counts, fstats.device_counts)
    assert loaded > 0
    assert copier.stats()["urgent_experts"] == loaded  # every miss copied by the thread
    assert int(fused.miss_words[MISS_SELF]) == 0 and int(fused.miss_words[MISS_SEQ]) > 0
    assert torch.equal(state["copied"], state["target"])  # no copy left under way


def test_a_copier_that_never_copies_costs_time_not_bytes():
    """The thread is stopped before the steps: each step waits its few polls, then copies its misses itself."""
    experts, slots = 24, 6
    rng = random.Random(3)
    (fused, _), (plain, _) = pager_pair(experts, slots, "lru", 2, records(experts, seed=1))
    stopped = HostCopier(CPU, ring_words=1 << 10)
    serve_misses(stopped, fused)
    stopped.close()
    fused.sync_max_spins = 3
    loaded = 0
    for step in range(8):
        ids = step_ids(rng, experts, 1, 4, list(range(experts)))
        a, b = plain.acquire(ids), fused.acquire(ids)
        assert torch.equal(a.remapped, b.remapped), step
        want, got = slot_bytes(plain), slot_bytes(fused)
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
        loaded += int(b.loaded)
    state = fused.vram.kernel_state()
    assert loaded > 0 and int(fused.miss_words[MISS_SELF]) == loaded
    assert torch.equal(state["copied"], state["target"])  # counted as landed: a later wait does not stall on them
