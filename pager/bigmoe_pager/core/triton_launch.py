"""Pick how a Triton kernel runs for the tensors at hand.

CUDA tensors get the compiled kernel. CPU tensors get Triton's interpreter,
which runs the same kernel source on the CPU (as TRITON_INTERPRET=1 does, but
chosen per call), so kernels are tested here without a GPU and the CPU build
can still call them.
"""

from __future__ import annotations

from functools import lru_cache

import torch

try:
    import triton
except ImportError:  # the torch paths work without Triton
    triton = None


class TritonMissing(RuntimeError):
    """A Triton kernel was asked for but Triton is not installed."""


def available() -> bool:
    return triton is not None


def kernel_for(kernel, device: torch.device):
    """The launchable form of a @triton.jit kernel for tensors on `device`."""
    if triton is None:
        raise TritonMissing("this path needs Triton (pip install triton); the GPU build of vLLM ships it")
    if device.type == "cpu":
        return _interpreted(kernel)
    return kernel


@lru_cache(maxsize=None)
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    return InterpretedFunction(kernel.fn)
