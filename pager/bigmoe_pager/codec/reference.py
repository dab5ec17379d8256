"""The reference decoder: compressed record -> layout bytes, every structure checked.

Written independently of the GPU kernel's bit buffer: each lane reads its code
at an absolute bit position of the byte stream, all lanes of a component at once
(numpy), one symbol per step. Anything inconsistent raises CodecError.
"""

from __future__ import annotations

import zlib

import numpy as np
from bigmoe_pager.core.layout import ExpertLayout

from . import format as F
from .huffman import verbatim_table

_VERBATIM_LUT = verbatim_table().lut


def verify_record(
    data: bytes | memoryview | np.ndarray, layout: ExpertLayout, geometry: F.Geometry = F.STANDARD
) -> F.Header:
    """The header of a record that belongs to `layout`, is cut by `geometry` and whose payload matches its crc32;
    else CodecError. (The crc32 does not cover the header: a geometry other than the expected one is refused.)"""
    buf = _bytes(data)
    h = F.unpack_header(buf)
    if h.geometry != geometry:
        raise F.CodecError(f"record geometry {h.geometry} differs from the expected {geometry} (lanes x steps)")
    if (
        h.layout_crc != F.layout_crc(layout)
        or h.components != len(layout.components)
        or h.raw_bytes != layout.record_bytes
    ):
        raise _layout_mismatch(h, layout)
    if h.total_bytes != len(buf):
        raise F.CodecError(f"record says it is {h.total_bytes} bytes but {len(buf)} were given (cut short or padded)")
    crc = zlib.crc32(buf[F.HEADER.size :])
    if crc != h.payload_crc:
        raise F.CodecError(
            f"record checksum mismatch (crc32 {crc:08x}, header says {h.payload_crc:08x}): corrupt bytes"
        )
    return h


def decode_record(
    data: bytes | memoryview | np.ndarray, layout: ExpertLayout, geometry: F.Geometry = F.STANDARD
) -> np.ndarray:
    """The expert record (uint8 [layout.record_bytes], padding zero) a compressed record of `geometry` holds."""
    buf = _bytes(data)
    verify_record(buf, layout, geometry)
    out = np.zeros(layout.record_bytes, np.uint8)
    for i, comp in enumerate(layout.components):
        entry = F.unpack_dir(buf, i)
        allowed = (F.KIND_FP8, F.KIND_RAW) if F.is_coded(comp) else (F.KIND_RAW,)
        if entry.kind not in allowed:
            raise F.CodecError(f"component {comp.name}: directory kind {entry.kind}, layout allows {allowed}")
        if entry.kind == F.KIND_RAW:
            out[comp.offset : comp.offset + comp.nbytes] = _section(buf, entry.chunks_offset, comp.nbytes, comp.name)
        else:
            coded = decode_component(buf, entry, comp.nbytes, comp.name, geometry)
            out[comp.offset : comp.offset + comp.nbytes] = coded
    return out


def decode_component(
    buf: np.ndarray, entry: F.DirEntry, nbytes: int, name: str = "component", geometry: F.Geometry = F.STANDARD
) -> np.ndarray:
    """The bytes of one coded component (uint8 [nbytes]) whose chunks are cut by `geometry` (the record header's)."""
    g = geometry
    chunks = g.chunks_of(nbytes)
    headers = np.frombuffer(_section(buf, entry.chunks_offset, chunks * g.chunk_header_bytes, name), g.chunk_dtype)
    if not 1 <= entry.tables <= F.MAX_TABLES:
        raise F.CodecError(f"{name}: {entry.tables} code tables (1..{F.MAX_TABLES} allowed)")
    luts = _section(buf, entry.luts_offset, entry.tables * F.LUT_ENTRIES, name).reshape(entry.tables, F.LUT_ENTRIES)
    if ((luts >> 4) > F.MAX_CODE_BITS).any():
        raise F.CodecError(f"{name}: a code table has a code longer than {F.MAX_CODE_BITS} bits")
    nibbles = _section(buf, entry.nibbles_offset, F.nibble_bytes(nbytes), name)
    stream_bytes = 4 * (entry.stream_words + F.STREAM_PAD_WORDS)
    words = _section(buf, entry.stream_offset, stream_bytes, name).view("<u4")
    lane_bits, lane_start = _check_chunks(headers, luts, entry, name, g)
    exps = _decode_lanes(words.byteswap().view(np.uint8), luts, headers, lane_start, lane_bits, name, g)
    nib = np.empty(2 * nibbles.size, np.uint8)
    nib[0::2], nib[1::2] = nibbles & 0xF, nibbles >> 4
    nib = nib[:nbytes]
    return ((nib & 0x8) << 4) | (exps[:nbytes] << 3) | (nib & 0x7)


def _check_chunks(
    headers: np.ndarray, luts: np.ndarray, entry: F.DirEntry, name: str, g: F.Geometry
) -> tuple[np.ndarray, np.ndarray]:
    """(bits per lane, first bit of each lane) after checking tables, verbatim flags and the stream partition."""
    table = headers["table"].astype(np.int64)
    if (table >= entry.tables).any():
        raise F.CodecError(f"{name}: chunk refers to table {int(table.max())} of {entry.tables}")
    verbatim = (headers["flags"] & F.FLAG_VERBATIM) != 0
    if (headers["flags"] & ~np.uint8(F.FLAG_VERBATIM)).any():
        raise F.CodecError(f"{name}: unknown chunk flags")
    if verbatim.any() and not (luts[table[verbatim]] == _VERBATIM_LUT).all():
        raise F.CodecError(f"{name}: a verbatim chunk's table is not the 4-bit identity code")
    lane_bits = headers["base_bits"].astype(np.int64)[:, None] + headers["delta"]
    if verbatim.any() and not (lane_bits[verbatim] == g.lane_symbols * F.VERBATIM_BITS).all():
        raise F.CodecError(f"{name}: a verbatim chunk's lanes are not {g.lane_symbols * F.VERBATIM_BITS} bits each")
    words = (lane_bits.sum(axis=1) + 31) // 32
    offsets = headers["word_offset"].astype(np.int64)
    expected = np.concatenate([[0], np.cumsum(words)[:-1]])
    if not (offsets == expected).all() or int(words.sum()) != entry.stream_words:
        raise F.CodecError(f"{name}: chunk word offsets do not partition the {entry.stream_words}-word stream")
    lane_start = offsets[:, None] * 32 + np.cumsum(lane_bits, axis=1) - lane_bits
    return lane_bits, lane_start


def _decode_lanes(
    stream: np.ndarray,
    luts: np.ndarray,
    headers: np.ndarray,
    lane_start: np.ndarray,
    lane_bits: np.ndarray,
    name: str,
    g: F.Geometry,
) -> np.ndarray:
    """Exponents of every chunk in component order, from the stream bytes (most significant bit first)."""
    chunks = headers.size
    lut = luts[headers["table"].astype(np.int64)][:, None, :]  # [chunks, 1, 256]
    lut = np.broadcast_to(lut, (chunks, g.lanes, F.LUT_ENTRIES)).reshape(-1, F.LUT_ENTRIES)
    rows = np.arange(lut.shape[0])
    pos = lane_start.reshape(-1).copy()
    wide = np.concatenate([stream, np.zeros(2, np.uint8)]).astype(np.uint32)
    out = np.empty((chunks * g.lanes, g.lane_symbols), np.uint8)
    last = wide.size - 3  # a malformed lane may run off the stream: clamp, then fail the length check below
    for i in range(g.lane_symbols):
        byte = np.minimum(pos >> 3, last)
        window = (wide[byte] << 16) | (wide[byte + 1] << 8) | wide[byte + 2]  # 24 bits from `byte`
        peek = (window >> (16 - (pos & 7))) & 0xFF
        entry = lut[rows, peek]
        out[:, i] = entry & 0xF
        pos += entry >> 4
    if not (pos == lane_start.reshape(-1) + lane_bits.reshape(-1)).all():
        raise F.CodecError(f"{name}: a lane's codes do not end where its length says: malformed stream")
    # out[chunk*lanes + lane, step*4 + t] holds symbol (step*lanes + lane)*4 + t of the chunk.
    lanes = out.reshape(chunks, g.lanes, g.lane_steps, F.STEP_SYMBOLS)
    return lanes.transpose(0, 2, 1, 3).reshape(-1)


def _section(buf: np.ndarray, offset: int, size: int, name: str) -> np.ndarray:
    if offset % 4 or offset < F.HEADER.size or offset + size > buf.size:
        raise F.CodecError(
            f"{name}: section [{offset}, {offset + size}) lies outside the {buf.size}-byte record or is misaligned"
        )
    return buf[offset : offset + size]


def _bytes(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise F.CodecError(f"a record is 1-D uint8 bytes, got {data.dtype} with shape {data.shape}")
        return data
    return np.frombuffer(data, np.uint8)


def _layout_mismatch(h: F.Header, layout: ExpertLayout) -> F.CodecError:
    return F.CodecError(
        f"record was made for another expert layout (layout crc {h.layout_crc:08x}, {h.components} components, "
        f"{h.raw_bytes} bytes; this one is {F.layout_crc(layout):08x}, {len(layout.components)}, "
        f"{layout.record_bytes}): "
        "re-prepare the paging file"
    )
