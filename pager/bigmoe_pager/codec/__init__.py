"""Lossless FP8 expert codec: exponent Huffman coding on the CPU, expansion on the GPU (docs/codec.md).

    encode_record(raw, layout) -> bytes            one expert record -> one compressed record
                                                   (chunk Geometry STANDARD unless given another)
    decode_record(data, layout) -> np.ndarray      the reference (CPU) decoder, every check included
    verify_record(data, layout) -> Header          header + crc32 only: is this record whole and ours?
    decode_into_slots(staging, work, slots, layout, errors)   the GPU path (triton_decode)
    max_record_bytes(layout), record_pitch(sizes)  sizes for RAM slots and staging buffers

triton_decode is imported on use (it needs Triton); the rest needs numpy and torch only.
"""

from .encode import encode_many, encode_record
from .format import (
    CODEC_NAME,
    CODEC_VERSION,
    STAGING_ALIGN,
    STANDARD,
    CodecError,
    Geometry,
    Header,
    max_record_bytes,
    record_pitch,
)
from .reference import decode_record, verify_record

__all__ = [
    "CODEC_NAME",
    "CODEC_VERSION",
    "STAGING_ALIGN",
    "STANDARD",
    "CodecError",
    "Geometry",
    "Header",
    "encode_record",
    "encode_many",
    "decode_record",
    "verify_record",
    "max_record_bytes",
    "record_pitch",
]
