"""Exact-size page-locked host buffers.

torch's pinned allocator rounds every block up to a power of two (a 33 GiB RAM
tier would lock 64 GiB). Here the memory is an ordinary page-aligned host
allocation registered with CUDA (cudaHostRegister, which on UVA systems maps it
for the GPU too, so kernels dereference it directly), and unregistered just
before it is freed, when the last tensor viewing it goes away.

That last view may go inside a CUDA graph capture: a garbage collection while
vLLM (or a test) captures collects a dead pager's buffers there. cudaHostUnregister
is a call the default (global) capture mode forbids, and made then it voids the
capture. So a block released while this thread captures stays registered and
allocated until the next release or allocation outside a capture, and other
threads unregister in relaxed capture mode, which no capture forbids.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import warnings
import weakref

import numpy as np
import torch

PAGE = 4096  # bytes; rows start page-aligned, as O_DIRECT reads into them need
CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered: nothing left to undo


class PinError(RuntimeError):
    """CUDA refused to page-lock host memory, and so did torch's own pinned allocator."""


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8, pin: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor of `shape`, page-aligned, page-locked and GPU-mapped when pin and CUDA is up."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for d in shape:
        nbytes *= int(d)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    skip = (-raw.ctypes.data) % PAGE
    arr = raw[skip : skip + nbytes]
    if pin and torch.cuda.is_available() and nbytes:
        _UNPIN.drain()
        if not _register(raw, arr, nbytes):
            return _torch_pinned(nbytes).view(dtype).view(shape)
    return torch.from_numpy(arr).view(dtype).view(shape)


def _register(raw: np.ndarray, view: np.ndarray, nbytes: int) -> bool:
    ptr = view.ctypes.data
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        warnings.warn(
            f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (CUDA error {err}); "
            "using torch's pinned allocator, which rounds the block up to a power of two"
        )
        return False
    # Runs when the last tensor over `view` goes; it holds `raw`, the allocation, so the unregister may wait.
    weakref.finalize(view, _UNPIN.release, raw, ptr)
    return True


class _Unpinner:
    """Registered blocks whose last view is gone, unregistered (then freed) outside any capture on this thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # finalizers run on whichever thread collects
        self._waiting: list[tuple[np.ndarray, int]] = []  # (allocation, registered address)

    def release(self, raw: np.ndarray, ptr: int) -> None:
        with self._lock:
            self._waiting.append((raw, ptr))
        self.drain()

    def drain(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            return
        with self._lock:
            blocks, self._waiting = self._waiting, []
        unregister = torch.cuda.cudart().cudaHostUnregister
        with _relaxed_capture_mode():
            refused = [b for b in blocks if int(unregister(b[1])) not in (0, NOT_REGISTERED)]
        if refused:  # kept, registered and allocated, for the next drain: never freed while CUDA still maps it
            with self._lock:
                self._waiting.extend(refused)

    def waiting_bytes(self) -> int:
        """Bytes still registered after their last view went (a capture was under way on the releasing thread)."""
        with self._lock:
            return sum(raw.nbytes for raw, _ in self._waiting)


_UNPIN = _Unpinner()  # one per process, as CUDA's registrations are


def waiting_bytes() -> int:
    """Page-locked bytes whose tensors are gone and whose unregistering waits for a capture to end."""
    return _UNPIN.waiting_bytes()


@functools.cache
def _exchange_capture_mode():
    """The driver's cuThreadExchangeStreamCaptureMode, or None without a driver that has it."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    return fn


@contextlib.contextmanager
def _relaxed_capture_mode():
    """This thread's CUDA calls in relaxed capture mode: a capture on another thread does not forbid them."""
    exchange = _exchange_capture_mode()
    mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
    if exchange is None or exchange(ctypes.byref(mode)) != 0:
        yield
        return
    try:
        yield
    finally:
        exchange(ctypes.byref(mode))


def _torch_pinned(nbytes: int) -> torch.Tensor:
    try:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise PinError(f"cannot page-lock {nbytes / 2**30:.2f} GiB of host memory ({e}); lower the RAM slots") from None
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip : skip + nbytes]
