"""The codec's C decoder (host_decode.c) for one expert layout: compressed record -> raw record in host memory.

Same bytes and the same structural checks as the numpy reference, about 40 times faster, and it runs without
the GIL (ctypes lets go of it for the call), so SSD reader threads expand their records side by side. Built with the
pager's other C files at first use (core/native_build.py); NativeBuildError where no C compiler is found.

    HostDecoder(layout).decode_into(data, layout, dst)          checks the header's crc32 too
    HostDecoder(layout, check_crc=False)                        for bytes the caller has just checked (a paging
                                                                file's own per-record crc32)
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.native_build import library

from . import format as F
from .huffman import verbatim_table
from .reference import verify_record

_SOURCE = Path(__file__).with_name("host_decode.c")
_ERROR_BYTES = 240
_i64p, _u8p = ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p


def _bind() -> ctypes.CDLL:
    lib = library(_SOURCE)
    fn = lib.bxf8_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [
        _u8p, ctypes.c_int64, _u8p, ctypes.c_int64,  # record, its bytes, out, its bytes
        _i64p, ctypes.c_int32, _i64p, ctypes.c_int32, ctypes.c_char_p,  # components, gaps, names
        ctypes.c_uint32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,  # layout crc, raw bytes, geometry
        _u8p, ctypes.c_char_p, ctypes.c_int32,  # verbatim LUT, error line
    ]  # fmt: skip
    return lib


class HostDecoder:
    """Expands records of one layout and geometry on the CPU; CodecError (one line) on any record that fails a
    check, and then dst holds garbage that must not be used."""

    parallel = True  # read-only state: threads decode at once

    def __init__(self, layout: ExpertLayout, geometry: F.Geometry = F.STANDARD, check_crc: bool = True):
        self._fn = _bind().bxf8_decode
        self.layout, self.geometry, self.check_crc = layout, geometry, check_crc
        comps = [(c.offset, c.nbytes, int(F.is_coded(c))) for c in layout.components]
        self._comps = np.ascontiguousarray(comps, dtype=np.int64)
        self._gaps = np.ascontiguousarray(layout.gaps or [(0, 0)], dtype=np.int64)  # zeroed in the record
        self._names = b"".join(c.name.encode() + b"\0" for c in layout.components)
        self._verbatim = np.ascontiguousarray(verbatim_table().lut, dtype=np.uint8)
        self._crc = F.layout_crc(layout)

    def decode_into(
        self, data: torch.Tensor | np.ndarray, layout: ExpertLayout, dst: torch.Tensor | np.ndarray
    ) -> None:
        """data: the compressed record (uint8, exactly its length); dst: uint8 >= layout.record_bytes (CPU)."""
        if layout is not self.layout and layout.signature() != self.layout.signature():
            raise F.CodecError("HostDecoder was built for another layout")
        src, out = _bytes(data, "record"), _bytes(dst, "destination")
        if self.check_crc:
            verify_record(src, layout, self.geometry)
        err = ctypes.create_string_buffer(_ERROR_BYTES)
        g = self.geometry
        rc = self._fn(
            src.ctypes.data, src.nbytes, out.ctypes.data, out.nbytes,
            self._comps.ctypes.data_as(_i64p), len(self._comps), self._gaps.ctypes.data_as(_i64p), len(self._gaps),
            self._names, self._crc, layout.record_bytes, g.lanes, g.lane_steps,
            self._verbatim.ctypes.data, err, _ERROR_BYTES,
        )  # fmt: skip
        if rc != 0:
            raise F.CodecError(err.value.decode(errors="replace"))


def _bytes(x: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    """A 1-D uint8 numpy view of host memory (no copy)."""
    arr = x.numpy() if isinstance(x, torch.Tensor) else x
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise F.CodecError(f"{what}: 1-D contiguous uint8 host bytes expected, got {arr.dtype} {arr.shape}")
    return arr
