"""The CPU encoder: one expert record (layout bytes) -> one compressed record.

Vectorized numpy throughout; the only Python loops run over tables and
components. `encode_many` spreads records over worker processes for a whole
model's paging file.
"""

from __future__ import annotations

import multiprocessing
import os
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
from bigmoe_pager.core.layout import ExpertLayout

from . import format as F
from .huffman import SYMBOLS, CodeTable, verbatim_table
from .tables import choose_tables


@dataclass(frozen=True)
class CodedComponent:
    """The sections of one coded component, ready to be placed in a record."""

    chunks: bytes
    """Chunk headers, geometry.chunk_header_bytes each."""
    luts: bytes
    """LUT_ENTRIES bytes per table."""
    nibbles: bytes
    """Packed sign/mantissa nibbles."""
    stream: np.ndarray
    """uint32 words of the exponent stream (padding words not included)."""
    verbatim_chunks: int
    """Chunks stored with the 4-bit identity code because coding would not shrink them."""

    @property
    def nbytes(self) -> int:
        """Bytes the sections take in a record, alignment and stream padding included."""
        stream = 4 * (self.stream.size + F.STREAM_PAD_WORDS)
        return F.align(len(self.chunks)) + len(self.luts) + F.align(len(self.nibbles)) + F.align(stream)


def encode_record(raw: np.ndarray, layout: ExpertLayout, geometry: F.Geometry = F.STANDARD) -> bytes:
    """Compress one expert record (uint8, layout.record_bytes long, or a whole pitch with zero padding); its
    chunks cut into lanes by `geometry` (what the pager writes and reads: STANDARD)."""
    raw = _check_raw(raw, layout)
    sections: list[tuple[F.DirEntry, list[bytes]]] = []
    offset = F.directory_offset(len(layout.components))
    for comp in layout.components:
        data = raw[comp.offset : comp.offset + comp.nbytes]
        offset = F.align(offset)
        coded = encode_component(data, geometry) if F.is_coded(comp) else None
        if coded is None or coded.nbytes >= F.align(comp.nbytes):  # not FP8, or coding would not shrink it
            sections.append((F.DirEntry(F.KIND_RAW, 0, offset, 0, 0, 0, 0), [data.tobytes()]))
            offset += F.align(comp.nbytes)
            continue
        chunks_off = offset
        luts_off = chunks_off + F.align(len(coded.chunks))
        nib_off = luts_off + len(coded.luts)
        stream_off = nib_off + F.nibble_bytes(comp.nbytes)
        padded = np.concatenate([coded.stream, np.zeros(F.STREAM_PAD_WORDS, np.uint32)]).astype("<u4").tobytes()
        entry = F.DirEntry(
            F.KIND_FP8, len(coded.luts) // F.LUT_ENTRIES, chunks_off, luts_off, nib_off, stream_off, len(coded.stream)
        )
        sections.append((entry, [coded.chunks, coded.luts, coded.nibbles, padded]))
        offset = stream_off + F.align(len(padded))
    total = F.align(offset)
    out = bytearray(total)
    for i, (entry, parts) in enumerate(sections):
        out[F.directory_offset(i) : F.directory_offset(i + 1)] = F.pack_dir(entry)
        starts = (
            [entry.chunks_offset]
            if entry.kind == F.KIND_RAW
            else [entry.chunks_offset, entry.luts_offset, entry.nibbles_offset, entry.stream_offset]
        )
        for start, part in zip(starts, parts):
            out[start : start + len(part)] = part
    header = F.Header(
        F.CODEC_VERSION,
        len(layout.components),
        F.layout_crc(layout),
        layout.record_bytes,
        total,
        zlib.crc32(memoryview(out)[F.HEADER.size :]),
        geometry,
    )
    out[: F.HEADER.size] = F.pack_header(header)
    return bytes(out)


def encode_component(data: np.ndarray, geometry: F.Geometry = F.STANDARD) -> CodedComponent:
    """Code the exponents of one FP8 component's bytes (uint8 [n]), chunk by chunk."""
    n, g = data.size, geometry
    chunks = g.chunks_of(n)
    identity_words = g.chunk_symbols * F.VERBATIM_BITS // 32  # stream words of a verbatim chunk
    exps = np.empty(chunks * g.chunk_symbols, np.uint8)
    np.right_shift(data, 3, out=exps[:n])
    exps[:n] &= 0xF
    if n < exps.size:  # the last chunk's tail repeats its commonest exponent: cheapest to code, never stored
        exps[n:] = np.argmax(np.bincount(exps[(chunks - 1) * g.chunk_symbols : n], minlength=SYMBOLS))
    pairs = _pairs(exps)
    hist = _histograms(pairs, chunks)
    tables, assign, _ = choose_tables(hist)
    # The 4 symbols of a lane step are adjacent: one big-endian u16 of two pairs, a "quad".
    quads = np.ascontiguousarray(pairs.view(">u2").reshape(chunks, g.lane_steps, g.lanes).transpose(0, 2, 1))
    code, length = _quad_codes(quads, tables, assign)
    lane_bits = length.sum(axis=2, dtype=np.int32)
    words = (lane_bits.sum(axis=1) + 31) // 32
    spread = lane_bits.max(axis=1) - lane_bits.min(axis=1)
    verbatim = (words >= identity_words) | (spread > F.MAX_LANE_DELTA)
    if verbatim.any():
        tables = tables + [verbatim_table()]
        assign = np.where(verbatim, len(tables) - 1, assign)
        code[verbatim] = quads[verbatim]  # the identity code of a quad is the quad
        length[verbatim] = F.STEP_SYMBOLS * F.VERBATIM_BITS
        lane_bits[verbatim] = g.lane_symbols * F.VERBATIM_BITS
        words[verbatim] = identity_words
    tables, assign = _drop_unused(tables, assign)
    word_offset = np.concatenate([[0], np.cumsum(words)[:-1]])
    stream = _pack_bits(code, length, lane_bits, word_offset, int(words.sum()))
    headers = np.zeros(chunks, g.chunk_dtype)
    headers["word_offset"] = word_offset
    headers["table"] = assign
    headers["flags"] = np.where(verbatim, F.FLAG_VERBATIM, 0)
    base = lane_bits.min(axis=1)
    headers["base_bits"] = base
    headers["delta"] = lane_bits - base[:, None]
    return CodedComponent(
        chunks=headers.tobytes(),
        luts=b"".join(t.lut.tobytes() for t in tables),
        nibbles=_pack_nibbles(data),
        stream=stream,
        verbatim_chunks=int(verbatim.sum()),
    )


def encode_many(
    raws: Iterable[np.ndarray], layout: ExpertLayout, workers: int | None = None, geometry: F.Geometry = F.STANDARD
) -> Iterator[bytes]:
    """encode_record over many records, in order, on `workers` processes (default: every CPU).

    At most AHEAD_PER_WORKER records a worker are taken from `raws` beyond the one yielded, so a whole model's
    records stream through in bounded memory. Workers are spawned, not forked: the caller may hold threads or a
    CUDA context.
    """
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        for raw in raws:
            yield encode_record(raw, layout, geometry)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending: deque = deque()
        for raw in raws:
            pending.append(pool.submit(encode_record, raw, layout, geometry))
            if len(pending) >= AHEAD_PER_WORKER * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


AHEAD_PER_WORKER = 2
"""Records a worker process holds or has queued, at most, in encode_many (one encoding, one waiting)."""


def _check_raw(raw: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise F.CodecError(f"encode_record wants a 1-D uint8 record, got {raw.dtype} with shape {raw.shape}")
    if raw.size not in (layout.record_bytes, layout.pitch):
        raise F.CodecError(
            f"record is {raw.size} bytes; layout wants {layout.record_bytes} (or its pitch {layout.pitch})"
        )
    if any(raw[start:end].any() for start, end in _gaps(layout, raw.size)):
        raise F.CodecError("record has non-zero bytes in the padding between components; only component bytes are kept")
    return raw


def _gaps(layout: ExpertLayout, size: int) -> list[tuple[int, int]]:
    """Byte ranges of a record of `size` bytes that no component covers."""
    spans, end = [], 0
    for c in sorted(layout.components, key=lambda c: c.offset):
        spans.append((end, c.offset))
        end = c.offset + c.nbytes
    return spans + [(end, size)]


def _pairs(exps: np.ndarray) -> np.ndarray:
    """uint8 [n/2]: exponents 2i and 2i+1 as one byte (2i in the high nibble)."""
    both = exps.view("<u2")
    return (((both & 0xF) << 4) | (both >> 8)).astype(np.uint8)


def _histograms(pairs: np.ndarray, chunks: int) -> np.ndarray:
    """Exponent counts per chunk, int64 [chunks, 16], from the exponent pairs."""
    keys = pairs.reshape(chunks, -1).astype(np.int32)
    keys += (np.arange(chunks, dtype=np.int32) * 256)[:, None]
    pair_counts = np.bincount(keys.reshape(-1), minlength=chunks * 256).reshape(chunks, SYMBOLS, SYMBOLS)
    return pair_counts.sum(axis=2) + pair_counts.sum(axis=1)


def _quad_codes(quads: np.ndarray, tables: list[CodeTable], assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(code, bits) of each lane step's quad under its chunk's table: uint32 / uint8 [chunks, lanes, lane_steps]."""
    codes, lengths = zip(*(_quad_table(t) for t in tables))
    idx = assign.astype(np.int64)[:, None, None] * 65536 + quads
    return np.concatenate(codes)[idx], np.concatenate(lengths)[idx]


def _quad_table(table: CodeTable) -> tuple[np.ndarray, np.ndarray]:
    """Joined code (uint32) and length (uint8) of all 65536 quads under one table (absent symbols: 0 bits)."""
    ln = np.maximum(table.lengths, 0).astype(np.uint64)
    cd = table.codes.astype(np.uint64)
    pair_len = (ln[:, None] + ln[None, :]).reshape(-1)
    pair_code = ((cd[:, None] << ln[None, :]) | cd[None, :]).reshape(-1)
    quad_len = (pair_len[:, None] + pair_len[None, :]).reshape(-1)
    quad_code = ((pair_code[:, None] << pair_len[None, :]) | pair_code[None, :]).reshape(-1)
    return quad_code.astype(np.uint32), quad_len.astype(np.uint8)


def _pack_bits(
    code: np.ndarray, length: np.ndarray, lane_bits: np.ndarray, word_offset: np.ndarray, words: int
) -> np.ndarray:
    """The stream: each lane's steps end to end, lanes end to end, chunk c from word word_offset[c]."""
    if words >= 1 << 26:
        raise F.CodecError(f"a component of {words} stream words is too large for 32-bit bit positions")
    lane_start = np.cumsum(lane_bits, axis=1, dtype=np.int32) - lane_bits
    pos = np.cumsum(length, axis=2, dtype=np.int32)
    pos -= length
    pos += (word_offset.astype(np.int32) * 32)[:, None, None] + lane_start[:, :, None]
    pos = pos.reshape(-1)
    # A step (<= 32 bits) at bit `pos` lies in the 64-bit window of words pos//32 and pos//32 + 1.
    shift = 64 - (pos & 31)
    shift -= length.reshape(-1)
    window = np.left_shift(code.reshape(-1).astype(np.uint64), shift.astype(np.uint64))
    word = pos >> 5
    # Steps never share bits, so summing their parts of a word is OR-ing them (exact in float64).
    acc = np.bincount(word, weights=window >> np.uint64(32), minlength=words + 2)
    window &= np.uint64(0xFFFFFFFF)
    word += 1
    acc += np.bincount(word, weights=window, minlength=words + 2)
    return acc[:words].astype(np.uint32)


def _pack_nibbles(data: np.ndarray) -> bytes:
    """Sign and mantissa of bytes 2i (low nibble) and 2i+1 (high nibble) in byte i."""
    if data.size % 2:
        data = np.concatenate([data, np.zeros(1, np.uint8)])
    both = data.view("<u2")  # byte 2i in the low half
    packed = ((both >> 8) & 0x80) | ((both >> 4) & 0x78) | (both & 0x7)
    return packed.astype(np.uint8).tobytes()


def _drop_unused(tables: list[CodeTable], assign: np.ndarray) -> tuple[list[CodeTable], np.ndarray]:
    used = np.unique(assign)
    remap = np.full(len(tables), -1, np.int64)
    remap[used] = np.arange(used.size)
    return [tables[i] for i in used], remap[assign]
