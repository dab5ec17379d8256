"""The Triton decoder on a real GPU: real expert sizes, CUDA-graph replay, corrupt records.

Run on the H200 from the repo root: PYTHONPATH=pager:app python -m pytest tests/gpu/test_codec_gpu.py -q
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import codec_samples as S
from bigmoe_pager.codec import format as F
from bigmoe_pager.codec.encode import encode_record
from bigmoe_pager.codec.triton_decode import decode_into_slots, new_errors
from bigmoe_pager.core.layout import ExpertLayout

pytestmark = pytest.mark.gpu
FILL = 0xA5
PATTERNS = ("student_t", "gaussian", "random", "all_values", "constant", "skewed", "uniform_exp", "nan")
ODD = ExpertLayout.build(
    [("a", (3, 30001), torch.float8_e4m3fn), ("s", (5,), torch.float32), ("b", (7, 9), torch.float8_e4m3fn)]
)


def stage(records: list[bytes], device="cuda") -> tuple[torch.Tensor, list[int]]:
    offsets, blob = [], bytearray()
    for r in records:
        offsets.append(len(blob))
        blob += r + bytes(F.align(len(r), F.STAGING_ALIGN) - len(r))
    return torch.frombuffer(blob, dtype=torch.uint8).to(device), offsets


def slot_record(layout: ExpertLayout, slots: dict[str, torch.Tensor], slot: int) -> np.ndarray:
    out = np.zeros(layout.record_bytes, np.uint8)
    for c in layout.components:
        out[c.offset : c.offset + c.nbytes] = slots[c.name][slot].reshape(-1).view(torch.uint8).cpu().numpy()
    return out


def untouched(layout: ExpertLayout, slots: dict[str, torch.Tensor], slot: int) -> bool:
    return all(bool((slots[c.name][slot].reshape(-1).view(torch.uint8) == FILL).all()) for c in layout.components)


def fresh_slots(layout: ExpertLayout, n: int) -> dict[str, torch.Tensor]:
    slots = layout.slot_buffers(n, "cuda")
    for t in slots.values():
        t.view(torch.uint8).fill_(FILL)
    return slots


KERNEL_SHAPES = [  # (chunks per program, warps, prefetch): the default and the shapes bench_codec.py sweeps
    dict(),
    dict(chunks_per_program=2, num_warps=1, prefetch=True),
    dict(chunks_per_program=4, num_warps=2, prefetch=False),
    dict(chunks_per_program=16, num_warps=4, prefetch=True),
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "default")
@pytest.mark.parametrize("preset", sorted(S.SHAPES))
def test_real_size_records_decode_bit_exact(preset, shape):
    layout = S.moe_layout(*S.SHAPES[preset])
    rng = np.random.default_rng(0)
    raws = [
        S.expert_record(layout, p, rng) if p in ("student_t", "gaussian") else S.pattern_record(layout, p, rng)
        for p in PATTERNS
    ]
    staging, offs = stage([encode_record(r, layout) for r in raws])
    # Records land in reversed slots; slot len(raws) stays empty (skipped entry).
    work = torch.tensor(
        [[o, len(raws) - 1 - i] for i, o in enumerate(offs)] + [[offs[0], -1]], dtype=torch.int64, device="cuda"
    )
    slots = fresh_slots(layout, len(raws) + 1)
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, layout, errors, **shape)
    torch.cuda.synchronize()
    assert errors.sum().item() == 0
    for i, raw in enumerate(raws):
        assert np.array_equal(slot_record(layout, slots, len(raws) - 1 - i), raw), PATTERNS[i]
    assert untouched(layout, slots, len(raws))


@pytest.mark.parametrize("geometry,shape", [("64x32", (2, 4)), ("128x16", (1, 4)), ("128x16", (2, 8))])
def test_shorter_laned_geometries_decode_bit_exact_in_a_graph(geometry, shape):
    """bench_codec.py's other geometries at a real size, replayed from a CUDA graph; a STANDARD record is refused."""
    g = F.Geometry.parse(geometry)
    layout = S.moe_layout(*S.SHAPES["qwen3.8-flash-next"])
    rng = np.random.default_rng(4)
    raws = [S.expert_record(layout, law, rng) for law in ("student_t", "gaussian")]
    staging, offs = stage([encode_record(r, layout, g) for r in raws] + [encode_record(raws[0], layout)])
    work = torch.tensor([[offs[0], 1], [offs[1], 0], [offs[2], 2]], dtype=torch.int64, device="cuda")
    slots = fresh_slots(layout, 3)
    errors = new_errors(work)
    kw = dict(chunks_per_program=shape[0], num_warps=shape[1], geometry=g)
    decode_into_slots(staging, work, slots, layout, errors, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    slots = fresh_slots(layout, 3)
    errors.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_into_slots(staging, work, slots, layout, errors, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert errors[:2].sum().item() == 0 and errors[2].item() > 0
    assert np.array_equal(slot_record(layout, slots, 1), raws[0])
    assert np.array_equal(slot_record(layout, slots, 0), raws[1])
    assert untouched(layout, slots, 2)


def test_odd_lengths_use_byte_stores_and_decode_bit_exact():
    rng = np.random.default_rng(1)
    raws = [S.pattern_record(ODD, p, rng) for p in PATTERNS]
    staging, offs = stage([encode_record(r, ODD) for r in raws])
    work = torch.tensor([[o, i] for i, o in enumerate(offs)], dtype=torch.int64, device="cuda")
    slots = fresh_slots(ODD, len(raws))
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, ODD, errors)
    torch.cuda.synchronize()
    assert errors.sum().item() == 0
    for i, raw in enumerate(raws):
        assert np.array_equal(slot_record(ODD, slots, i), raw), PATTERNS[i]


def test_cuda_graph_replay_decodes_what_the_work_list_says_now():
    layout = S.moe_layout(*S.SHAPES["qwen3.6-35b-a3b"])
    rng = np.random.default_rng(2)
    raws = [S.expert_record(layout, "student_t", rng) for _ in range(4)]
    staging, offs = stage([encode_record(r, layout) for r in raws])
    work = torch.tensor([[offs[0], 0], [offs[1], -1]], dtype=torch.int64, device="cuda")
    slots = fresh_slots(layout, 4)
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, layout, errors)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_into_slots(staging, work, slots, layout, errors)
    for step in ([[offs[2], 3], [offs[3], 1]], [[offs[1], 2], [offs[0], -1]]):
        work.copy_(torch.tensor(step, dtype=torch.int64))
        graph.replay()
    torch.cuda.synchronize()
    assert errors.sum().item() == 0
    for slot, raw in ((0, raws[0]), (3, raws[2]), (1, raws[3]), (2, raws[1])):
        assert np.array_equal(slot_record(layout, slots, slot), raw)


def test_corrupt_records_are_reported_and_bad_headers_write_nothing():
    layout = S.moe_layout(*S.SHAPES["qwen3.8-flash-next"])
    good = encode_record(S.expert_record(layout, "gaussian", np.random.default_rng(3)), layout)
    wrong_layout = encode_record(
        S.expert_record(S.moe_layout(2048, 512), "gaussian", np.random.default_rng(3)), S.moe_layout(2048, 512)
    )
    junk = bytearray(good)
    junk[:4] = b"JUNK"
    lanes = bytearray(good)
    at = F.unpack_dir(lanes, 0).chunks_offset + F.CHUNK_HEADER.size
    lanes[at] = (lanes[at] + 7) % 256  # one lane 7 bits longer: the chunk no longer adds up
    outside = bytearray(good)
    struct.pack_into("<I", outside, F.directory_offset(1) + 16, len(outside) - 4)
    records = [good, bytes(junk), wrong_layout, bytes(lanes), bytes(outside)]
    staging, offs = stage(records)
    work = torch.tensor(
        [[o, i] for i, o in enumerate(offs)] + [[staging.numel() + 64, 5]], dtype=torch.int64, device="cuda"
    )
    slots = fresh_slots(layout, 6)
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, layout, errors)
    torch.cuda.synchronize()
    got = errors.tolist()
    assert got[0] == 0 and all(e > 0 for e in got[1:]), got
    for slot in (1, 2, 5):  # bad magic, another layout, offset past the staging buffer: nothing written
        assert untouched(layout, slots, slot)
