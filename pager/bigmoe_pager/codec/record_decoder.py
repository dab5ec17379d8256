"""Expand compressed records read from SSD into raw records in host RAM.

Both pagers keep raw records in their RAM tier, so a compressed record read from the paging file is expanded
before it enters RAM: `DecodedStore` is an ExpertStore of raw records over the paging file's store, and the SSD
tier reads it like any other. Two decoders, same bytes:

    HostDecoder(layout)         C on the CPU (host_decoder.py): about 1.4 GB/s a core on the dev VM, 0.8 on the
                                H200 machine's, no GIL held, one record per SSD reader thread at once
    ReferenceDecoder()          numpy, on the CPU (about 85 ms per 3 MB expert on the dev VM, with the GIL)

`record_decoder(layout)` picks the C one, else (no C compiler) numpy. Not the GPU's: the SSD tier's threads would
then issue CUDA work and syncs beside vLLM's graphs (and a capture), and wherever CUDA runs the pager's Triton
kernels a C compiler is there anyway (Triton builds its launchers with one). Both raise CodecError on a record that
fails a check; dst then holds garbage and must not be used (a read that raised never fills a slot).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.native_build import NativeBuildError
from bigmoe_pager.core.odirect import aligned_empty

from .reference import decode_record


class ReferenceDecoder:
    """The numpy reference decoder (every structure and the crc32 checked on the host)."""

    parallel = True  # no state: threads may decode at once

    def decode_into(self, data: torch.Tensor, layout: ExpertLayout, dst: torch.Tensor) -> None:
        """data: the compressed record (uint8 CPU tensor, exactly its length); dst: uint8 >= layout.record_bytes."""
        raw = decode_record(data.numpy(), layout)
        dst[: layout.record_bytes].copy_(torch.from_numpy(np.asarray(raw, dtype=np.uint8)))


def record_decoder(layout: ExpertLayout):
    """The C decoder; where it cannot be built (no C compiler), numpy's."""
    from .host_decoder import HostDecoder

    try:
        return HostDecoder(layout, check_crc=False)  # its callers' stores check their own crc32 per record
    except NativeBuildError:
        return ReferenceDecoder()


class DecodedStore:
    """An ExpertStore of raw records over a store of compressed ones (a compressed paging file).

    Each read lands in a scratch buffer of the calling thread, is checked by the inner store (its crc32: a
    ChecksumError passes through, so the SSD tier retries it), and is expanded into dst; read returns
    layout.record_bytes. The inner store's file counters count the bytes read from disk.
    """

    codec = "raw"

    def __init__(self, inner, decoder):
        self.inner, self.decoder = inner, decoder
        self.layout, self.num_layers, self.num_experts = inner.layout, inner.num_layers, inner.num_experts
        self.counters = inner.counters
        self._local = threading.local()
        self._lock = contextlib.nullcontext() if getattr(decoder, "parallel", False) else threading.Lock()

    def read(self, layer: int, expert: int, dst: object) -> int:
        out = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
        scratch = self._scratch()
        n = self.inner.read(layer, expert, scratch)
        with self._lock:  # a decoder with one set of buffers expands one record at a time; reads go on meanwhile
            self.decoder.decode_into(scratch[:n], self.layout, out)
        return self.layout.record_bytes

    def describe(self, layer: int, expert: int) -> str:
        return self.inner.describe(layer, expert) + f", {self.inner.codec} record"

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "DecodedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scratch(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_empty(self.inner.pitch)  # O_DIRECT reads land in it
        return buf
