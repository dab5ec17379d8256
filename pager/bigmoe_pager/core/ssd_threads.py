"""PythonReader: the SSD tier's reads done by Python threads, where the native reader (ssd_reader.c) cannot run.

A poller thread picks up the requests the GPU publishes in the mailbox (`serve`); `load` starts reads from the
calling thread (the host-driven path). Either way a pool of `io_workers` threads reads each expert, a step's requests
and loads before reads ahead (posted reads) that have not started (except a read ahead a step now waits for: the
GPU writes its seq into the entry's hurry word and the poller moves it up), into a worker-owned staging buffer,
checks it (the store raises ChecksumError), and copies it into its RAM slot under the job's lock: a late attempt
that completes after its retry, or after the job was given up or superseded by a newer request for the same slot,
is discarded, so it never overwrites a slot that now holds another expert. An attempt not answered within
`read_timeout_s` is issued again (at most `read_retries` times), and so is one failing its checksum; a read error
or a bad request fails at once. Failures go to the service (`fail`), which owns the message the server shows;
HOST_ERROR tells the GPU.

Every read crosses the GIL several times (hand-off, the worker's return, the copy, the answer): beside a thread
that holds it, as vLLM's does between launches, each crossing waits up to the switch interval. Inside vLLM
that cost did not show (decode leaves the GIL free while a step waits: docs/benchmarks.md run 29), so these threads
are the default and the native reader an option.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from . import ssd_mailbox as mb
from .expert_store import ExpertStore
from .odirect import aligned_empty
from .paging_file import ChecksumError
from .read_stats import ReadCounters

IDLE_SLEEP_S = (20e-6, 1e-3)  # seconds between mailbox polls: right after work, and at most when idle
ACTIVE_WINDOW_S = 0.02  # seconds after the last request during which the poller polls at the fast rate


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
    taken: int = 0
    """Attempts a worker has taken (a hurried read ahead waits in both queues; the copy found later is passed over)."""
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


class PythonReader:
    """The Python threads that read experts into RAM slots; see the module doc."""

    def __init__(
        self,
        store: ExpertStore,
        rows: Sequence[np.ndarray],
        counters: Sequence[ReadCounters],
        *,
        io_workers: int,
        read_timeout_s: float,
        read_retries: int,
        sink: Callable[..., None],
        fail: Callable[[str], None],
        failed: Callable[[], str | None],
    ):
        """rows: per layer, its RAM slots as a writable uint8 array [R, row bytes]; counters: per layer, where reads,
        retries and errors are added; sink(layer, **values): the same for the stats sinks; fail(message): the
        service's first failure; failed(): the service's failure so far (None: healthy)."""
        self.store = store
        self._rows = rows
        self.counters = counters
        self.read_timeout_s = read_timeout_s
        self.read_retries = read_retries
        self._sink = sink
        self._fail = fail
        self._failed = failed
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="bigmoe-ssd")
        self._waiting: tuple[deque[_Job], deque[_Job]] = (deque(), deque())
        """Attempts not yet taken by a worker: (a step's requests and loads, reads ahead); a worker takes the oldest
        of the first before any of the second, so a wrong read ahead not yet started never delays a read the GPU
        waits on (run 56: reads ahead at recall 0.8 tripled the disk bytes and cost up to 86% a token)."""
        self._waiting_lock = threading.Lock()
        self._staging = threading.local()
        self._inflight: set[_Job] = set()
        self._inflight_lock = threading.Lock()
        self._owner: dict[tuple[int, int], _Job] = {}
        """(layer, RAM slot) -> the latest job that writes it; an older unfinished one is superseded."""
        self._owner_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._box: np.ndarray | None = None

    def serve(self, box: np.ndarray, entries: int, max_requests: int) -> None:
        """Answer the mailbox `box` (int64 words of `entries` entries, posted reads from `max_requests` on)."""
        self._box, self.entries, self.max_requests = box, entries, max_requests
        self._handled = np.zeros(entries, dtype=np.int64)
        self._hurried = np.zeros(entries, dtype=np.int64)
        self._posted: dict[int, _Job] = {}
        """Mailbox entry -> its latest posted read (the poller's own)."""
        self._poller = threading.Thread(target=self._poll, name="bigmoe-ssd-poller", daemon=True)
        self._poller.start()

    def load(self, layer: int, pairs: list[tuple[int, int]]) -> None:
        """Read each (expert, RAM slot) of `layer` now, in parallel; returns when every one is done or failed."""
        jobs = [_Job(layer, e, s) for e, s in pairs]
        for job in jobs:
            self._start(job)
        for job in jobs:
            while not job.finished.wait(0.005):
                self._watch_late()

    def close(self) -> None:
        """Stop the poller and the workers (reads in progress finish on their own)."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

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
                job = _Job(layer, expert, slot, entry=int(i), seq=int(seqs[i]))
                if i >= self.max_requests:
                    self._posted[int(i)] = job
                self._start(job)
            self._hurry()
            self._watch_late()
            now = time.monotonic()
            if fresh.size:
                last_work, sleep = now, IDLE_SLEEP_S[0]
            elif now - last_work > ACTIVE_WINDOW_S:
                sleep = min(sleep * 2, IDLE_SLEEP_S[1])
            time.sleep(sleep)

    def _hurry(self) -> None:
        """Reads ahead a step now waits for (their hurry words) join the requests' queue unless a worker has them."""
        posted = slice(self.max_requests, self.entries)  # only posted entries have hurry words in use
        hurry = self._box[mb.hurry_base(self.entries) :][posted].copy()
        fresh = (hurry > self._hurried[posted]) & (hurry <= self._handled[posted])  # not acted on; its post seen
        for i, seq in zip(np.flatnonzero(fresh) + self.max_requests, hurry[fresh]):
            self._hurried[i] = seq
            job = self._posted.get(int(i))
            if job is None or job.seq != seq or job.state != "pending":
                continue
            with self._waiting_lock:
                if job.taken < job.attempts:
                    self._waiting[0].append(job)
                    self.counters[job.layer].add_hurried()
                    self._sink(job.layer, hurried=1)

    def _start(self, job: _Job) -> None:
        why = self._invalid(job)
        if why:
            self._finish_failed(job, f"bad request: {why}")
            return
        if self._failed() is not None:
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
        with self._waiting_lock:
            self._waiting[self._is_ahead(job)].append(job)
        self._pool.submit(self._attempt_next)  # one task an attempt: every task finds one waiting

    def _is_ahead(self, job: _Job) -> bool:
        """Whether the job is a posted read (its mailbox entry is past the blocking requests')."""
        return self._box is not None and job.entry >= self.max_requests

    def _attempt_next(self) -> None:
        """One task an issued attempt: the oldest waiting attempt no worker has taken, the requests' queue first."""
        with self._waiting_lock:
            job = self._take_waiting()
        if job is not None:
            self._attempt(job)

    def _take_waiting(self) -> _Job | None:
        for queue in self._waiting:
            while queue:
                job = queue.popleft()
                if job.taken < job.attempts:  # else a copy of an attempt already taken (a hurried read ahead's)
                    job.taken = job.attempts
                    return job
        return None

    def _attempt(self, job: _Job) -> None:
        """One read of job's expert into this worker's staging buffer, then into the slot if still wanted."""
        if job.state != "pending":
            return  # superseded or answered while it waited: no read (a late one would be discarded anyway)
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
        if job.entry >= 0 and self._box is not None:
            self._box[mb.done_base(self.entries) + job.entry] = job.seq  # after the slot bytes (x86 keeps order)
        job.finished.set()

    def _finish_failed(self, job: _Job, why: str) -> None:
        job.state, job.error = "failed", why
        if 0 <= job.layer < len(self.counters):
            self.counters[job.layer].add_error()
            self._sink(job.layer, errors=1)
        where = self.store.describe(job.layer, job.expert) if not why.startswith("bad request") else "the mailbox"
        self._fail(
            f"SSD read of layer {job.layer} expert {job.expert} into RAM slot {job.slot} failed: {why}; source: {where}"
        )
        if job.entry >= 0 and self._box is not None:
            self._box[mb.HOST_ERROR] = job.seq
        with self._inflight_lock:
            self._inflight.discard(job)
        job.finished.set()

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
