"""The SSD tier's service: experts read from an ExpertStore into pinned RAM slots, on request.

Three ways in, answered by one of two readers (below):

- `request(layer, experts, slots)` with device tensors (CUDA, or the Triton
  interpreter): enqueues ssd_mailbox.request_kernel on the current stream, so it
  is capturable in a CUDA graph and replays with whatever ids the tensors hold.
  The kernel publishes the requests in the pinned mailbox and spins until the
  host marks each done; a poller thread here picks them up. Errors do not raise
  on the GPU: the kernel sets a flag and returns. **Contract: after a step that
  contains a request, the caller syncs (it does anyway to read sampled tokens)
  and calls `check()`, which raises `SsdError` if any read failed or the GPU gave
  up waiting; that step's outputs must then be thrown away.** Once failed, the
  service stays failed: later kernels return at once and `check()` keeps raising.
- `post(layer, experts, slots, posted)` (read-ahead, a service built with
  read_ahead=True): enqueues ssd_mailbox.post_kernel, which publishes the reads
  and returns; the GPU waits for none of them there. A later `request` given
  the RAM rows its step reads (`wait_rows`) and the layer's `posted` tensor waits
  for the posted reads of those rows only, instead of requesting them again;
  `settle` clears the entries of posted reads that are done, without waiting.
  A posted read that fails ends like any other: the flag, then `check()` raises.
- `load(layer, experts, slots)` (host-driven, outside CUDA graphs): reads now,
  in parallel, and returns when every slot holds its expert, raising `SsdError`
  on failure. On CUDA the caller must have synchronized so that no kernel reads
  those slots meanwhile. Without CUDA, `request` is this.

Both readers keep the same rules. Every read lands first in a worker-owned
staging buffer and is checked (paging file: crc32) before it is copied into the
slot: a late read that completes after its retry (or after the request was
given up) is discarded, so it can never overwrite a slot that now holds another
expert. A new request for a slot supersedes an unfinished earlier one for the
same slot (a step that took the slot of a read-ahead nobody needed): the earlier
read is discarded whenever it finishes, so the newer one's bytes are the slot's.
A worker takes a step's requests and host-driven loads before posted reads that have not started (FIFO within
each), so a wrong read ahead costs a request at most the read in flight, not a queue of them; a posted read
superseded before it starts is never read.
An attempt not answered within `read_timeout_s` is issued again on another
worker (at most `read_retries` times), and so is one failing its checksum; a
read error (already retried at file level) and a bad request fail at once. The
GPU's own deadline is longer than the host's, so normally the host reports
first, with the file and expert named.

The readers: by default (`reader="python"`, chosen by run 29 in docs/benchmarks.md)
Python threads (ssd_threads.py), each read crossing the GIL several times. With
`reader="native"`, C threads (ssd_reader.c through ssd_reader.py) answer the
mailbox, its `load`s included, without the GIL; this module then keeps the
failure's message, the counters (`collect()`) and the lifecycle. Without a
mailbox, or where the native reader cannot start (`reader_note` says why), the
Python threads serve. Either way the
GPU's kernel waits only on mailbox words, never on a Python call.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, Sequence

import numpy as np
import torch

from . import ssd_mailbox as mb
from .expert_store import ExpertStore
from .odirect import SystemFileIO, as_byte_array
from .ram_tier import ServiceFetch
from .read_stats import ReadCounters
from .ssd_reader import BAD_REQUEST, CHECKSUM, COUNTERS, NativeReader, NativeReaderError
from .ssd_threads import PythonReader

LOAD_POLL_S = 20e-6  # seconds between checks of a native load's done words


class HostCounterSink(Protocol):
    """Where else per-layer SSD counters go (stats.TierCounters of the "ssd" tier fits)."""

    def add_host(self, **values: int) -> None: ...


class SsdError(RuntimeError):
    """An expert could not be brought from SSD into its RAM slot; the step that needed it is invalid."""


class SsdService:
    """Reads experts from an ExpertStore into per-layer pinned RAM slot buffers, on request."""

    def __init__(
        self,
        store: ExpertStore,
        ram_slots: Sequence[torch.Tensor],
        *,
        io_workers: int = 4,
        read_timeout_s: float = 10.0,
        read_retries: int = 2,
        max_requests: int = 256,
        mailbox: bool | None = None,
        wait_timeout_s: float | None = None,
        sinks: Sequence[HostCounterSink] | None = None,
        read_ahead: bool = False,
        reader: str = "python",
    ):
        """reader: "python" (Python threads answer the mailbox) or "native" (C threads, where they can start: see
        reader_note)."""
        self.store = store
        self.io_workers = io_workers
        self.read_timeout_s = read_timeout_s
        self.read_retries = read_retries
        self.max_requests = max_requests
        self.wait_timeout_s = wait_timeout_s or (read_retries + 1) * read_timeout_s + 1.0
        self._rows = [_slot_rows(buf, store.layout.pitch, layer) for layer, buf in enumerate(ram_slots)]
        if len(self._rows) != store.num_layers:
            raise ValueError(f"{len(self._rows)} RAM slot buffers for a store of {store.num_layers} MoE layers")
        slots = [len(rows) for rows in self._rows]
        self.post_base = [max_requests + sum(slots[:layer]) for layer in range(len(slots))]
        """Mailbox entry of RAM slot 0 of each layer, for posted (read-ahead) reads."""
        self.host_base = max_requests + (sum(slots) if read_ahead else 0)
        """First mailbox entry of host-driven loads (the native reader serves `load` through the mailbox too)."""
        self.entries = self.host_base + (max_requests if reader == "native" else 0)
        """Mailbox entries: max_requests for blocking requests, one per RAM slot when reading ahead, then
        max_requests for host-driven loads when the native reader may serve them."""
        self.read_ahead = read_ahead
        self.counters = [ReadCounters() for _ in range(store.num_layers)]
        """Per MoE layer: expert reads into RAM slots (retries and errors at this level)."""
        self._sinks = list(sinks) if sinks is not None else None
        self._error: str | None = None
        self._threads = PythonReader(
            store,
            self._rows,
            self.counters,
            io_workers=io_workers,
            read_timeout_s=read_timeout_s,
            read_retries=read_retries,
            sink=self._sink,
            fail=self._fail_service,
            failed=lambda: self._error,
        )
        """The Python threads: they serve `load` without a mailbox, and the mailbox where the native reader
        cannot (their pool starts no thread until the first read)."""
        self._native: NativeReader | None = None
        self.reader_note = "" if reader == "native" else "BIGMOE_SSD_READER=python (the default)"
        """Why Python threads answer the mailbox ("" when the native reader does, or there is no mailbox)."""
        self._collected = np.zeros((store.num_layers, len(COUNTERS)), dtype=np.int64)
        self._collect_lock = threading.Lock()
        self._host_seq = 0
        self._load_lock = threading.Lock()  # native loads share the mailbox's host entries: one load at a time
        self.box: torch.Tensor | None = None
        if mailbox if mailbox is not None else torch.cuda.is_available():
            self._open_mailbox(native=reader == "native")

    @classmethod
    def from_settings(cls, store: ExpertStore, ram_slots: Sequence[torch.Tensor], settings, **kw) -> "SsdService":
        """A service with io_workers, read_timeout_s and read_retries from a PagerSettings."""
        return cls(
            store,
            ram_slots,
            io_workers=settings.io_workers,
            read_timeout_s=settings.read_timeout_s,
            read_retries=settings.read_retries,
            reader=settings.ssd_reader,
            **kw,
        )

    # ---- the GPU-driven path ---------------------------------------------------------

    def request(
        self,
        layer: int,
        experts: torch.Tensor,
        slots: torch.Tensor,
        wait_rows: torch.Tensor | None = None,
        posted: torch.Tensor | None = None,
    ) -> None:
        """Bring experts[i] into RAM slot slots[i] of `layer` (-1 entries skipped).

        With a mailbox: enqueues the request kernel on the current stream (capturable;
        errors are reported by `check()` after the caller's sync). Without: `load`.
        wait_rows, posted (read-ahead): the RAM rows the step reads (-1 padded) and the
        layer's posted seqs (int64 [R + 1], see `post`); the kernel also waits for
        those rows' posted reads and marks them confirmed.
        """
        if self.box is None:
            self.load(layer, experts, slots)
            return
        ahead = wait_rows is not None and posted is not None and self.read_ahead
        mb.launch_request(
            self.box,
            self._seq,
            self.error_flag,
            experts,
            slots,
            layer,
            self.max_requests,
            self.wait_timeout_s,
            entries=self.entries,
            wait_rows=wait_rows if ahead else None,
            posted=posted if ahead else None,
            post_entry0=self.post_base[layer],
        )

    def post(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, posted: torch.Tensor) -> None:
        """Start reading experts[i] into RAM slot slots[i] of `layer` (-1 skipped) and return (read-ahead).

        With a mailbox: enqueues the post kernel (capturable), which writes each read's seq into
        posted[slot] (int64 [R + 1] on the device, zeros at start); nothing waits for the reads
        until a `request` whose wait_rows name their slots. Without a mailbox: `load` (reads now).
        """
        if not self.read_ahead:
            raise ValueError("this SSD service was built without read_ahead=True; it has no entries to post to")
        if self.box is None:
            self.load(layer, experts, slots)
            return
        mb.launch_post(
            self.box, self._post_seq[layer : layer + 1], posted, experts, slots, layer, self.post_base[layer]
        )

    def settle(self, layer: int, posted: torch.Tensor) -> None:
        """Clear posted[r] of `layer`'s RAM slots whose posted reads are done (capturable; no wait)."""
        if self.box is not None and self.read_ahead:
            slots = len(self._rows[layer])
            mb.launch_settle(self.box, posted, slots, mb.done_base(self.entries) + self.post_base[layer])

    def check(self) -> None:
        """Raise SsdError if any read failed or the GPU gave up waiting (call after syncing the step)."""
        self.collect()
        if self._native is not None and self._error is None:
            failure = self._native.failure()
            if failure is not None:
                self._fail_service(self._native_message(failure))
        if self.box is not None:
            gpu = int(self._box[mb.GPU_ERROR])
            if gpu == mb.GPU_TIMED_OUT and self._error is None:
                self._fail_service(
                    f"the GPU waited {self.wait_timeout_s:g} s and SSD reads did not finish "
                    f"(batch {int(self._box[mb.GPU_ERROR_SEQ])}); host I/O workers are stuck or gone"
                )
        if self._error is not None:
            raise SsdError(self._error)

    def fetcher(self, layer: int) -> "LayerFetch":
        """One layer's view for the RAM tier (its SsdFetch): fetch(experts, slots) = request(layer, ...)."""
        return LayerFetch(self, layer)

    @property
    def failed(self) -> bool:
        """Whether the service has failed for good (check() would raise)."""
        if self._error is not None:
            return True
        return self.box is not None and (int(self._box[mb.GPU_ERROR]) != 0 or int(self._box[mb.HOST_ERROR]) != 0)

    @property
    def native(self) -> bool:
        """Whether C threads answer the mailbox (the native reader)."""
        return self._native is not None

    def collect(self) -> None:
        """Add what the native reader counted since the last call to `counters` and the sinks (a no-op when
        Python threads read: they add as they go). check() and stats() call it; so does the server's exporter."""
        if self._native is None:
            return
        with self._collect_lock:
            now = self._native.counters()
            delta, self._collected = now - self._collected, now
        for layer in np.flatnonzero(delta.any(axis=1)):
            reads, nbytes, ns, retries, errors, hurried = (int(v) for v in delta[layer])
            self.counters[layer].add_many(
                reads=reads, bytes=nbytes, read_ns=ns, retries=retries, errors=errors, hurried=hurried
            )
            self._sink(int(layer), read_ns=ns, retries=retries, errors=errors, hurried=hurried)

    # ---- the host-driven path (outside CUDA graphs) ------------------------------------

    def load(self, layer: int, experts: object, slots: object) -> None:
        """Read experts into RAM slots now, in parallel; returns when all are there, or raises SsdError."""
        pairs = [(int(e), int(s)) for e, s in zip(_ints(experts), _ints(slots)) if int(e) >= 0]
        if len({s for _, s in pairs}) != len(pairs):
            raise SsdError(f"layer {layer}: one RAM slot requested twice in one load: {pairs}")
        self.check()
        if self._native is not None:
            with self._load_lock:
                self._load_native(layer, pairs)
            return
        self._threads.load(layer, pairs)
        self.check()

    # ---- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the poller and the workers (reads in progress finish on their own)."""
        self._threads.close()
        if self._native is not None:
            self.collect()
            self._native.close()

    def __enter__(self) -> "SsdService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, object]:
        """Counters: per layer (expert reads into slots) and for the store's files (file-level retries; the native
        reader's file-level retries are not counted there)."""
        self.collect()
        return {"layers": [c.snapshot() for c in self.counters], "files": self.store.counters.snapshot()}

    # ---- internals ---------------------------------------------------------------------

    def _open_mailbox(self, native: bool) -> None:
        pin = torch.cuda.is_available()
        self.box = torch.zeros(mb.mailbox_words(self.entries), dtype=torch.int64, pin_memory=pin)
        self._box = self.box.numpy()
        device = "cuda" if pin and not mb.interpreting() else "cpu"
        self._seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.error_flag = torch.zeros(1, dtype=torch.int64, device=device)
        """Device copy of the GPU's error code (0 = fine), for on-device reactions; sticky."""
        self._post_seq = torch.zeros(len(self._rows), dtype=torch.int64, device=device)
        """Per layer: seq of its latest post (its posts are ordered on one stream, so no atomics)."""
        if native:
            self._native = self._start_native()
            if self._native is not None:
                return
        self._threads.serve(self._box, self.entries, self.max_requests)

    def _start_native(self) -> NativeReader | None:
        """The C threads over this mailbox, or None (reader_note says why) when they cannot start."""
        planner = getattr(self.store, "record_reads", None)
        if planner is None:
            self.reader_note = f"the native SSD reader cannot plan reads of a {type(self.store).__name__}"
            return None
        plan = planner()
        if any(type(f.io) is not SystemFileIO for f in plan.files):
            self.reader_note = "the store reads through its own file I/O, which only Python threads call"
            return None
        try:
            return NativeReader(
                self.box,
                self.entries,
                (self.max_requests, self.host_base),
                self._rows,
                plan,
                self.store.num_experts,
                workers=self.io_workers,
                timeout_s=self.read_timeout_s,
                retries=self.read_retries,
                file_retries=max(f.retries for f in plan.files),
            )
        except NativeReaderError as e:
            self.reader_note = str(e)
            return None

    def _load_native(self, layer: int, pairs: list[tuple[int, int]]) -> None:
        """`load` through the mailbox's host entries: publish like the GPU does, wait for the done words."""
        done = mb.done_base(self.entries)
        for start in range(0, len(pairs), self.max_requests):
            batch = pairs[start : start + self.max_requests]
            seqs = []
            for i, (expert, slot) in enumerate(batch):
                self._host_seq += 1
                at = mb.REQ + mb.WORDS_PER_REQUEST * (self.host_base + i)
                self._box[at + 1 : at + 4] = (layer, expert, slot)
                self._box[at] = self._host_seq  # last: the payload is in place first (x86 keeps store order)
                seqs.append(self._host_seq)
            entries = np.arange(self.host_base, self.host_base + len(batch)) + done
            deadline = time.monotonic() + self.wait_timeout_s
            while not (self._box[entries] == seqs).all():
                if self.failed:
                    break
                if time.monotonic() > deadline:
                    self._fail_service(
                        f"layer {layer}: SSD reads did not finish within {self.wait_timeout_s:g} s; "
                        "the native reader's threads are stuck or gone"
                    )
                    break
                time.sleep(LOAD_POLL_S)
            self.check()

    def _native_message(self, failure) -> str:
        """The native reader's first failure, in the words the Python threads use."""
        why = failure.why(self._native.plan.files)
        if failure.kind == CHECKSUM and hasattr(self.store, "record_failed_checks"):
            why = self.store.record_failed_checks(failure.layer, failure.expert, failure.attempts)
            why += f" (after {failure.attempts} attempts)"
        where = "the mailbox" if failure.kind == BAD_REQUEST else self.store.describe(failure.layer, failure.expert)
        return (
            f"SSD read of layer {failure.layer} expert {failure.expert} into RAM slot {failure.slot} failed: {why}; "
            f"source: {where}"
        )

    def _sink(self, layer: int, **values: int) -> None:
        if self._sinks is not None:
            self._sinks[layer].add_host(**values)

    def _fail_service(self, message: str) -> None:
        if self._error is None:
            self._error = message


class LayerFetch(ServiceFetch):
    """The SSD tier as one layer's RAM tier sees it (fetch, and post/settle for read-ahead)."""


def _slot_rows(buf: torch.Tensor, pitch: int, layer: int) -> np.ndarray:
    """A writable numpy view [R, pitch] of one layer's RAM slot buffer."""
    if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"layer {layer}: RAM slots must be a contiguous uint8 CPU tensor [R, pitch], "
            f"got {buf.dtype}{list(buf.shape)} on {buf.device}"
        )
    if buf.shape[1] < pitch:
        raise ValueError(f"layer {layer}: RAM slot rows are {buf.shape[1]} bytes; records need {pitch}")
    return as_byte_array(buf).reshape(buf.shape)


def _ints(values: object) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().reshape(-1).tolist()
    return [int(v) for v in values]
