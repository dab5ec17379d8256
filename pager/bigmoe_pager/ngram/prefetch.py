"""One step's n-gram rows from the table to the device, overlapped with compute.

`start(ids)` queues the ids' copy to pinned host memory and hands the gather
to a worker thread, then returns at once: the worker waits for the ids (a CUDA
event, GIL released), reads the rows into a pinned staging buffer and is done
while the GPU runs the layers before the PLE layer. `finish(out)` waits for the
worker and queues one host-to-device copy of all rows on the current stream.
Both run eagerly: under vLLM's breakable CUDA graphs they are eager segments,
never captured.

A gather that fails raises its NgramError from `finish`, on the caller's
thread; one that does not finish in `timeout_s` raises NgramReadError and the
prefetcher refuses further work (the worker may still write its buffer).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .errors import NgramReadError
from .table import NgramTable


class RowPrefetcher:
    """Stages up to `max_ids` rows per step between an NgramTable and `device`."""

    def __init__(self, table: NgramTable, max_ids: int, device: torch.device | str, timeout_s: float = 30.0):
        self.table = table
        self.max_ids = max_ids
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        pin = self.device.type == "cuda"
        self._ids = torch.empty(max_ids, dtype=torch.int64, pin_memory=pin)
        self._rows = torch.empty((max_ids, table.row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._ids_ready = torch.cuda.Event() if pin else None
        self._rows_free = torch.cuda.Event() if pin else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="bigmoe-ngram-prefetch")
        self._pending: tuple[Future, int] | None = None
        self._broken = ""

    def start(self, ids: torch.Tensor) -> None:
        """Begin gathering the rows of `ids` (any shape, integer, on `device`)."""
        self._check_usable()
        if self._pending is not None:
            raise RuntimeError("n-gram prefetch started twice without finish()")
        n = ids.numel()
        if n > self.max_ids:
            raise ValueError(f"n-gram prefetch of {n} rows exceeds its staging buffer of {self.max_ids} rows")
        self._ids[:n].copy_(ids.reshape(-1), non_blocking=self._ids_ready is not None)
        if self._ids_ready is not None:
            self._ids_ready.record()
        self._pending = (self._worker.submit(self._gather, n), n)

    def finish(self, out: torch.Tensor) -> None:
        """Wait for the gather and copy its rows into `out` (device, n * row_bytes bytes, contiguous)."""
        if self._pending is None:
            raise RuntimeError("n-gram prefetch finish() without start()")
        future, n = self._pending
        self._pending = None
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._broken = f"a gather of {n} rows did not finish within {self.timeout_s} s"
            raise NgramReadError(f"n-gram prefetch: {self._broken}") from None
        nbytes = n * self.table.row_bytes
        if out.numel() * out.element_size() != nbytes or not out.is_contiguous():
            raise ValueError(
                f"n-gram prefetch output must be {nbytes} contiguous bytes, got {out.dtype} {list(out.shape)}"
            )
        out.view(torch.uint8).reshape(n, -1).copy_(self._rows[:n], non_blocking=self._rows_free is not None)
        if self._rows_free is not None:
            self._rows_free.record()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` as uint8 [*ids.shape, row_bytes] on ids.device, synchronously."""
        self._check_usable()
        host = ids.detach().to("cpu", torch.int64).numpy()
        rows = torch.from_numpy(self.table.gather(host))
        return rows.to(ids.device)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _gather(self, n: int) -> None:
        if self._ids_ready is not None:
            self._ids_ready.synchronize()  # the ids have landed in pinned memory
            self._rows_free.synchronize()  # the previous step's rows have left the staging buffer
        self.table.gather(self._ids[:n].numpy(), out=self._rows[:n].numpy())

    def _check_usable(self) -> None:
        if self._broken:
            raise NgramReadError(f"n-gram prefetch is unusable after an earlier failure: {self._broken}")
