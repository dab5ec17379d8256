"""HostCopier: a GIL-free host thread that serves GPU-published copy lists with DMA copies.

A GPU kernel (inside a CUDA graph) decides, per MoE layer, which expert records go into which VRAM slots and
publishes the list into the layer's mailbox, an int64 tensor in pinned host memory:

    [0] seq    stored last (system-scope release); a new round is any new value, 0 = none yet
    [1] count  entries in the lists below (a prefix)
    [2] reserved
    [3, 3+S)     rows   record row of the expert to copy (-1: skip the entry)
    [3+S, 3+2S)  slots  destination slot (-1: skip)
    [3+2S, 3+3S) goals  value written into copied[slot] once that entry's bytes are in place

The thread lives in C (host_copier.c, compiled here at first use and loaded with ctypes), so vLLM's Python
thread, which holds the GIL most of the time, never delays a copy. On CUDA it issues cuMemcpyHtoDAsync on its
own non-blocking stream, so copy engines rather than SMs move the bytes; on the CPU (what the unit tests and
Triton's interpreter use) it memcpy()s and publishes each completion word with a release store.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from . import native_build

SOURCE = Path(__file__).with_name("host_copier.c")
MAX_LAYERS = 256  # host_copier.c's MAX_LAYERS
MAX_COMPONENTS = 4  # host_copier.c's MAX_COMPONENTS
HEADER_WORDS = 3  # seq, count, reserved
HOT_MS = 50  # busy polling after the last round (ms): longer than any gap between two decode steps


def mailbox_words(slots: int) -> int:
    """int64 words of the mailbox of a layer of `slots` slots: the header, then rows, slots and goals [slots] each."""
    return HEADER_WORDS + 3 * slots


STATS = ("rounds", "experts", "bytes", "error", "layers", "passes")
"""copier_stats' words: layer rounds served, entries copied, bytes copied (issued, on CUDA), first error code
(0: none; > 0: a CUresult; < 0: the copier's own, see host_copier.c), layers added, full polls of all layers."""


class HostCopierError(RuntimeError):
    """The copier's library could not be built, or its thread recorded an error and stopped copying."""


def library() -> ctypes.CDLL:
    """The copier's library for the current $CC and cache dir, built on first use (native_build; loaded once)."""
    try:
        return _declare(native_build.library(SOURCE))
    except native_build.NativeBuildError as e:
        raise HostCopierError(f"host copier: {e}") from None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.copier_start.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.copier_start.restype = ctypes.c_void_p
    lib.copier_add_layer.argtypes = [ctypes.c_void_p, i64p, ctypes.c_int64]
    lib.copier_add_layer.restype = ctypes.c_int
    lib.copier_stats.argtypes = [ctypes.c_void_p, i64p]
    lib.copier_stats.restype = None
    lib.copier_error_call.argtypes = [ctypes.c_void_p]
    lib.copier_error_call.restype = ctypes.c_char_p
    lib.copier_stop.argtypes = [ctypes.c_void_p]
    lib.copier_stop.restype = None
    return lib


def _stop(lib: ctypes.CDLL, handle: int, keep: list[torch.Tensor]) -> None:
    """Stop and join the thread; `keep` (the tensors it reads) is released only after this returns."""
    lib.copier_stop(handle)


def publish(
    mailbox: torch.Tensor,
    seq: int,
    rows: Sequence[int],
    slots: Sequence[int],
    goals: Sequence[int],
    count: int | None = None,
) -> None:
    """Fill a mailbox the way the GPU kernel does: the lists, then count, then seq last.

    count: entries the round holds (a prefix of the lists; default all of them). Plain stores, each a separate
    torch op: their order is the program's on x86 (TSO), which is where this stand-in for the GPU runs.
    """
    s = (mailbox.numel() - HEADER_WORDS) // 3
    n = len(rows)
    if not (len(slots) == len(goals) == n <= s):
        raise ValueError(
            f"publish: rows, slots, goals must have one length <= {s} slots; got {n}, {len(slots)}, {len(goals)}"
        )
    count = n if count is None else count
    for start, values in ((HEADER_WORDS, rows), (HEADER_WORDS + s, slots), (HEADER_WORDS + 2 * s, goals)):
        mailbox[start : start + n] = torch.as_tensor(values, dtype=torch.int64)
    mailbox[1] = count
    mailbox[0] = seq


class HostCopier:
    """The copier thread of one device; see the module doc for the mailbox it serves.

    ring_words: pinned int64 words the completion copies read from on CUDA, used round-robin; at most one
    forward's copies are in flight, so twice the slots of all layers never overwrites one a DMA still reads.
    hot_ms: how long the thread busy-polls after its last round before it naps (20 us naps, 1 ms ones after a
    second); 0: it naps at once, and a round waits for the end of a nap (tens of microseconds) before it is copied;
    None: HOT_MS.
    """

    def __init__(self, device: torch.device, ring_words: int = 1 << 16, hot_ms: int | None = None):
        hot_ms = HOT_MS if hot_ms is None else hot_ms
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"HostCopier: device must be cpu or cuda, got {device}")
        if ring_words < 2:
            raise ValueError(f"HostCopier: ring_words must be >= 2, got {ring_words}")
        if hot_ms < 0:
            raise ValueError(f"HostCopier: hot_ms must be >= 0, got {hot_ms}")
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.ring = torch.zeros(ring_words, dtype=torch.int64, pin_memory=self.cuda)
        self._lib = library()
        self._lock = threading.Lock()  # add_layer, stats and close release the GIL inside C: serialize them
        self._keep: list[torch.Tensor] = [self.ring]  # every tensor whose address the thread holds
        self._slots = 0  # sum of S over the layers
        if self.cuda:
            # copier_start captures the calling thread's current context: make it this device's primary one.
            torch.cuda.init()
            with torch.cuda.device(device):
                torch.zeros(1, device=device)
                handle = self._lib.copier_start(1, self.ring.data_ptr(), ring_words, hot_ms * 1_000_000)
        else:
            handle = self._lib.copier_start(0, self.ring.data_ptr(), ring_words, hot_ms * 1_000_000)
        if not handle:
            raise HostCopierError("host copier: could not allocate the copier or start its thread")
        self._handle: int | None = handle
        # Stops the thread before the tensors it reads go (the finalizer holds them), at garbage collection or,
        # failing that, at interpreter exit (weakref.finalize runs pending finalizers from atexit).
        self._finalizer = weakref.finalize(self, _stop, self._lib, handle, self._keep)
        try:
            self.check()
        except HostCopierError:
            self.close()
            raise

    @staticmethod
    def mailbox(slots: int, device: torch.device, layers: int | None = None) -> torch.Tensor:
        """A zeroed mailbox for a layer of `slots` slots ([layers, words]: one a layer, each row a mailbox); pinned
        when `device` is CUDA (the GPU writes it)."""
        pin = torch.device(device).type == "cuda"
        shape = (mailbox_words(slots),) if layers is None else (layers, mailbox_words(slots))
        return torch.zeros(shape, dtype=torch.int64, pin_memory=pin)

    def add_layer(
        self,
        mailbox: torch.Tensor,
        records: torch.Tensor,
        pitch: int,
        components: list[tuple[int, int, torch.Tensor]],
        copied: torch.Tensor,
        slots: int,
    ) -> None:
        """Serve `mailbox` from now on (the thread may be running).

        records: uint8, record r at byte r * pitch. components: (offset within the record in bytes, nbytes, dst),
        dst contiguous with slots along dim 0. copied: int64 [>= slots], the completion words.
        """
        where = "HostCopier.add_layer"
        if slots < 1:
            raise ValueError(f"{where}: slots must be >= 1, got {slots}")
        if pitch < 1:
            raise ValueError(f"{where}: pitch must be >= 1 byte, got {pitch}")
        self._check_host(where, "mailbox", mailbox, torch.int64)
        if mailbox.numel() != mailbox_words(slots):
            raise ValueError(f"{where}: mailbox has {mailbox.numel()} words, want {mailbox_words(slots)}")
        self._check_host(where, "records", records, torch.uint8)
        if records.numel() < pitch:
            raise ValueError(f"{where}: records hold {records.numel()} bytes, less than one {pitch}-byte record")
        self._check_device(where, "copied", copied, torch.int64)
        if copied.numel() < slots:
            raise ValueError(f"{where}: copied has {copied.numel()} words, fewer than {slots} slots")
        if not 1 <= len(components) <= MAX_COMPONENTS:
            raise ValueError(f"{where}: 1 to {MAX_COMPONENTS} components, got {len(components)}")
        desc = [mailbox.data_ptr(), records.data_ptr(), pitch, records.numel() // pitch, copied.data_ptr()]
        desc += [slots, len(components)]
        for k, (offset, nbytes, dst) in enumerate(components):
            name = f"component {k}"
            if offset < 0 or nbytes < 1 or offset + nbytes > pitch:
                raise ValueError(
                    f"{where}: {name} bytes [{offset}, {offset + nbytes}) are not within the {pitch}-byte record"
                )
            self._check_device(where, name, dst, None)
            if dst.dim() < 1 or dst.shape[0] < slots:
                raise ValueError(f"{where}: {name} has shape {tuple(dst.shape)}, want {slots} slots along dim 0")
            stride = dst.numel() // dst.shape[0] * dst.element_size()  # bytes per slot
            if nbytes > stride:
                raise ValueError(f"{where}: {name} copies {nbytes} bytes into {stride}-byte slots")
            desc += [offset, nbytes, dst.data_ptr(), stride]
        with self._lock:
            handle = self._open(where)
            if 2 * (self._slots + slots) > self.ring.numel():
                raise ValueError(
                    f"{where}: ring of {self.ring.numel()} words is too small for "
                    f"{self._slots + slots} slots (needs twice as many)"
                )
            arr = (ctypes.c_int64 * len(desc))(*desc)
            if self._lib.copier_add_layer(handle, arr, len(desc)) < 0:
                raise HostCopierError(f"{where}: the copier holds at most {MAX_LAYERS} layers")
            self._slots += slots
            self._keep += [mailbox, records, copied, *(dst for _, _, dst in components)]

    def stats(self) -> dict[str, int]:
        """Counters of the thread (see STATS); readable until close()."""
        with self._lock:
            handle = self._open("HostCopier.stats")
            out = (ctypes.c_int64 * len(STATS))()
            self._lib.copier_stats(handle, out)
            got = dict(zip(STATS, out))
            if got["error"]:
                got["error_call"] = self._lib.copier_error_call(handle).decode()
            return got

    def check(self) -> None:
        """Raise HostCopierError if the thread recorded an error (it has copied nothing since)."""
        s = self.stats()
        if s["error"] > 0:
            raise HostCopierError(f"host copier: {s['error_call']} failed with CUDA error {s['error']}")
        if s["error"] < 0:
            raise HostCopierError(f"host copier: {s['error_call']} failed (copier error {s['error']})")

    def close(self) -> None:
        """Stop and join the thread (on CUDA after its copies land). Idempotent."""
        with self._lock:
            self._handle = None
            self._finalizer()

    def _open(self, where: str) -> int:
        if self._handle is None:
            raise HostCopierError(f"{where}: the copier is closed")
        return self._handle

    def _check_host(self, where: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")
        if self.cuda and not t.is_pinned():
            raise ValueError(f"{where}: {name} must be in pinned memory (the copies are DMA)")

    def _check_device(self, where: str, name: str, t: torch.Tensor, dtype: torch.dtype | None) -> None:
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{where}: {name} must be {dtype}, got {t.dtype}")
        if t.device != self.device or not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous on {self.device}, got {t.device}")
