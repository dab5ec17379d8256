"""Codec round trips through the CPU encoder and the reference decoder, on fuzzed records."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import codec_samples as S
from bigmoe_pager.codec import format as F
from bigmoe_pager.codec.encode import encode_component, encode_many, encode_record
from bigmoe_pager.codec.huffman import build_table, verbatim_table
from bigmoe_pager.codec.reference import decode_record
from bigmoe_pager.codec.tables import choose_tables
from bigmoe_pager.core.layout import ExpertLayout

LAYOUTS = {
    "moe_small": S.moe_layout(256, 128),
    # Odd lengths: partial chunks, an odd byte count, components smaller than a chunk.
    "odd": ExpertLayout.build(
        [
            ("a", (3, 1001), torch.float8_e4m3fn),
            ("a_scale", (7,), torch.float32),
            ("b", (5, 7), torch.float8_e4m3fn),
            ("c", (1,), torch.float8_e4m3fn),
        ]
    ),
}


# The pager's geometry, and the shorter-laned ones bench_codec.py measures (one step per 16 lanes of STANDARD's).
GEOMETRIES = [F.STANDARD, F.Geometry(64, 32), F.Geometry(128, 16), F.Geometry(32, 4)]
CHUNK = F.STANDARD.chunk_symbols


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request) -> ExpertLayout:
    return LAYOUTS[request.param]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("pattern", S.PATTERNS)
def test_round_trip_is_bit_exact(layout, pattern, geometry, decode):
    raw = S.pattern_record(layout, pattern, np.random.default_rng(S.PATTERNS.index(pattern)))
    data = encode_record(raw, layout, geometry)
    assert len(data) <= F.max_record_bytes(layout)
    assert F.unpack_header(data).geometry == geometry
    assert np.array_equal(decode(data, layout, geometry), raw)


@pytest.mark.parametrize("geometry", GEOMETRIES[1:], ids=str)
def test_more_lanes_cost_a_byte_each_per_chunk(geometry):
    """Same exponents, same tables: a geometry's records differ from STANDARD's by about their chunk headers."""
    layout = ExpertLayout.build([("w", (16 * CHUNK,), torch.float8_e4m3fn)])
    raw = S.pattern_record(layout, "student_t", np.random.default_rng(8))
    standard, other = len(encode_record(raw, layout)), len(encode_record(raw, layout, geometry))
    headers = layout.record_bytes // geometry.chunk_symbols * geometry.chunk_header_bytes
    standard_headers = layout.record_bytes // CHUNK * F.STANDARD.chunk_header_bytes
    assert abs(other - standard - (headers - standard_headers)) <= 0.01 * standard


@pytest.mark.parametrize(
    "text,why",
    [("12x128", "lanes per chunk"), ("16x3", "steps per lane"), ("256x128", "lanes"), ("128x128", "symbols a chunk")],
)
def test_geometries_the_kernel_cannot_run_are_refused(text, why):
    with pytest.raises(F.CodecError, match=why):
        F.Geometry.parse(text)


def raw_of(layout: ExpertLayout) -> np.ndarray:
    return S.pattern_record(layout, "gaussian", np.random.default_rng(0))


LANES_AT, BITS_AT = 26, 27  # header bytes (HEADER: ... chunk symbols u16 at 24, lanes u8, max code bits u8)


@pytest.mark.parametrize(
    "at,value,why",
    [(LANES_AT, 12, "not one this build reads"), (BITS_AT, 7, "not one this build reads"), (LANES_AT, 32, "expected")],
)
def test_a_header_naming_another_geometry_is_refused(at, value, why, decode):
    """One this build cannot read; or a readable one other than the decoder expects (the crc32 does not cover
    the header, so a decoder never takes a record's word for its geometry)."""
    layout = ExpertLayout.build([("w", (2 * CHUNK,), torch.float8_e4m3fn)])
    data = bytearray(encode_record(raw_of(layout), layout))
    assert F.unpack_dir(data, 0).kind == F.KIND_FP8
    data[at] = value
    with pytest.raises(F.CodecError, match=why):
        decode(bytes(data), layout)
    with pytest.raises(F.CodecError, match="geometry"):
        decode(encode_record(raw_of(layout), layout, F.Geometry(64, 32)), layout)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_chunks_round_trip(seed, decode):
    """Chunks of different kinds side by side in one component (tables chosen per chunk)."""
    rng = np.random.default_rng(seed)
    layout = ExpertLayout.build([("w", (6 * CHUNK - 5,), torch.float8_e4m3fn)])
    kinds = rng.choice(S.PATTERNS, 6)
    data = np.concatenate([S.pattern_bytes(k, CHUNK, rng) for k in kinds])[: layout.record_bytes]
    assert np.array_equal(decode(encode_record(data, layout), layout), data)


@pytest.mark.parametrize(
    "pattern,most", [("constant", 0.52), ("skewed", 0.66), ("student_t", 0.87), ("random", 1.02), ("uniform_exp", 1.02)]
)
def test_sizes_follow_the_exponent_entropy(pattern, most):
    layout = ExpertLayout.build([("w", (4 * CHUNK,), torch.float8_e4m3fn)])
    raw = S.pattern_record(layout, pattern, np.random.default_rng(3))
    assert len(encode_record(raw, layout)) / layout.record_bytes <= most


@pytest.mark.parametrize("pattern", ["random", "uniform_exp"])
def test_components_that_would_not_shrink_are_stored_raw(layout, pattern):
    raw = S.pattern_record(layout, pattern, np.random.default_rng(6))
    data = encode_record(raw, layout)
    kinds = [F.unpack_dir(data, i).kind for i in range(len(layout.components))]
    assert kinds == [F.KIND_RAW] * len(layout.components)
    assert len(data) <= F.max_record_bytes(layout) <= layout.record_bytes + 64 + 32 * len(layout.components)


@pytest.mark.parametrize("geometry", [F.STANDARD, F.Geometry(128, 16)], ids=str)
@pytest.mark.parametrize("pattern", ["random", "uniform_exp"])
def test_chunks_that_would_not_shrink_are_flagged_verbatim(pattern, geometry):
    data = S.pattern_bytes(pattern, 3 * geometry.chunk_symbols, np.random.default_rng(5))
    coded = encode_component(data, geometry)
    headers = np.frombuffer(coded.chunks, geometry.chunk_dtype)
    assert coded.verbatim_chunks == 3
    assert (headers["flags"] == F.FLAG_VERBATIM).all()
    assert coded.stream.size == 3 * geometry.chunk_symbols * F.VERBATIM_BITS // 32


def test_real_expert_reaches_the_ratio_target():
    """qwen3.6-35b-a3b expert, Student-t(5) weights: <= 0.86 of raw, within 1.5% of the per-row bound."""
    layout = S.moe_layout(*S.SHAPES["qwen3.6-35b-a3b"])
    raw = S.expert_record(layout, "student_t", np.random.default_rng(0))
    data = encode_record(raw, layout)
    ratio = len(data) / layout.record_bytes
    bound = S.exponent_entropy_bound(raw, layout)
    assert ratio <= 0.86
    assert ratio <= bound * 1.015
    assert np.array_equal(decode_record(data, layout), raw)


def test_encode_accepts_a_zero_padded_pitch_and_rejects_other_input():
    layout = LAYOUTS["moe_small"]
    raw = S.pattern_record(layout, "gaussian", np.random.default_rng(1))
    padded = np.zeros(layout.pitch, np.uint8)
    padded[: raw.size] = raw
    assert encode_record(padded, layout) == encode_record(raw, layout)
    padded[-1] = 1
    with pytest.raises(F.CodecError, match="padding"):
        encode_record(padded, layout)
    with pytest.raises(F.CodecError, match="bytes"):
        encode_record(raw[:-1], layout)
    with pytest.raises(F.CodecError, match="uint8"):
        encode_record(raw.view(np.int8), layout)


def test_encode_many_keeps_order_across_processes_taking_few_records_ahead():
    """A whole model's records stream through, in order: never more than AHEAD_PER_WORKER a worker read ahead."""
    from bigmoe_pager.codec.encode import AHEAD_PER_WORKER

    layout = LAYOUTS["odd"]
    rng = np.random.default_rng(4)
    raws = [S.pattern_record(layout, "student_t", rng) for _ in range(12)]
    taken = []

    def source():
        for i, raw in enumerate(raws):
            taken.append(i)
            yield raw

    out = []
    for record in encode_many(source(), layout, workers=2, geometry=F.Geometry(64, 32)):
        assert len(taken) <= len(out) + 1 + AHEAD_PER_WORKER * 2
        out.append(record)
    assert out == [encode_record(r, layout, F.Geometry(64, 32)) for r in raws]


def test_pitch_covers_the_largest_record():
    assert F.record_pitch([100, 4097, 17]) == 4112
    with pytest.raises(ValueError):
        F.record_pitch([])


@pytest.mark.parametrize(
    "counts",
    [
        [5, 0, 0, 1, 100, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
        [1] * 16,
        [2**i for i in range(16)],  # would want 15-bit codes unlimited
        [0] * 7 + [9] + [0] * 8,
    ],
)
def test_huffman_tables_are_complete_prefix_codes_of_at_most_8_bits(counts):
    t = build_table(np.array(counts))
    present = np.array(counts) > 0
    assert ((t.lengths >= 0) == present).all()
    assert t.lengths.max() <= F.MAX_CODE_BITS
    if present.sum() > 1:
        assert sum(2.0 ** -int(n) for n in t.lengths[present]) == 1.0  # Kraft equality: no wasted code space
    lut = t.lut
    for s in np.flatnonzero(present):  # decoding each code through the LUT gives the symbol and length back
        n = int(t.lengths[s])
        entry = lut[int(t.codes[s]) << (F.MAX_CODE_BITS - n)]
        assert (entry & 0xF, entry >> 4) == (s, n)


def test_verbatim_table_is_the_identity():
    lut = verbatim_table().lut
    assert (lut & 0xF == np.arange(256) >> 4).all() and (lut >> 4 == 4).all()


def test_table_choice_separates_different_chunk_statistics():
    """Chunks drawn from two very different exponent laws get two tables and each costs less than one table."""
    rng = np.random.default_rng(4)
    low = rng.multinomial(8192, [0.5, 0.3, 0.1, 0.1] + [0] * 12, size=20)
    high = rng.multinomial(8192, [0] * 12 + [0.1, 0.1, 0.3, 0.5], size=20)
    hist = np.concatenate([low, high])
    tables, assign, bits = choose_tables(hist)
    assert len(tables) == 2
    assert len(set(assign[:20])) == 1 and len(set(assign[20:])) == 1 and assign[0] != assign[20]
    one = build_table(hist.sum(axis=0)).cost_bits(hist)
    assert (bits < one).all()
