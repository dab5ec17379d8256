"""BIGMOE_DEMAND_HOST_COPIER on a real GPU: fused steps that hand their misses to the host copier's thread (the copy
engines) equal the two-launch path step by step, with the completion words copied or written by stream memory
operations (BIGMOE_HOST_COPIER_GOAL_WRITE). Replayed in a graph of several layers: test_step_kernel_gpu.py's
test_fused_steps_of_many_layers_replay_in_one_graph[by-host*]."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.host_copier import MISS_SELF, HostCopier
from bigmoe_pager.core.host_rounds import serve_misses
from bigmoe_pager.core.pager import ExpertPager
from test_step_kernel_gpu import ACQUIRED, STATE, fp8_layout, full_ram, random_ids, slot_bytes  # tests/gpu

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[False, True], ids=["goal-copy", "goal-write"])
def copier(request):
    c = HostCopier(torch.device("cuda"), goal_write=request.param)
    yield c
    c.close()


@pytest.mark.parametrize("experts,slots,tokens,k,policy", [(256, 102, 1, 8, "lfu-duel"), (64, 16, 4, 4, "lru")])
def test_steps_whose_misses_the_host_copies_equal_the_two_launch_path(copier, experts, slots, tokens, k, policy):
    layout = fp8_layout()
    ram = full_ram(layout, experts, seed=experts)
    plain = ExpertPager(layout, experts, slots, ram, device="cuda", policy=policy, decay=64, fused=False)
    handed = ExpertPager(layout, experts, slots, ram, device="cuda", policy=policy, decay=64, fused=True)
    serve_misses(copier, handed)
    rng = random.Random(experts + k)
    hot = rng.sample(range(experts), max(k, experts // 8))
    loaded = 0
    for step in range(200):
        ids = random_ids(rng, experts, tokens, k, hot)
        a, b = plain.acquire(ids), handed.acquire(ids)
        for field in ACQUIRED:
            assert torch.equal(getattr(a, field), getattr(b, field)), (step, field)
        loaded += int(b.loaded)
        if step % 25 == 0 or step == 199:
            for field in STATE:
                assert torch.equal(getattr(plain.vram, field), getattr(handed.vram, field)), (step, field)
            want, got = slot_bytes(plain), slot_bytes(handed)
            full = handed.vram.slot_expert >= 0
            for name in want:
                assert torch.equal(want[name][full], got[name][full]), (step, name)
    torch.cuda.synchronize()
    served = copier.stats()
    assert loaded > 0 and served["error"] == 0 and served["urgent_experts"] == loaded
    assert int(handed.miss_words[MISS_SELF]) == 0  # every miss was the thread's, none the step's own
