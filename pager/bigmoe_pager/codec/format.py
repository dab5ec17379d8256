"""The byte layout of one compressed expert record (codec "fp8-exp-huff", version 1).

An FP8 E4M3 byte is sign(1) | exponent(4) | mantissa(3). The sign and mantissa
bits are stored raw as packed nibbles; the exponents are Huffman-coded (codes of
at most MAX_CODE_BITS bits) with tables chosen per chunk of `chunk_symbols`
bytes. A record's Geometry (named in its header; STANDARD unless the encoder was
told otherwise) splits a chunk among `lanes` independent lanes: at step k lane j
produces the STEP_SYMBOLS bytes at 4 * (k * lanes + j), so a group of lanes
writes one contiguous run per step. Each lane has its own bit stream; the
streams of a chunk lie end to end, and the chunk header gives every lane's
length, so lane start offsets are a prefix sum. Other components (block scales)
are stored raw.

All integers are little-endian. Offsets are bytes from the start of the record.

    header     HEADER (32 B)
    directory  DIR_ENTRY (24 B) per layout component, in layout order
    sections   per coded component: chunk headers, LUTs, nibbles, word stream;
               per raw component: its bytes. Every section starts on SECTION_ALIGN.
               An FP8 component that coding would not shrink is stored raw (KIND_RAW).

A chunk header is CHUNK_HEADER followed by `lanes` u8 length deltas: lane j holds
base_bits + delta[j] bits. The stream is a sequence of u32 words whose bits are
read most significant first; chunk c starts at word word_offset[c], and the
chunks partition the stream exactly. Each LUT has 256 one-byte entries indexed
by the next 8 stream bits: symbol | length << 4.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from bigmoe_pager.core.layout import Component, ExpertLayout

CODEC_NAME = "fp8-exp-huff"
CODEC_VERSION = 1
MAGIC = b"BXF8"

MAX_CODE_BITS = 8  # longest Huffman code: 4 codes fit the 32 bits a lane holds after a refill
LUT_ENTRIES = 1 << MAX_CODE_BITS  # one byte each
STEP_SYMBOLS = 4  # symbols a lane decodes per refill (4 x 8 bits <= 32)
MAX_TABLES = 16  # code tables per component, the verbatim (identity) table included
MAX_LANE_DELTA = 255  # lane lengths in a chunk may differ by at most this many bits (u8 deltas)
VERBATIM_BITS = 4  # a verbatim chunk stores each exponent as its own 4 bits
STREAM_PAD_WORDS = 2  # zero words after a stream: a lane may read up to two words past its end
SECTION_ALIGN = 8  # bytes
STAGING_ALIGN = 16  # records in a decode staging buffer start on multiples of this many bytes

KIND_RAW = 0
KIND_FP8 = 1
FLAG_VERBATIM = 1  # chunk flags: exponents stored as plain 4-bit fields (the chunk would not shrink)

HEADER = struct.Struct("<4sHHIIIIHBBI")
# magic, version, components, layout crc32, raw bytes, total bytes, payload crc32,
# chunk symbols, lanes, max code bits, reserved (0)
DIR_ENTRY = struct.Struct("<BBHIIIII")
# kind, tables, reserved, chunks (or raw data) offset, luts offset, nibbles offset, stream offset, stream words
CHUNK_HEADER = struct.Struct("<IBBH")  # word offset, table, flags, base bits; then one u8 delta per lane
GEOMETRY_LANES = (16, 32, 64, 128)  # lanes a chunk may have: powers of two (GPU tensor shapes), u8 in the header
MAX_CHUNK_SYMBOLS = 1 << 15  # the header's u16 field


class CodecError(ValueError):
    """A record is corrupt, malformed, or made for another layout or codec (never decode it into weights), or an
    encoder input does not fit its layout."""


@dataclass(frozen=True)
class Geometry:
    """How a chunk's exponents are cut into lanes (independent bit streams), as a record's header names it.

    Lanes decode in parallel and each lane's steps one after another, so on the GPU one record's expansion takes
    about lane_steps dependent steps; each lane costs one byte of chunk header.
    """

    lanes: int
    """Bit streams per chunk: one of GEOMETRY_LANES."""
    lane_steps: int
    """Steps per lane (STEP_SYMBOLS symbols each): a power of two >= 2."""

    def __post_init__(self) -> None:
        steps = self.lane_steps
        if self.lanes not in GEOMETRY_LANES:
            raise CodecError(f"codec geometry: {self.lanes} lanes per chunk; allowed: {GEOMETRY_LANES}")
        if steps < 2 or steps & (steps - 1) or self.chunk_symbols > MAX_CHUNK_SYMBOLS:
            raise CodecError(
                f"codec geometry: {steps} steps per lane; a power of two >= 2 with lanes x steps x {STEP_SYMBOLS}"
                f" <= {MAX_CHUNK_SYMBOLS} symbols a chunk"
            )

    @classmethod
    def parse(cls, text: str) -> "Geometry":
        """'LANESxSTEPS', e.g. '16x128' (STANDARD)."""
        lanes, sep, steps = text.partition("x")
        if not (sep and lanes.isdigit() and steps.isdigit()):
            raise CodecError(f"codec geometry {text!r}: write lanes x steps, e.g. 16x128")
        return cls(int(lanes), int(steps))

    def __str__(self) -> str:
        return f"{self.lanes}x{self.lane_steps}"

    @property
    def lane_symbols(self) -> int:
        """Symbols (bytes of the component) one lane decodes."""
        return STEP_SYMBOLS * self.lane_steps

    @property
    def chunk_symbols(self) -> int:
        """Bytes of a component one chunk covers (one code table each)."""
        return self.lanes * self.lane_symbols

    @property
    def chunk_header_bytes(self) -> int:
        return CHUNK_HEADER.size + self.lanes

    @property
    def chunk_dtype(self) -> np.dtype:
        """numpy dtype of one chunk header (chunk_header_bytes bytes)."""
        fields = [("word_offset", "<u4"), ("table", "u1"), ("flags", "u1"), ("base_bits", "<u2")]
        return np.dtype([*fields, ("delta", "u1", (self.lanes,))])

    @property
    def word(self) -> int:
        """The header's u32 at byte 24: chunk symbols | lanes << 16 | max code bits << 24."""
        return self.chunk_symbols | self.lanes << 16 | MAX_CODE_BITS << 24

    def chunks_of(self, nbytes: int) -> int:
        """Chunks of a component of nbytes."""
        return -(-nbytes // self.chunk_symbols)


STANDARD = Geometry(16, 128)
"""What prepare writes and the pager's decoders expect: 8192-byte chunks of 16 lanes x 128 steps."""


@dataclass(frozen=True)
class Header:
    """The fixed header of a record."""

    version: int
    """CODEC_VERSION of the writer."""
    components: int
    """Directory entries that follow."""
    layout_crc: int
    """crc32 of the layout signature the record was made for."""
    raw_bytes: int
    """layout.record_bytes: size of the decoded record."""
    total_bytes: int
    """Size of the whole record, header included."""
    payload_crc: int
    """crc32 of bytes [HEADER.size, total_bytes)."""
    geometry: Geometry = STANDARD
    """How its coded components' chunks are cut into lanes."""


@dataclass(frozen=True)
class DirEntry:
    """Where one component's sections lie in the record."""

    kind: int
    """KIND_FP8 (coded) or KIND_RAW."""
    tables: int
    """Code tables (LUTs) of a coded component."""
    chunks_offset: int
    """Chunk headers of a coded component; the bytes of a raw one."""
    luts_offset: int
    """LUTs: tables x LUT_ENTRIES bytes."""
    nibbles_offset: int
    """Sign and mantissa nibbles, two per byte, the even symbol in the low nibble."""
    stream_offset: int
    """First u32 word of the exponent stream."""
    stream_words: int
    """Words in the stream (STREAM_PAD_WORDS zero words follow them)."""


def is_coded(comp: Component) -> bool:
    """Whether a component's bytes are FP8 E4M3 and get their exponents coded."""
    return comp.dtype == torch.float8_e4m3fn


def nibble_bytes(nbytes: int) -> int:
    """Size of a component's nibble section (two nibbles per byte, padded to SECTION_ALIGN)."""
    return align((nbytes + 1) // 2)


def align(n: int, to: int = SECTION_ALIGN) -> int:
    return (n + to - 1) // to * to


@lru_cache(maxsize=None)
def layout_crc(layout: ExpertLayout) -> int:
    """crc32 of the layout's signature: binds a record to the layout it was made for."""
    return zlib.crc32(layout.signature().encode())


def directory_offset(index: int) -> int:
    """Byte offset of component `index`'s directory entry in every record."""
    return HEADER.size + index * DIR_ENTRY.size


def max_record_bytes(layout: ExpertLayout) -> int:
    """The largest record any input can encode to: every component raw (a coded one is stored raw when
    coding would not make it smaller)."""
    total = directory_offset(len(layout.components))
    for comp in layout.components:
        total = align(total) + align(comp.nbytes)
    return align(total)


def record_pitch(sizes, to: int = STAGING_ALIGN) -> int:
    """Slot pitch for records of these sizes (e.g. one layer's): the largest, rounded up to `to` bytes."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("record_pitch needs at least one record size")
    return align(max(sizes), to)


def pack_header(h: Header) -> bytes:
    return HEADER.pack(
        MAGIC,
        h.version,
        h.components,
        h.layout_crc,
        h.raw_bytes,
        h.total_bytes,
        h.payload_crc,
        h.geometry.chunk_symbols,
        h.geometry.lanes,
        MAX_CODE_BITS,
        0,
    )


def unpack_header(data: memoryview | bytes) -> Header:
    """The header, checked for magic and a geometry this build reads (not the checksum: see
    reference.verify_record)."""
    if len(data) < HEADER.size:
        raise CodecError(f"record is {len(data)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, comps, lcrc, raw, total, pcrc, chunk, lanes, bits, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CodecError(f"not a {CODEC_NAME} record (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != CODEC_VERSION:
        raise CodecError(
            f"record is {CODEC_NAME} version {version}; this build reads version {CODEC_VERSION}: "
            "re-prepare the paging file"
        )
    if bits != MAX_CODE_BITS or lanes not in GEOMETRY_LANES or chunk % (lanes * STEP_SYMBOLS):
        raise CodecError(f"record geometry chunk={chunk} lanes={lanes} bits={bits} is not one this build reads")
    return Header(version, comps, lcrc, raw, total, pcrc, Geometry(lanes, chunk // (lanes * STEP_SYMBOLS)))


def unpack_dir(data: memoryview | bytes, index: int) -> DirEntry:
    return DirEntry(*(v for i, v in enumerate(DIR_ENTRY.unpack_from(data, directory_offset(index))) if i != 2))


def pack_dir(e: DirEntry) -> bytes:
    return DIR_ENTRY.pack(
        e.kind, e.tables, 0, e.chunks_offset, e.luts_offset, e.nibbles_offset, e.stream_offset, e.stream_words
    )
