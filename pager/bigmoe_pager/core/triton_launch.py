"""Pick how a Triton kernel runs for the tensors at hand.

CUDA tensors get the compiled kernel. CPU tensors can only run a kernel in
Triton's interpreter, which is chosen when kernels are decorated: the process
must start with TRITON_INTERPRET=1 (the unit tests do). The pager's CPU paths
use torch ops instead and never need this.
"""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # the torch paths work without Triton
    triton = None


class TritonMissing(RuntimeError):
    """A Triton kernel was asked for where it cannot run."""


def available() -> bool:
    return triton is not None


def kernel_for(kernel, device: torch.device):
    """The launchable form of a @triton.jit kernel for tensors on `device`."""
    if triton is None:
        raise TritonMissing("this path needs Triton (pip install triton); the GPU build of vLLM ships it")
    if device.type == "cpu" and not _interpreted(kernel):
        raise TritonMissing(
            "Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set before triton is imported)"
        )
    return kernel


def _interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
