"""Expand one compressed record read from SSD into a raw record in host RAM.

The host-driven pager keeps raw records in its RAM tier, so a compressed record
read from the paging file is expanded before it enters RAM. Two ways, same bytes:

    ReferenceDecoder()          numpy, on the CPU (seconds per 3 MiB expert: tests and CPU builds)
    DeviceDecoder(layout, dev)  the Triton kernel on the GPU, then one copy back (well under a millisecond)

`record_decoder(layout)` picks the GPU one when CUDA is available. Both raise
CodecError on a record that fails a check; dst then holds garbage and must not
be used (the pager forgets a record whose read raised).
"""

from __future__ import annotations

import numpy as np
import torch
from bigmoe_pager.core.layout import ExpertLayout

from .format import STAGING_ALIGN, CodecError, max_record_bytes
from .reference import decode_record


class ReferenceDecoder:
    """The numpy reference decoder (every structure and the crc32 checked on the host)."""

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


def record_decoder(layout: ExpertLayout) -> ReferenceDecoder | DeviceDecoder:
    """The GPU decoder when CUDA is available, else the reference decoder."""
    if torch.cuda.is_available():
        return DeviceDecoder(layout, "cuda")
    return ReferenceDecoder()
