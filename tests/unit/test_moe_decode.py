"""The decode MoE kernel (Triton's interpreter here) against the plain reference MoE."""

from __future__ import annotations

import pytest
import torch
from bigmoe_bench import moe_ref
from bigmoe_bench.moe_decode import ExpertWeights, MoeShapeError, moe_decode
from bigmoe_pager.core.layout import ExpertLayout


def _experts(fp8: bool, n: int, seed: int):
    layout = ExpertLayout.for_moe(64, 48, torch.float8_e4m3fn if fp8 else torch.bfloat16, block=32 if fp8 else None)
    g = torch.Generator().manual_seed(seed)
    records = torch.zeros((n, layout.pitch), dtype=torch.uint8)
    for e in range(n):
        parts = {}
        for c in layout.components:
            if c.dtype == torch.float32:
                parts[c.name] = torch.rand(c.shape, generator=g) * 0.1 + 0.01
            else:
                parts[c.name] = (torch.randn(c.shape, generator=g) * 0.5).to(c.dtype)
        layout.pack(parts, records[e])
    slots = layout.slot_buffers(n, "cpu")
    for e in range(n):
        for name, view in layout.views(records[e]).items():
            slots[name][e].copy_(view)
    return layout, records, slots


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fp8", [True, False])
def test_kernel_matches_reference_from_slots_and_from_records(fp8):
    layout, records, slots = _experts(fp8, 6, seed=1)
    block = 32 if fp8 else None
    g = torch.Generator().manual_seed(2)
    x = torch.randn((2, 64), generator=g).to(torch.bfloat16)
    ids = torch.tensor([[3, 0, -1], [5, 3, 1]])
    w = torch.rand((2, 3), generator=g)
    want = moe_ref.moe(x, ids, w, slots, block)
    got = moe_decode(x, ids, w, ExpertWeights.from_slots(slots, block))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    strided = moe_decode(x, ids, w, ExpertWeights.from_records(records, layout, block))
    assert torch.equal(strided, got)


def test_wrong_hidden_size_is_refused():
    layout, records, slots = _experts(False, 2, seed=0)
    with pytest.raises(MoeShapeError):
        moe_decode(
            torch.zeros((1, 32)),
            torch.zeros((1, 1), dtype=torch.int64),
            torch.ones((1, 1)),
            ExpertWeights.from_slots(slots, None),
        )
