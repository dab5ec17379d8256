"""The Triton decoder, run by Triton's interpreter on CPU tensors (tests/unit/conftest.py sets TRITON_INTERPRET=1).

The interpreter costs seconds per program whatever its size, so one launch carries
every case: a record mixing chunk kinds (verbatim, zero-bit, Huffman, NaNs, a
partial chunk) in an odd-length component (byte stores) and an aligned one
(word stores), a skipped entry, a record with a bad header and one with
malformed lanes. Real sizes run on the GPU (tests/gpu/test_codec_gpu.py).
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
from bigmoe_pager.codec.triton_decode import DecodeError, decode_into_slots, new_errors
from bigmoe_pager.core.layout import ExpertLayout

LAYOUT = ExpertLayout.build(
    [
        ("a", (5, 8191), torch.float8_e4m3fn),  # 5 chunks, the last one partial; odd length
        ("a_scale", (3, 5), torch.float32),
        ("b", (4, 2048), torch.float8_e4m3fn),  # one whole chunk
        ("c", (3000,), torch.float8_e4m3fn),  # random bytes: stored raw, copied by the FP8 kernel
    ]
)
MOSAIC = ("random", "constant", "student_t", "nan", "skewed")
FILL = 0xA5  # slot bytes before decoding


def mosaic_record(rng: np.random.Generator) -> np.ndarray:
    raw = S.pattern_record(LAYOUT, "gaussian", rng)
    a = LAYOUT["a"]
    parts = np.concatenate([S.pattern_bytes(p, F.STANDARD.chunk_symbols, rng) for p in MOSAIC])
    raw[a.offset : a.offset + a.nbytes] = parts[: a.nbytes]
    c = LAYOUT["c"]
    raw[c.offset : c.offset + c.nbytes] = rng.integers(0, 256, c.nbytes, dtype=np.uint8)
    return raw


def malformed(record: bytes) -> bytes:
    """Component a: stream outside the record (caught before decoding); b: two lanes' lengths swapped a bit."""
    data = bytearray(record)
    struct.pack_into("<I", data, F.directory_offset(0) + 16, len(data))
    at = F.unpack_dir(data, 2).chunks_offset + F.CHUNK_HEADER.size
    deltas = list(data[at : at + F.STANDARD.lanes])
    give = next(i for i, d in enumerate(deltas) if d > 0)
    take = next(i for i, d in enumerate(deltas) if d < 255 and i != give)
    data[at + give] -= 1
    data[at + take] += 1
    return bytes(data)


def stage(records: list[bytes]) -> tuple[torch.Tensor, list[int]]:
    """Records end to end in one uint8 tensor, each at a multiple of STAGING_ALIGN."""
    offsets, blob = [], bytearray()
    for r in records:
        offsets.append(len(blob))
        blob += r + bytes(F.align(len(r), F.STAGING_ALIGN) - len(r))
    return torch.frombuffer(blob, dtype=torch.uint8), offsets


def slot_record(slots: dict[str, torch.Tensor], slot: int) -> np.ndarray:
    """The record a slot holds (padding between components zero)."""
    out = np.zeros(LAYOUT.record_bytes, np.uint8)
    for c in LAYOUT.components:
        out[c.offset : c.offset + c.nbytes] = slot_bytes(slots, slot, c.name)
    return out


def slot_bytes(slots: dict[str, torch.Tensor], slot: int, name: str) -> np.ndarray:
    return slots[name][slot].contiguous().view(-1).view(torch.uint8).numpy()


def untouched(slots: dict[str, torch.Tensor], slot: int) -> bool:
    return all((slot_bytes(slots, slot, c.name) == FILL).all() for c in LAYOUT.components)


# Kernel shapes: the default (prefetch, 8 chunks x 16 lanes over 4 warps) and the plain-load loop on one warp.
SHAPES = [
    pytest.param(dict(), id="default"),
    pytest.param(dict(prefetch=False, chunks_per_program=2, num_warps=1), id="no-prefetch-1warp"),
]


@pytest.fixture(scope="module", params=SHAPES)
def decoded(request):
    raw = mosaic_record(np.random.default_rng(7))
    good = encode_record(raw, LAYOUT)
    bad_header = bytearray(good)
    bad_header[0:4] = b"JUNK"
    staging, offs = stage([good, bytes(bad_header), malformed(good)])
    work = torch.tensor([[offs[0], 2], [offs[0], -1], [offs[1], 1], [offs[2], 3], [offs[0] + 8, 4]], dtype=torch.int64)
    slots = LAYOUT.slot_buffers(5, "cpu")
    for t in slots.values():
        t.view(torch.uint8).fill_(FILL)
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, LAYOUT, errors, **request.param)
    return raw, slots, errors


def test_kernel_output_equals_the_original_bytes(decoded):
    raw, slots, errors = decoded
    assert errors[0] == 0
    assert np.array_equal(slot_record(slots, 2), raw)


def test_the_mosaic_covers_every_storage_kind():
    data = encode_record(mosaic_record(np.random.default_rng(7)), LAYOUT)
    kinds = [F.unpack_dir(data, i).kind for i in range(len(LAYOUT.components))]
    assert kinds == [F.KIND_FP8, F.KIND_RAW, F.KIND_FP8, F.KIND_RAW]
    a = F.unpack_dir(data, 0)
    g = F.STANDARD
    headers = np.frombuffer(data[a.chunks_offset : a.chunks_offset + 5 * g.chunk_header_bytes], g.chunk_dtype)
    assert headers["flags"][0] == F.FLAG_VERBATIM and a.tables >= 2


def test_skipped_entries_leave_their_slot_untouched(decoded):
    _, slots, errors = decoded
    assert errors[1] == 0
    assert untouched(slots, 0)


@pytest.mark.parametrize("entry,slot", [(2, 1), (4, 4)])  # bad magic; offset not a multiple of STAGING_ALIGN
def test_a_bad_header_is_reported_and_nothing_is_written(decoded, entry, slot):
    _, slots, errors = decoded
    assert errors[entry] > 0
    assert untouched(slots, slot)


def test_malformed_sections_and_lanes_are_reported(decoded):
    _, _, errors = decoded
    # Component a's stream lies outside the record (1); in b the lane cut short overruns its length (>= 1; the
    # other lane may resynchronise, Huffman codes do, which is why the host checks each record's crc32).
    assert errors[3] >= 2


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(work=a["work"].to(torch.int32)), "work must be"),
        (lambda a: a.update(errors=torch.zeros(9, dtype=torch.int32)), "errors must be"),
        (lambda a: a["slots"].pop("a_scale"), "a_scale"),
        (lambda a: a["slots"].update(b=torch.zeros(2, 4, 2048, dtype=torch.uint8)), "slot buffer b"),
    ],
)
def test_mismatched_tensors_are_refused(change, message):
    args = {
        "work": torch.zeros(2, 2, dtype=torch.int64),
        "errors": torch.zeros(2, dtype=torch.int32),
        "slots": LAYOUT.slot_buffers(2, "cpu"),
    }
    change(args)
    with pytest.raises(DecodeError, match=message):
        decode_into_slots(torch.zeros(64, dtype=torch.uint8), args["work"], args["slots"], LAYOUT, args["errors"])


@pytest.mark.parametrize("geometry", [F.Geometry(64, 32), F.Geometry(128, 16)], ids=str)
def test_a_kernel_built_for_another_geometry_decodes_its_records_and_refuses_others(geometry):
    """bench_codec.py's shorter-laned geometries: same bytes out; a STANDARD record fails the header check."""
    raw = mosaic_record(np.random.default_rng(9))
    staging, offs = stage([encode_record(raw, LAYOUT, geometry), encode_record(raw, LAYOUT)])
    work = torch.tensor([[offs[0], 0], [offs[1], 1]], dtype=torch.int64)
    slots = LAYOUT.slot_buffers(2, "cpu")
    for t in slots.values():
        t.view(torch.uint8).fill_(FILL)
    errors = new_errors(work)
    decode_into_slots(staging, work, slots, LAYOUT, errors, geometry=geometry, chunks_per_program=1)
    assert errors[0] == 0
    assert np.array_equal(slot_record(slots, 0), raw)
    assert errors[1] > 0
    assert untouched(slots, 1)
