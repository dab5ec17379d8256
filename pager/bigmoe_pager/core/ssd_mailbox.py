"""The pinned mailbox through which the GPU asks host I/O workers for experts.

The mailbox is one pinned int64 tensor both sides address directly:

    word HOST_ERROR     host -> GPU: seq of the first batch that failed for good (0 = healthy); sticky
    word GPU_ERROR      GPU -> host: 1 = the GPU gave up waiting, 2 = it saw HOST_ERROR; sticky
    word GPU_ERROR_SEQ  GPU -> host: seq of the batch the GPU flagged
    word SINK           scratch the kernel's unused lanes store to
    REQ + 4*i ...       request i: [seq, layer, expert, ram slot] (seq written last, with release)
    DONE + i            done i: the host writes the request's seq once the RAM slot holds its bytes
    HURRY + i           hurry i (posted entries only): GPU -> host, the seq of entry i's posted read a step now
                        waits for; the host takes that read before the reads ahead queued ahead of it

Entries 0 .. capacity-1 belong to `request_kernel` (a blocking request uses entries 0..n-1). A mailbox
built for read-ahead has one more entry per RAM slot of every layer after them (layer l's slot r at
capacity + base[l] + r): `post_kernel` publishes there and returns at once; the device tensor
`posted` [R] of the layer keeps, per RAM slot, the seq of its read still unconfirmed (0 = none).
`request_kernel` given the RAM rows a step reads waits for their posted reads (never re-requests
them; it writes their seqs into their hurry words, so reads posted for later layers never hold up the one a
step waits for) and clears their `posted`; `settle_kernel` clears the entries whose reads are done, without
waiting. One entry per slot: a slot has at most one posted read (admission never takes a slot with
a posted read; the host supersedes an older read of a slot by a newer request for it).

`request_kernel` is one Triton program, capturable in a CUDA graph: it reads
its request list from device tensors (-1 padded), bumps a device-side sequence
counter, publishes the requests, then spins on the done words (its own, and those
of the posted reads of the rows the step reads) with acquire
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
from bigmoe_pager.core.memory_order import SYS_SCOPE, load_acquire, pause, store_release

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


def hurry_base(capacity: int) -> int:
    """Index of hurry word 0 in a mailbox of `capacity` requests."""
    return done_base(capacity) + capacity


def mailbox_words(capacity: int) -> int:
    return hurry_base(capacity) + capacity


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _now(like, ON_GPU: tl.constexpr):
    if ON_GPU:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [like], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        now = like
    return now


@triton.jit(do_not_specialize=("layer", "n", "nrows", "post_entry0"))
def request_kernel(
    box,
    seq_ptr,
    flag_ptr,
    experts_ptr,
    slots_ptr,
    rows_ptr,
    posted_ptr,
    layer,
    n,
    nrows,
    post_entry0,
    timeout_ns,
    max_spins,
    DONE: tl.constexpr,
    HURRY: tl.constexpr,
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

    host_err = tl.max(load_acquire(box + _HOST_ERROR + zero, SYS_SCOPE, ON_GPU), axis=0)
    gpu_err = tl.max(load_acquire(box + _GPU_ERROR + zero, SYS_SCOPE, ON_GPU), axis=0)
    valid = inb & (experts >= 0) & (host_err == 0) & (gpu_err == 0)

    entry = box + _REQ + offs * 4
    sink = box + _SINK + zero
    tl.store(entry + 1, zero + layer, mask=valid)
    tl.store(entry + 2, experts, mask=valid)
    tl.store(entry + 3, slots, mask=valid)
    tl.debug_barrier()
    store_release(tl.where(valid, entry, sink), zero + seq, SYS_SCOPE, ON_GPU)

    # rows the step reads whose bytes a posted (read-ahead) read still brings: wait for those reads too
    rows = tl.load(rows_ptr + offs, mask=offs < nrows, other=-1).to(tl.int64)
    has_row = (offs < nrows) & (rows >= 0)
    ahead = tl.load(posted_ptr + rows, mask=has_row, other=0)
    waits = has_row & (ahead != 0) & (host_err == 0) & (gpu_err == 0)
    ahead_ptrs = tl.where(waits, box + DONE + post_entry0 + rows, sink)
    store_release(tl.where(waits, box + HURRY + post_entry0 + rows, sink), ahead, SYS_SCOPE, ON_GPU)

    done_ptrs = tl.where(valid, box + DONE + offs, sink)
    pending = valid
    behind = waits
    npending = tl.sum(pending.to(tl.int32), axis=0) + tl.sum(behind.to(tl.int32), axis=0)
    start = tl.max(_now(zero, ON_GPU), axis=0)
    spins = npending * 0
    late = npending < 0
    while (npending > 0) & (host_err == 0) & (late == 0):
        pause(ON_GPU)
        done = load_acquire(done_ptrs, SYS_SCOPE, ON_GPU)
        pending = pending & (done != seq)
        behind = behind & (load_acquire(ahead_ptrs, SYS_SCOPE, ON_GPU) != ahead)
        npending = tl.sum(pending.to(tl.int32), axis=0) + tl.sum(behind.to(tl.int32), axis=0)
        host_err = tl.max(load_acquire(box + _HOST_ERROR + zero, SYS_SCOPE, ON_GPU), axis=0)
        spins += 1
        late = (tl.max(_now(zero, ON_GPU), axis=0) - start > timeout_ns) | (spins > max_spins)
    tl.store(posted_ptr + rows, zero, mask=waits & (behind.to(tl.int32) == 0))  # confirmed: later steps need not wait

    code = tl.where(host_err != 0, _SAW_HOST_ERROR, tl.where(npending > 0, _TIMED_OUT, 0)).to(tl.int64)
    flag = (gpu_err == 0) & (code != 0)
    first = offs == 0
    tl.store(flag_ptr + zero, zero + code, mask=first & (code != 0))  # device copy, for on-device reactions
    tl.store(box + _GPU_ERROR_SEQ + zero, zero + seq, mask=first & flag)
    tl.debug_barrier()
    store_release(tl.where(first & flag, box + _GPU_ERROR + zero, sink), zero + code, SYS_SCOPE, ON_GPU)


@triton.jit(do_not_specialize=("layer", "entry0"))
def post_kernel(
    box, post_seq_ptr, posted_ptr, experts_ptr, slots_ptr, layer, n, entry0, BLOCK: tl.constexpr, ON_GPU: tl.constexpr
):
    """Publish reads of experts into RAM slots at the slots' own entries and return (no wait)."""
    offs = tl.arange(0, BLOCK)
    zero = offs.to(tl.int64) * 0
    inb = offs < n
    experts = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int64)
    slots = tl.load(slots_ptr + offs, mask=inb, other=-1).to(tl.int64)
    seq = tl.load(post_seq_ptr) + 1  # the layer's own counter: its posts are ordered on one stream
    tl.store(post_seq_ptr, seq)
    host_err = tl.max(load_acquire(box + _HOST_ERROR + zero, SYS_SCOPE, ON_GPU), axis=0)
    gpu_err = tl.max(load_acquire(box + _GPU_ERROR + zero, SYS_SCOPE, ON_GPU), axis=0)
    valid = inb & (experts >= 0) & (slots >= 0) & (host_err == 0) & (gpu_err == 0)
    entry = box + _REQ + (entry0 + slots) * 4
    sink = box + _SINK + zero
    tl.store(entry + 1, zero + layer, mask=valid)
    tl.store(entry + 2, experts, mask=valid)
    tl.store(entry + 3, slots, mask=valid)
    tl.debug_barrier()
    store_release(tl.where(valid, entry, sink), zero + seq, SYS_SCOPE, ON_GPU)
    tl.store(posted_ptr + slots, zero + seq, mask=valid)


@triton.jit
def settle_kernel(box, posted_ptr, n, done0, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    """Clear the `posted` entries of RAM slots whose posted reads are done (no wait)."""
    offs = tl.arange(0, BLOCK)
    zero = offs.to(tl.int64) * 0
    inb = offs < n
    ahead = tl.load(posted_ptr + offs, mask=inb, other=0)
    waiting = inb & (ahead != 0)
    done = load_acquire(tl.where(waiting, box + done0 + offs, box + _SINK + zero), SYS_SCOPE, ON_GPU)
    tl.store(posted_ptr + offs, zero, mask=waiting & (done == ahead))


def launch_request(
    box: torch.Tensor,
    seq: torch.Tensor,
    flag: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    layer: int,
    capacity: int,
    timeout_s: float,
    *,
    entries: int | None = None,
    wait_rows: torch.Tensor | None = None,
    posted: torch.Tensor | None = None,
    post_entry0: int = 0,
) -> None:
    """Enqueue request_kernel on the current stream (capturable): publish experts -> slots, wait, flag errors.

    entries: the mailbox's entry count (capacity plus its read-ahead entries). wait_rows, posted: the
    RAM rows the step reads and the layer's `posted` seqs; the kernel also waits for those rows'
    posted reads (entries post_entry0 + row).
    """
    n = experts.numel()
    if slots.numel() != n:
        raise ValueError(f"expert ids ({n}) and RAM slot ids ({slots.numel()}) differ in length")
    if n > capacity:
        raise ValueError(f"{n} requests exceed the mailbox's {capacity}; raise max_requests")
    rows = slots if wait_rows is None else wait_rows
    nrows = 0 if wait_rows is None else rows.numel()
    on_gpu = not interpreting()
    max_spins = 2**31 - 1 if on_gpu else max(1, int(timeout_s / INTERPRETER_SPIN_S))
    words = capacity if entries is None else entries
    request_kernel[(1,)](
        box,
        seq,
        flag,
        experts,
        slots,
        rows,
        seq if posted is None else posted,
        layer,
        n,
        nrows,
        post_entry0,
        int(timeout_s * 1e9),
        max_spins,
        DONE=done_base(words),
        HURRY=hurry_base(words),
        BLOCK=_block(max(n, nrows)),
        ON_GPU=on_gpu,
        num_warps=1,
    )


def launch_post(
    box: torch.Tensor,
    post_seq: torch.Tensor,
    posted: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    layer: int,
    entry0: int,
) -> None:
    """Enqueue post_kernel (capturable): publish experts -> RAM slots at entries entry0 + slot; no wait."""
    n = experts.numel()
    if slots.numel() != n:
        raise ValueError(f"expert ids ({n}) and RAM slot ids ({slots.numel()}) differ in length")
    post_kernel[(1,)](
        box, post_seq, posted, experts, slots, layer, n, entry0, BLOCK=_block(n), ON_GPU=not interpreting(), num_warps=1
    )


def launch_settle(box: torch.Tensor, posted: torch.Tensor, slots: int, done0: int) -> None:
    """Enqueue settle_kernel (capturable): clear posted[r] (r < slots) whose read's done word holds its seq."""
    settle_kernel[(1,)](box, posted, slots, done0, BLOCK=_block(slots), ON_GPU=not interpreting(), num_warps=1)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))
