"""Acquire loads, release stores and a polling pause for Triton programs that hand work over through memory words.

Two users: the SSD mailbox (ssd_mailbox: GPU and host threads, so system scope) and the prefetch chain
(prefetch_chain: kernels of one device, so GPU scope). SYSTEM picks the scope. In Triton's CPU interpreter
(ON_GPU=False) they are plain volatile loads and stores, and the pause does nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

SYS_SCOPE = tl.constexpr(True)
"""SYSTEM for a word the host reads or writes too."""
GPU_SCOPE = tl.constexpr(False)
"""SYSTEM for a word only this device's kernels use."""


# The PTX of each, by scope (a kernel reads only constexpr globals).
_LOAD_SYS = tl.constexpr("ld.acquire.sys.global.b64 $0, [$1];")
_LOAD_GPU = tl.constexpr("ld.acquire.gpu.global.b64 $0, [$1];")
_STORE_SYS = tl.constexpr("st.release.sys.global.b64 [$1], $2; mov.b32 $0, 0;")
_STORE_GPU = tl.constexpr("st.release.gpu.global.b64 [$1], $2; mov.b32 $0, 0;")


@triton.jit
def load_acquire(ptrs, SYSTEM: tl.constexpr, ON_GPU: tl.constexpr):
    """Never served from a stale line; at system scope it sees host stores in order."""
    if ON_GPU:
        value = tl.inline_asm_elementwise(
            _LOAD_SYS if SYSTEM else _LOAD_GPU, "=l,l", [ptrs], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        value = tl.load(ptrs, volatile=True)
    return value


@triton.jit
def store_release(ptrs, values, SYSTEM: tl.constexpr, ON_GPU: tl.constexpr):
    """What this program wrote before is visible to the other end (the host, at system scope) before this word."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            _STORE_SYS if SYSTEM else _STORE_GPU, "=r,l,l", [ptrs, values], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.store(ptrs, values)


@triton.jit
def pause(ON_GPU: tl.constexpr):
    if ON_GPU:  # ~0.25 us between polls keeps the polled line's traffic low
        tl.inline_asm_elementwise("nanosleep.u32 256; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
