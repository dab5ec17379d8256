"""Page-locked blocks whose last tensor goes during a CUDA graph capture are unregistered only after it.

CI has no GPU, so CUDA's runtime is a stand-in here (`StandInCuda`: it records registrations and says whether
a capture is under way); tests/gpu/test_capture_safety_gpu.py runs the same paths against the real driver.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from bigmoe_pager.core import pinned
from bigmoe_pager.core.pinned import pinned_empty

NOT_REGISTERED = pinned.NOT_REGISTERED


class StandInCuda:
    """CUDA's runtime as pinned.py uses it: registrations by address, and a capture flag per thread."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.capturing: set[int] = set()  # thread ids inside a capture
        self.refuse_unregister = False
        self.voided = False  # an unregister made inside a capture (what voids a real one)

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if threading.get_ident() in self.capturing:
            self.voided = True
        if self.refuse_unregister:
            return 1  # cudaErrorInvalidValue: the block must stay registered and allocated
        return 0 if self.registered.pop(ptr, None) is not None else NOT_REGISTERED

    def is_capturing(self) -> bool:
        return threading.get_ident() in self.capturing


@pytest.fixture
def cuda(monkeypatch):
    fake = StandInCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", fake.is_capturing)
    monkeypatch.setattr(pinned, "_UNPIN", pinned._Unpinner())  # nothing left over from other tests
    yield fake
    gc.collect()


def collected_inside_a_capture(cuda: StandInCuda, blocks: int) -> int:
    """Drop `blocks` pinned tensors held in a cycle and collect them while this thread captures; the bytes left
    waiting at the capture's end."""
    cycle: dict = {"views": [pinned_empty((4096,)) for _ in range(blocks)]}
    cycle["self"] = cycle
    del cycle
    cuda.capturing.add(threading.get_ident())
    try:
        gc.collect()
        return pinned.waiting_bytes()
    finally:
        cuda.capturing.discard(threading.get_ident())


@pytest.mark.parametrize("blocks", [1, 3])
def test_blocks_collected_in_a_capture_wait_for_the_next_allocation(cuda, blocks):
    waiting = collected_inside_a_capture(cuda, blocks)
    assert waiting >= blocks * 4096 and len(cuda.registered) == blocks and not cuda.voided
    kept = pinned_empty((1,))  # the next allocation, outside the capture, unregisters them
    assert pinned.waiting_bytes() == 0 and list(cuda.registered) == [kept.data_ptr()]


def test_a_block_let_go_outside_a_capture_is_unregistered_at_once(cuda):
    t = pinned_empty((4096,))
    assert len(cuda.registered) == 1
    del t
    assert cuda.registered == {} and pinned.waiting_bytes() == 0


def test_a_block_let_go_on_another_thread_during_a_capture_is_unregistered_there(cuda):
    holder = [pinned_empty((4096,))]
    cuda.capturing.add(threading.get_ident())  # this thread captures; the other does not
    try:
        thread = threading.Thread(target=holder.clear)
        thread.start()
        thread.join()
    finally:
        cuda.capturing.discard(threading.get_ident())
    assert cuda.registered == {} and not cuda.voided


def test_a_block_cuda_will_not_unregister_stays_allocated_until_it_will(cuda):
    t = pinned_empty((4096,))
    cuda.refuse_unregister = True
    del t
    assert pinned.waiting_bytes() >= 4096 and len(cuda.registered) == 1  # never freed while still mapped
    cuda.refuse_unregister = False
    kept = pinned_empty((1,))
    assert pinned.waiting_bytes() == 0 and list(cuda.registered) == [kept.data_ptr()]  # only the new block
