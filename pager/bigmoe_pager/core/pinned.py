"""Exact-size page-locked host buffers.

torch's pinned allocator rounds every block up to a power of two (a 33 GiB RAM
tier would lock 64 GiB). Here the memory is an ordinary page-aligned host
allocation registered with CUDA (cudaHostRegister, which on UVA systems maps it
for the GPU too, so kernels dereference it directly), and unregistered just
before it is freed, when the last tensor viewing it goes away.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

PAGE = 4096  # bytes; rows start page-aligned, as O_DIRECT reads into them need


class PinError(RuntimeError):
    """CUDA refused to page-lock host memory (RLIMIT_MEMLOCK, or not enough RAM)."""


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
        _register(raw, arr.ctypes.data, nbytes)
    return torch.from_numpy(arr).view(dtype).view(shape)


def _register(owner: np.ndarray, ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise PinError(
            f"cannot page-lock {nbytes / 2**30:.1f} GiB of host memory (CUDA error {int(err)}); "
            "lower the RAM slots or raise the locked-memory limit (ulimit -l)"
        )
    # Runs when the array is deallocated, before its memory is released.
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
