"""Acquire loads, release stores and a polling pause for Triton programs that hand work over through memory words.

Two users: the SSD mailbox (ssd_mailbox: GPU and host threads, so system scope) and the prefetch chain
(prefetch_chain: kernels of one device, so GPU scope). SYSTEM picks the scope. In Triton's CPU interpreter
(ON_GPU=False) they are plain volatile loads and stores, and the pause does nothing.

A load runs in every warp of a program, each at its own moment, so warps can read different values of a word that
another kernel is changing (the converged lanes of one warp load an address in one instruction and see one value: a
one-warp kernel, as the SSD mailbox's, does not part this way). Branching on such a value splits the program: a
branch that holds a barrier (a scalar atomic, a reduction across warps) then deadlocks or pairs the wrong barriers,
and warps go on with different decisions (seen on the H200 as slots holding parts of two experts, and as illegal
addresses). A loop that only polls (no barrier inside) until a word that only grows reaches a value is safe: every
thread leaves it having seen that value. Anything else branches on `load_uniform`, one atomic read whose value every
thread of the program shares.
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
def load_uniform(ptr):
    """An acquire read of one GPU-scope word, made once by the program (Triton makes a scalar atomic in one thread and
    hands its result to the others): every thread gets the same value to branch on."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


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
