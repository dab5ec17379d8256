"""Exact-size page-locked host buffers.

torch's pinned allocator rounds every block up to a power of two (a 33 GiB RAM
tier would lock 64 GiB). Here the memory is an ordinary page-aligned host
allocation registered with CUDA (cudaHostRegister, which on UVA systems maps it
for the GPU too, so kernels dereference it directly), and unregistered just
before it is freed, when the last tensor viewing it goes away.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch

PAGE = 4096  # bytes; rows start page-aligned, as O_DIRECT reads into them need


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
    if pin and torch.cuda.is_available() and nbytes and not _register(raw, arr.ctypes.data, nbytes):
        return _torch_pinned(nbytes).view(dtype).view(shape)
    return torch.from_numpy(arr).view(dtype).view(shape)


def _register(owner: np.ndarray, ptr: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        warnings.warn(
            f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (CUDA error {err}); "
            "using torch's pinned allocator, which rounds the block up to a power of two"
        )
        return False
    # Runs when the array is deallocated, before its memory is released.
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
    return True


def _torch_pinned(nbytes: int) -> torch.Tensor:
    try:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise PinError(f"cannot page-lock {nbytes / 2**30:.2f} GiB of host memory ({e}); lower the RAM slots") from None
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip : skip + nbytes]
