"""Corrupt or malformed records are reported with CodecError, never decoded into weights."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from bigmoe_bench import codec_samples as S
from bigmoe_pager.codec import format as F
from bigmoe_pager.codec.encode import encode_record
from bigmoe_pager.codec.reference import decode_record, verify_record

LAYOUT = S.moe_layout(256, 128)


@pytest.fixture(scope="module")
def record() -> bytes:
    raw = S.expert_record(LAYOUT, "student_t", np.random.default_rng(0))
    return encode_record(raw, LAYOUT)


def reseal(data: bytearray) -> bytes:
    """The record with its payload crc32 recomputed: only the structural checks can catch what follows."""
    struct.pack_into("<I", data, 20, zlib.crc32(data[F.HEADER.size :]))
    return bytes(data)


def chunk_header_offset(data: bytes, component: int, chunk: int) -> int:
    return F.unpack_dir(data, component).chunks_offset + chunk * F.STANDARD.chunk_header_bytes


@pytest.mark.parametrize("where", [0.05, 0.3, 0.6, 0.99])
def test_a_flipped_payload_byte_fails_the_checksum(record, where, decode):
    data = bytearray(record)
    i = F.HEADER.size + int(where * (len(data) - F.HEADER.size - 1))
    data[i] ^= 0x10
    with pytest.raises(F.CodecError, match="checksum"):
        decode(bytes(data), LAYOUT)


@pytest.mark.parametrize("cut", [-1, 8, -100])
def test_a_record_cut_short_or_padded_is_refused(record, cut):
    data = record[:cut] if cut < 0 else record + bytes(cut)
    with pytest.raises(F.CodecError, match="bytes"):
        verify_record(data, LAYOUT)


def test_a_record_of_another_layout_is_refused(record, decode):
    with pytest.raises(F.CodecError, match="another expert layout"):
        decode(record, S.moe_layout(128, 128))


@pytest.mark.parametrize(
    "offset,value,message",
    [
        (0, b"XXXX", "not a"),
        (4, struct.pack("<H", F.CODEC_VERSION + 1), "version"),
        (24, struct.pack("<H", 4096), "geometry"),
    ],
)
def test_header_fields_are_checked(record, offset, value, message, decode):
    data = bytearray(record)
    data[offset : offset + len(value)] = value
    with pytest.raises(F.CodecError, match=message):
        decode(reseal(data), LAYOUT)


def test_a_short_buffer_is_not_a_record():
    with pytest.raises(F.CodecError, match="shorter"):
        verify_record(b"BXF8", LAYOUT)


def _set_table(data: bytearray, value: int) -> None:
    data[chunk_header_offset(data, 0, 1) + 4] = value


def _shift_lane(data: bytearray, value: int) -> None:
    """Move a bit from one lane's length to another's: the chunk total stays, the split is wrong."""
    at = chunk_header_offset(data, 0, 0) + F.CHUNK_HEADER.size
    deltas = list(data[at : at + F.STANDARD.lanes])
    give = next(i for i, d in enumerate(deltas) if d > 0)
    take = next(i for i, d in enumerate(deltas) if d < 255 and i != give)
    data[at + give] -= 1
    data[at + take] += 1


def _move_chunk(data: bytearray, value: int) -> None:
    at = chunk_header_offset(data, 1, 2)
    struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] + 1)


def _flag_verbatim(data: bytearray, value: int) -> None:
    data[chunk_header_offset(data, 0, 0) + 5] = F.FLAG_VERBATIM


def _section_outside(data: bytearray, value: int) -> None:
    struct.pack_into("<I", data, F.directory_offset(1) + 16, len(data) - 8)


def _wrong_kind(data: bytearray, value: int) -> None:
    data[F.directory_offset(2)] = F.KIND_FP8


@pytest.mark.parametrize(
    "tamper,message",
    [
        (_set_table, "table"),
        (_shift_lane, "malformed stream"),
        (_move_chunk, "partition"),
        (_flag_verbatim, "identity|verbatim"),
        (_section_outside, "outside"),
        (_wrong_kind, "kind"),
    ],
)
def test_structural_damage_with_a_valid_checksum_is_detected(record, tamper, message, decode):
    data = bytearray(record)
    tamper(data, 200)
    with pytest.raises(F.CodecError, match=message):
        decode(reseal(data), LAYOUT)


def _outcome(decoder, data: bytes, layout=LAYOUT, geometry=F.STANDARD):
    try:
        return decoder(data, layout, geometry).tobytes()
    except F.CodecError:
        return "refused"


def _c_decoder(layout, geometry):
    from bigmoe_pager.codec.host_decoder import HostDecoder

    host = HostDecoder(layout, geometry)

    def decode(data, layout, geometry):
        out = np.empty(layout.record_bytes, np.uint8)
        host.decode_into(np.frombuffer(data, np.uint8), layout, out)
        return out

    return decode


@pytest.mark.parametrize("geometry", [F.STANDARD, F.Geometry(64, 32)], ids=str)
@pytest.mark.parametrize("pattern", ["student_t", "skewed"])
def test_the_c_decoder_agrees_with_the_reference_on_damaged_records(pattern, geometry):
    """Bytes overwritten anywhere (the header too), some records cut short, most resealed so only the structure can
    tell: the C decoder refuses exactly what the reference refuses and otherwise gives the same bytes (Huffman codes
    resynchronize, so some damage decodes to other weights: what the paging file's crc32 is for). Damaged code tables
    included, whose pairs the C decoder must not guess. It never reads outside the record (ASan-clean, session 38)."""
    rng = np.random.default_rng(sum(map(ord, pattern)) + geometry.lanes)
    data = encode_record(S.pattern_record(LAYOUT, pattern, rng), LAYOUT, geometry)
    c_decode = _c_decoder(LAYOUT, geometry)
    outcomes = {"refused": 0, "decoded": 0}
    for trial in range(60):
        damaged = bytearray(data)
        for i in rng.integers(F.HEADER.size if trial % 3 else 0, len(damaged), size=int(rng.integers(1, 6))):
            damaged[i] = int(rng.integers(0, 256))
        if trial % 4 == 0:
            damaged = damaged[: int(rng.integers(1, len(damaged)))]
        if trial % 2 and len(damaged) >= F.HEADER.size:
            damaged = bytearray(reseal(damaged))
        want = _outcome(decode_record, bytes(damaged), LAYOUT, geometry)
        assert _outcome(c_decode, bytes(damaged), LAYOUT, geometry) == want, trial
        outcomes["refused" if want == "refused" else "decoded"] += 1
    assert outcomes["refused"] > 0 and outcomes["decoded"] > 0, outcomes


def _lut_offset(data: bytes, table: int = 0) -> int:
    return F.unpack_dir(data, 0).luts_offset + table * F.LUT_ENTRIES


def test_a_code_table_with_a_code_longer_than_8_bits_is_refused(record, decode):
    data = bytearray(record)
    data[_lut_offset(data) + 7] = (data[_lut_offset(data) + 7] & 0xF) | 9 << 4
    with pytest.raises(F.CodecError, match="longer than 8 bits"):
        decode(reseal(data), LAYOUT)


def test_a_table_that_is_no_prefix_code_decodes_as_the_reference_reads_it(record):
    """One entry of a table changed so that two peeks sharing a code's bits disagree: the pairs the C decoder looks
    up two codes at a time must give what the reference's single lookups give."""
    lut = _lut_offset(record)
    entries = np.frombuffer(record, np.uint8, F.LUT_ENTRIES, lut)
    short = int(np.argmin(entries >> 4))  # a peek of the shortest code: its neighbours share that code
    data = bytearray(record)
    data[lut + (short ^ 1)] = (entries[short] & 0xF0) | ((entries[short] + 1) & 0xF)
    data = reseal(data)
    assert _outcome(_c_decoder(LAYOUT, F.STANDARD), data) == _outcome(decode_record, data)
