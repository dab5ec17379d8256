"""The pinned mailbox through which the GPU asks host I/O workers for experts.

The mailbox is one pinned int64 tensor both sides address directly:

    word HOST_ERROR     host -> GPU: seq of the first batch that failed for good (0 = healthy); sticky
    word GPU_ERROR      GPU -> host: 1 = the GPU gave up waiting, 2 = it saw HOST_ERROR; sticky
    word GPU_ERROR_SEQ  GPU -> host: seq of the batch the GPU flagged
    word SINK           scratch the kernel's unused lanes store to
    REQ + 4*i ...       request i: [seq, layer, expert, ram slot] (seq written last, with release)
    DONE + i            done i: the host writes the request's seq once the RAM slot holds its bytes

`request_kernel` is one Triton program, capturable in a CUDA graph: it reads
its request list from device tensors (-1 padded), bumps a device-side sequence
counter, publishes the requests, then spins on the done words with acquire
loads and a deadline from the GPU's global timer. It never waits on a Python
call: only on these memory words. On a timeout or a host error it sets
GPU_ERROR (and the same code in a device-memory flag) and returns; later
launches see the flag and return at once.

The same code runs in Triton's CPU interpreter (ON_GPU=False): plain volatile
loads and stores, and a spin count instead of the timer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

HOST_ERROR, GPU_ERROR, GPU_ERROR_SEQ, SINK = 0, 1, 2, 3
REQ = 8  # first request word (after the control words, one 64-byte line)
WORDS_PER_REQUEST = 4
GPU_TIMED_OUT, GPU_SAW_HOST_ERROR = 1, 2
# the same numbers as constexpr globals, the only globals a Triton kernel may read
_HOST_ERROR, _GPU_ERROR, _GPU_ERROR_SEQ, _SINK, _REQ = (
    tl.constexpr(v) for v in (HOST_ERROR, GPU_ERROR, GPU_ERROR_SEQ, SINK, REQ)
)
_TIMED_OUT, _SAW_HOST_ERROR = tl.constexpr(GPU_TIMED_OUT), tl.constexpr(GPU_SAW_HOST_ERROR)
# seconds one interpreted spin takes at least (measured ~5 ms on 2 shared cores); turns the timeout into a spin limit
INTERPRETER_SPIN_S = 2e-3


def done_base(capacity: int) -> int:
    """Index of done word 0 in a mailbox of `capacity` requests."""
    return REQ + WORDS_PER_REQUEST * capacity


def mailbox_words(capacity: int) -> int:
    return done_base(capacity) + capacity


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _load_acquire(ptrs, ON_GPU: tl.constexpr):
    if ON_GPU:
        # acquire at system scope: sees host stores in order and is never served from a stale cache line
        value = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptrs], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        value = tl.load(ptrs, volatile=True)
    return value


@triton.jit
def _store_release(ptrs, values, ON_GPU: tl.constexpr):
    if ON_GPU:
        # release at system scope: the request's payload words are visible to the host before its seq word
        tl.inline_asm_elementwise(
            "st.release.sys.global.b64 [$1], $2; mov.b32 $0, 0;",
            "=r,l,l",
            [ptrs, values],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptrs, values)


@triton.jit
def _pause(ON_GPU: tl.constexpr):
    if ON_GPU:
        # ~0.25 us between polls keeps PCIe read traffic low; reads take milliseconds
        tl.inline_asm_elementwise("nanosleep.u32 256; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now(like, ON_GPU: tl.constexpr):
    if ON_GPU:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [like], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        now = like
    return now


@triton.jit
def request_kernel(
    box,
    seq_ptr,
    flag_ptr,
    experts_ptr,
    slots_ptr,
    layer,
    n,
    timeout_ns,
    max_spins,
    DONE: tl.constexpr,
    BLOCK: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    zero = offs.to(tl.int64) * 0
    inb = offs < n
    experts = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int64)
    slots = tl.load(slots_ptr + offs, mask=inb, other=-1).to(tl.int64)
    seq = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, seq)

    host_err = tl.max(_load_acquire(box + _HOST_ERROR + zero, ON_GPU), axis=0)
    gpu_err = tl.max(_load_acquire(box + _GPU_ERROR + zero, ON_GPU), axis=0)
    valid = inb & (experts >= 0) & (host_err == 0) & (gpu_err == 0)

    entry = box + _REQ + offs * 4
    sink = box + _SINK + zero
    tl.store(entry + 1, zero + layer, mask=valid)
    tl.store(entry + 2, experts, mask=valid)
    tl.store(entry + 3, slots, mask=valid)
    tl.debug_barrier()
    _store_release(tl.where(valid, entry, sink), zero + seq, ON_GPU)

    done_ptrs = tl.where(valid, box + DONE + offs, sink)
    pending = valid
    npending = tl.sum(pending.to(tl.int32), axis=0)
    start = tl.max(_now(zero, ON_GPU), axis=0)
    spins = npending * 0
    late = npending < 0
    while (npending > 0) & (host_err == 0) & (late == 0):
        _pause(ON_GPU)
        done = _load_acquire(done_ptrs, ON_GPU)
        pending = pending & (done != seq)
        npending = tl.sum(pending.to(tl.int32), axis=0)
        host_err = tl.max(_load_acquire(box + _HOST_ERROR + zero, ON_GPU), axis=0)
        spins += 1
        late = (tl.max(_now(zero, ON_GPU), axis=0) - start > timeout_ns) | (spins > max_spins)

    code = tl.where(host_err != 0, _SAW_HOST_ERROR, tl.where(npending > 0, _TIMED_OUT, 0)).to(tl.int64)
    flag = (gpu_err == 0) & (code != 0)
    first = offs == 0
    tl.store(flag_ptr + zero, zero + code, mask=first & (code != 0))  # device copy, for on-device reactions
    tl.store(box + _GPU_ERROR_SEQ + zero, zero + seq, mask=first & flag)
    tl.debug_barrier()
    _store_release(tl.where(first & flag, box + _GPU_ERROR + zero, sink), zero + code, ON_GPU)


def launch_request(
    box: torch.Tensor,
    seq: torch.Tensor,
    flag: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    layer: int,
    capacity: int,
    timeout_s: float,
) -> None:
    """Enqueue request_kernel on the current stream (capturable): publish experts -> slots, wait, flag errors."""
    n = experts.numel()
    if slots.numel() != n:
        raise ValueError(f"expert ids ({n}) and RAM slot ids ({slots.numel()}) differ in length")
    if n > capacity:
        raise ValueError(f"{n} requests exceed the mailbox's {capacity}; raise max_requests")
    on_gpu = not interpreting()
    max_spins = 2**31 - 1 if on_gpu else max(1, int(timeout_s / INTERPRETER_SPIN_S))
    request_kernel[(1,)](
        box,
        seq,
        flag,
        experts,
        slots,
        layer,
        n,
        int(timeout_s * 1e9),
        max_spins,
        DONE=done_base(capacity),
        BLOCK=max(16, triton.next_power_of_2(n)),
        ON_GPU=on_gpu,
        num_warps=1,
    )
