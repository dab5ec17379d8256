"""Experts that leave RAM leave the engine's memory: with RAM slots for a quarter of the
experts, the engine's anonymous resident memory drops by about the bytes of the rest.

The measure is RssAnon after a garbage collection and malloc_trim (greedy_tokens.rss_anon_kb), so memory the
allocator keeps after a free is not counted as held. The saving is 70% of the model's experts, so that the two
engines' other memory, which varies by some tens of MiB from run to run (CI once saw 85 MiB when half the
experts left), stays small beside it."""

from __future__ import annotations

import sys

import pytest
from test_pager_vllm import greedy

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

LAYERS, EXPERTS, HIDDEN, INTER = 4, 96, 512, 512
EXPERT_BYTES = 3 * HIDDEN * INTER * 2  # bf16 gate, up, down


def test_rss_drops_by_the_experts_that_left(tiny_checkpoint):
    tiny = sys.modules["make_tiny_moe"]
    shape = tiny.TinyShape(layers=LAYERS, experts=EXPERTS, top_k=4, hidden=HIDDEN, moe_intermediate=INTER)
    assert LAYERS * EXPERTS * EXPERT_BYTES >= 512 << 20
    model = tiny_checkpoint(shape, "bf16", seed=5)
    vram, ram = 4, EXPERTS // 4
    plain_tokens, plain_kb = greedy(model, {}, max_tokens=8)
    paged_tokens, paged_kb = greedy(
        model, {"BIGMOE_PAGER": "1", "BIGMOE_VRAM_SLOTS": str(vram), "BIGMOE_RAM_SLOTS": str(ram)}, max_tokens=8
    )
    assert paged_tokens == plain_tokens
    expected = LAYERS * (EXPERTS - ram - vram) * EXPERT_BYTES
    saved = (plain_kb - paged_kb) * 1024
    print(
        f"unpaged {plain_kb / 1024:.0f} MiB, paged {paged_kb / 1024:.0f} MiB, "
        f"saved {saved / 2**20:.0f} MiB, expected {expected / 2**20:.0f} MiB"
    )
    assert 0.7 * expected <= saved <= 1.3 * expected
