"""Host I/O workers that fill pinned RAM slots with experts read from SSD.

Two ways in, one machinery (a thread pool of `io_workers` readers):

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

Every read lands first in a worker-owned staging buffer and is checked (paging
file: crc32) before it is copied into the slot, under a per-request lock: a late
read that completes after its retry (or after the request was given up) is
discarded, so it can never overwrite a slot that now holds another expert. A
new request for a slot supersedes an unfinished earlier one for the same slot
(a step that took the slot of a read-ahead nobody needed): the earlier read is
discarded whenever it finishes, so the newer one's bytes are the slot's.

Late reads: an attempt not answered within `read_timeout_s` is issued again on
another worker (at most `read_retries` times); failed attempts are retried when
they may be transient (checksum mismatch); ReadError (already retried at file
level) and bad requests fail at once. The GPU's own deadline is longer than the
host's, so normally the host reports first, with the file and expert named.

Who answers the mailbox: by default C threads (ssd_reader.c, `reader="native"`), which pick up,
read, check, copy and answer without the GIL; Python keeps the failure's message, the counters
(`collect()`) and the lifecycle. With `reader="python"`, or where the native reader cannot start
(`reader_note` says why), Python threads do it: then each read crosses the GIL several times, and
a thread holding it (vLLM's, between launches) delays every answer by up to the switch interval.
Either way the GPU's kernel waits only on mailbox words, never on a Python call.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from . import ssd_mailbox as mb
from .expert_store import ExpertStore
from .odirect import SystemFileIO, aligned_empty, as_byte_array
from .paging_file import ChecksumError
from .ram_tier import ServiceFetch
from .read_stats import ReadCounters
from .ssd_reader import NativeReader, NativeReaderError

IDLE_SLEEP_S = (20e-6, 1e-3)  # seconds between mailbox polls: right after work, and at most when idle
ACTIVE_WINDOW_S = 0.02  # seconds after the last request during which the poller polls at the fast rate
LOAD_POLL_S = 20e-6  # seconds between checks of a native load's done words


class HostCounterSink(Protocol):
    """Where else per-layer SSD counters go (stats.TierCounters of the "ssd" tier fits)."""

    def add_host(self, **values: int) -> None: ...


class SsdError(RuntimeError):
    """An expert could not be brought from SSD into its RAM slot; the step that needed it is invalid."""


@dataclass(eq=False)  # identity: jobs live in a set while in flight
class _Job:
    """One expert read into one RAM slot, with its attempts."""

    layer: int
    """MoE layer."""
    expert: int
    """Expert id."""
    slot: int
    """RAM slot row in the layer's buffer."""
    entry: int = -1
    """Mailbox entry it came from (-1: host-driven load)."""
    seq: int = 0
    """Mailbox sequence number to write back as done (0 for host-driven loads)."""
    attempts: int = 0
    """Attempts issued so far."""
    issued_at: float = 0.0
    """time.monotonic() of the latest attempt's issue, in seconds."""
    state: str = "pending"
    """pending, done, failed, or superseded (a newer job writes its slot)."""
    error: str = ""
    """Why it failed."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Serializes completing the job against late attempts."""
    finished: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when the job is done or failed."""


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
        reader: str = "native",
    ):
        """reader: "native" (C threads answer the mailbox, where they can start: see reader_note) or "python"."""
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
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="bigmoe-ssd")
        self._staging = threading.local()
        self._inflight: set[_Job] = set()
        self._inflight_lock = threading.Lock()
        self._owner: dict[tuple[int, int], _Job] = {}
        """(layer, RAM slot) -> the latest job that writes it; an older unfinished one is superseded."""
        self._owner_lock = threading.Lock()
        self._error: str | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._native: NativeReader | None = None
        self.reader_note = "" if reader == "native" else "BIGMOE_SSD_READER=python"
        """Why Python threads answer the mailbox ("" when the native reader does, or there is no mailbox)."""
        self._collected = np.zeros((store.num_layers, 5), dtype=np.int64)
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
            reads, nbytes, ns, retries, errors = (int(v) for v in delta[layer])
            self.counters[layer].add_many(reads=reads, bytes=nbytes, read_ns=ns, retries=retries, errors=errors)
            self._sink(int(layer), read_ns=ns, retries=retries, errors=errors)

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
        jobs = [_Job(layer, e, s) for e, s in pairs]
        for job in jobs:
            self._start(job)
        for job in jobs:
            while not job.finished.wait(0.005):
                self._watch_late()
        self.check()

    # ---- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the poller and the workers (reads in progress finish on their own)."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        if self._native is not None:
            self.collect()
            self._native.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        self._handled = np.zeros(self.entries, dtype=np.int64)
        self._poller = threading.Thread(target=self._poll, name="bigmoe-ssd-poller", daemon=True)
        self._poller.start()

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
        if failure.kind == 4 and hasattr(self.store, "record_failed_checks"):
            why = self.store.record_failed_checks(failure.layer, failure.expert, failure.attempts)
            why += f" (after {failure.attempts} attempts)"
        where = "the mailbox" if failure.kind == 6 else self.store.describe(failure.layer, failure.expert)
        return (
            f"SSD read of layer {failure.layer} expert {failure.expert} into RAM slot {failure.slot} failed: {why}; "
            f"source: {where}"
        )

    def _poll(self) -> None:
        """Pick up requests the GPU published; keep an eye on late reads."""
        req = self._box[mb.REQ : mb.done_base(self.entries)].reshape(self.entries, mb.WORDS_PER_REQUEST)
        last_work = time.monotonic()
        sleep = IDLE_SLEEP_S[0]
        while not self._stop.is_set():
            seqs = req[:, 0].copy()  # the seq words first: each was written after its payload
            fresh = np.flatnonzero(seqs > self._handled)
            # posted reads first: a step's request for a slot is always published after the posted read
            # it supersedes, never before one, so within one scan this is the order the GPU issued them
            fresh = np.concatenate([fresh[fresh >= self.max_requests], fresh[fresh < self.max_requests]])
            for i in fresh:
                layer, expert, slot = (int(x) for x in req[i, 1:4])
                self._handled[i] = seqs[i]
                self._start(_Job(layer, expert, slot, entry=int(i), seq=int(seqs[i])))
            self._watch_late()
            now = time.monotonic()
            if fresh.size:
                last_work, sleep = now, IDLE_SLEEP_S[0]
            elif now - last_work > ACTIVE_WINDOW_S:
                sleep = min(sleep * 2, IDLE_SLEEP_S[1])
            time.sleep(sleep)

    def _start(self, job: _Job) -> None:
        why = self._invalid(job)
        if why:
            self._finish_failed(job, f"bad request: {why}")
            return
        if self._error is not None:
            self._finish_failed(job, "the SSD tier already failed")
            return
        self._supersede(job)
        with self._inflight_lock:
            self._inflight.add(job)
        self._issue(job)

    def _supersede(self, job: _Job) -> None:
        """Make `job` its slot's writer; an unfinished earlier job for the slot will never write it."""
        with self._owner_lock:
            earlier = self._owner.get((job.layer, job.slot))
            self._owner[(job.layer, job.slot)] = job
        if earlier is None or earlier is job:
            return
        with earlier.lock:  # waits out a copy into the slot in progress; later attempts see the state
            if earlier.state != "pending":
                return
            earlier.state = "superseded"
        with self._inflight_lock:
            self._inflight.discard(earlier)
        earlier.finished.set()

    def _issue(self, job: _Job) -> None:
        job.attempts += 1
        job.issued_at = time.monotonic()
        if job.attempts > 1:
            self.counters[job.layer].add_retry()
            self._sink(job.layer, retries=1)
        self._pool.submit(self._attempt, job)

    def _attempt(self, job: _Job) -> None:
        """One read of job's expert into this worker's staging buffer, then into the slot if still wanted."""
        staging = self._staging_buffer()
        t0 = time.perf_counter_ns()
        try:
            length = self.store.read(job.layer, job.expert, staging)
        except ChecksumError as e:
            self._attempt_failed(job, str(e), retry=True)
            return
        except Exception as e:  # ReadError, ODirectError, a store bug: all end the job with their message
            self._attempt_failed(job, f"{e.__class__.__name__}: {e}", retry=False)
            return
        with job.lock:
            if job.state != "pending":
                return  # a late duplicate: the job was answered or given up meanwhile
            self._rows[job.layer][job.slot][:length] = staging[:length]
            job.state = "done"
        ns = time.perf_counter_ns() - t0
        self.counters[job.layer].add_read(length, ns)
        self._sink(job.layer, read_ns=ns)
        self._finish(job)

    def _attempt_failed(self, job: _Job, why: str, retry: bool) -> None:
        with job.lock:
            if job.state != "pending":
                return
            if retry and job.attempts <= self.read_retries:
                self._issue(job)
                return
            job.state = "failed"
        self._finish_failed(job, f"{why} (after {job.attempts} attempts)")

    def _watch_late(self) -> None:
        """Re-issue attempts older than read_timeout_s; give up on jobs out of attempts."""
        now = time.monotonic()
        with self._inflight_lock:
            late = [j for j in self._inflight if now - j.issued_at > self.read_timeout_s]
        for job in late:
            with job.lock:
                if job.state != "pending" or now - job.issued_at <= self.read_timeout_s:
                    continue
                if job.attempts <= self.read_retries:
                    self._issue(job)
                    continue
                job.state = "failed"
            self._finish_failed(job, f"no answer within {self.read_timeout_s} s, {job.attempts} attempts")

    def _finish(self, job: _Job) -> None:
        with self._inflight_lock:
            self._inflight.discard(job)
        if job.entry >= 0:
            self._box[mb.done_base(self.entries) + job.entry] = job.seq  # after the slot bytes (x86 keeps order)
        job.finished.set()

    def _finish_failed(self, job: _Job, why: str) -> None:
        job.state, job.error = "failed", why
        if 0 <= job.layer < len(self.counters):
            self.counters[job.layer].add_error()
            self._sink(job.layer, errors=1)
        where = self.store.describe(job.layer, job.expert) if not why.startswith("bad request") else "the mailbox"
        self._fail_service(
            f"SSD read of layer {job.layer} expert {job.expert} into RAM slot {job.slot} failed: {why}; source: {where}"
        )
        if job.entry >= 0:
            self._box[mb.HOST_ERROR] = job.seq
        with self._inflight_lock:
            self._inflight.discard(job)
        job.finished.set()

    def _sink(self, layer: int, **values: int) -> None:
        if self._sinks is not None:
            self._sinks[layer].add_host(**values)

    def _fail_service(self, message: str) -> None:
        if self._error is None:
            self._error = message

    def _invalid(self, job: _Job) -> str:
        if not 0 <= job.layer < self.store.num_layers:
            return f"layer {job.layer} outside 0..{self.store.num_layers - 1}"
        if not 0 <= job.expert < self.store.num_experts:
            return f"expert {job.expert} outside 0..{self.store.num_experts - 1}"
        if not 0 <= job.slot < len(self._rows[job.layer]):
            return f"RAM slot {job.slot} outside 0..{len(self._rows[job.layer]) - 1} of layer {job.layer}"
        return ""

    def _staging_buffer(self) -> np.ndarray:
        buf = getattr(self._staging, "buf", None)
        if buf is None:
            buf = self._staging.buf = aligned_empty(self.store.layout.pitch).numpy()
        return buf


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
