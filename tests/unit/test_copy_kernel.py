"""The record copy kernel (run by Triton's interpreter on CPU) equals the torch path."""

from __future__ import annotations

import pytest
import torch
from bigmoe_pager.core.copy_kernel import CopyError, copy_plan, copy_records, copy_records_torch, copy_records_triton
from bigmoe_pager.core.layout import ExpertLayout

LAYOUTS = {
    "fp8-block": ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128),
    "fp8-odd-scales": ExpertLayout.for_moe(384, 96, torch.float8_e4m3fn, block=128),
    "bf16": ExpertLayout.for_moe(64, 32, torch.bfloat16),
    "odd-bytes": ExpertLayout.build([("a", (3, 5), torch.uint8), ("b", (7,), torch.int16), ("c", (2,), torch.float32)]),
    "six-parts": ExpertLayout.build([(f"p{i}", (33 + i,), torch.uint8) for i in range(6)]),
}


def _sentinel_buffers(layout: ExpertLayout, slots: int) -> dict[str, torch.Tensor]:
    bufs = layout.slot_buffers(slots, "cpu")
    for b in bufs.values():
        b.view(b.shape[0], -1).view(torch.uint8).fill_(0xA5)
    return bufs


def _bytes(bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.view(v.shape[0], -1).view(torch.uint8).clone() for k, v in bufs.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("programs", [0, 1, 3], ids=["program-per-block", "one-program-loops", "three-programs-loop"])
def test_kernel_equals_torch_on_random_bytes(name, seed, programs):
    layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (7, layout.pitch), dtype=torch.uint8, generator=g)
    slots = 5
    dst = torch.randperm(slots, generator=g)[:4]
    src = torch.randint(0, 7, (4,), generator=g)
    src[1] = -1  # nothing to do for this entry
    dst[2] = -1
    ref, got = _sentinel_buffers(layout, slots), _sentinel_buffers(layout, slots)
    copy_records_torch(records, src, dst, layout, ref)
    copy_records_triton(records, src, dst, layout, got, block_bytes=1024, programs_per_record=programs)
    for k in ref:
        assert torch.equal(_bytes(ref)[k], _bytes(got)[k]), k
    # And the torch path really copied: each written slot holds its record's bytes.
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0 and d >= 0:
            for c in layout.components:
                want = records[s, c.offset : c.offset + c.nbytes]
                assert torch.equal(_bytes(got)[c.name][d], want)


def test_negative_program_count_is_refused():
    layout = LAYOUTS["bf16"]
    records = torch.zeros((2, layout.pitch), dtype=torch.uint8)
    with pytest.raises(CopyError, match="programs_per_record"):
        copy_records_triton(
            records, torch.tensor([0]), torch.tensor([0]), layout, _sentinel_buffers(layout, 1), 1024, -1
        )


def test_untouched_slots_keep_their_bytes():
    layout = LAYOUTS["fp8-block"]
    records = torch.randint(0, 256, (3, layout.pitch), dtype=torch.uint8)
    bufs = _sentinel_buffers(layout, 4)
    copy_records_triton(records, torch.tensor([2, -1, -1]), torch.tensor([1, -1, 3]), layout, bufs)
    flat = _bytes(bufs)
    for c in layout.components:
        assert (flat[c.name][[0, 2, 3]] == 0xA5).all()


def test_word_size_is_the_widest_that_divides_everything():
    assert copy_plan(LAYOUTS["fp8-block"]).word_bytes == 8
    assert copy_plan(LAYOUTS["odd-bytes"]).word_bytes == 1


@pytest.mark.parametrize(
    "break_it",
    [
        lambda r, b: (r[:, :-1], b),
        lambda r, b: (r, {k: v for k, v in list(b.items())[1:]}),
        lambda r, b: (r, {**b, "w2_weight": b["w2_weight"][:, :, :-1]}),
        lambda r, b: (r.view(torch.int8), b),
    ],
)
def test_mismatched_buffers_are_refused(break_it):
    layout = LAYOUTS["fp8-block"]
    records = torch.zeros((2, layout.pitch), dtype=torch.uint8)
    records, bufs = break_it(records, layout.slot_buffers(2, "cpu"))
    with pytest.raises(CopyError):
        copy_records(records, torch.tensor([0]), torch.tensor([0]), layout, bufs)
