"""Expand compressed records read from SSD into raw records in host RAM.

Both pagers keep raw records in their RAM tier, so a compressed record read from the paging file is expanded
before it enters RAM: `DecodedStore` is an ExpertStore of raw records over the paging file's store, and the SSD
tier reads it like any other. Three decoders, same bytes:

    HostDecoder(layout)         C on the CPU (host_decoder.py): about 1.4 GB/s a core on the dev VM, no GIL held,
                                one record per SSD reader thread at once
    DeviceDecoder(layout, dev)  the Triton kernel on the GPU, then one copy back (one record at a time)
    ReferenceDecoder()          numpy, on the CPU (about 85 ms per 3 MB expert on the dev VM, with the GIL)

`record_decoder(layout)` picks the C one, where no C compiler is found the GPU's, else numpy. All raise
CodecError on a record that fails a check; dst then holds garbage and must not be used (a read that raised
never fills a slot).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.native_build import NativeBuildError
from bigmoe_pager.core.odirect import aligned_empty

from .format import STAGING_ALIGN, CodecError, max_record_bytes
from .reference import decode_record


class ReferenceDecoder:
    """The numpy reference decoder (every structure and the crc32 checked on the host)."""

    parallel = True  # no state: threads may decode at once

    def decode_into(self, data: torch.Tensor, layout: ExpertLayout, dst: torch.Tensor) -> None:
        """data: the compressed record (uint8 CPU tensor, exactly its length); dst: uint8 >= layout.record_bytes."""
        raw = decode_record(data.numpy(), layout)
        dst[: layout.record_bytes].copy_(torch.from_numpy(np.asarray(raw, dtype=np.uint8)))


class DeviceDecoder:
    """The GPU decoder for one layout: host bytes -> device staging -> kernel -> device record -> host.

    Checks on the device cover the header and every section bound; the crc32 of
    the record is the caller's (the paging file checks each read against its index).
    Synchronous: dst holds the record (and data is free again) when decode_into returns.
    """

    parallel = False  # one staging buffer: one record at a time

    def __init__(self, layout: ExpertLayout, device: torch.device | str):
        from .triton_decode import new_errors

        self.layout = layout
        self.device = torch.device(device)
        capacity = -(-max_record_bytes(layout) // STAGING_ALIGN) * STAGING_ALIGN
        self._staging = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
        # One record on the device; the kernel writes its components through [1, *shape] views of it.
        self._record = torch.zeros(layout.pitch, dtype=torch.uint8, device=self.device)
        self._slots = {name: view.unsqueeze(0) for name, view in layout.views(self._record).items()}
        self._work = torch.zeros((1, 2), dtype=torch.int64, device=self.device)  # record at offset 0 -> slot 0
        self._errors = new_errors(self._work)

    def decode_into(self, data: torch.Tensor, layout: ExpertLayout, dst: torch.Tensor) -> None:
        from .triton_decode import decode_into_slots

        if layout is not self.layout and layout.signature() != self.layout.signature():
            raise CodecError("DeviceDecoder was built for another layout")
        n = data.numel()
        if n > self._staging.numel():
            raise CodecError(f"record of {n} bytes exceeds the codec's largest record ({self._staging.numel()} bytes)")
        # Asynchronous from pinned memory; data may be reused once this returns, and it returns after a sync.
        self._staging[:n].copy_(data, non_blocking=True)
        self._staging[n:].zero_()  # bytes past the record read as zero, never as the last record's tail
        self._errors.zero_()
        decode_into_slots(self._staging, self._work, self._slots, layout, self._errors)
        dst[: layout.record_bytes].copy_(self._record[: layout.record_bytes])
        failed = int(self._errors.item())
        if failed:
            raise CodecError(f"the GPU decoder rejected a record ({failed} failed check(s)): corrupt or foreign bytes")


def record_decoder(layout: ExpertLayout):
    """The C decoder; where it cannot be built (no C compiler), the GPU's when CUDA is available, else numpy's."""
    from .host_decoder import HostDecoder

    try:
        return HostDecoder(layout, check_crc=False)  # its callers' stores check their own crc32 per record
    except NativeBuildError:
        pass
    if torch.cuda.is_available():
        return DeviceDecoder(layout, "cuda")
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
