"""What the pager's host side lets go of while a CUDA graph is being captured must leave the capture whole.

vLLM captures its decode graphs in CUDA's default (global) capture mode, in which an unsafe call from any
thread (unregistering page-locked memory, syncing or destroying a stream) voids the capture. Garbage collection
runs whenever Python allocates, so a dead pager's buffers or host copier can go mid-capture.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from bigmoe_pager.core import pinned
from bigmoe_pager.core.host_copier import HostCopier
from bigmoe_pager.core.pinned import pinned_empty

pytestmark = pytest.mark.gpu

BLOCK = 1 << 20  # bytes


def captured(work) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph adding 1 twice to a zeroed vector, with `work()` run on the host between the two adds."""
    y = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.add_(1)
        work()
        y.add_(1)
    return g, y


def replays_right(g: torch.cuda.CUDAGraph, y: torch.Tensor) -> bool:
    g.replay()
    torch.cuda.synchronize()
    return bool((y == 2).all())


@pytest.mark.parametrize("blocks", [1, 3])
def test_pinned_blocks_collected_inside_a_capture_are_unregistered_after_it(blocks):
    pinned_empty((1,))  # drains what earlier tests left
    doomed: dict = {"views": [pinned_empty((BLOCK,)) for _ in range(blocks)]}
    doomed["self"] = doomed  # a cycle: only the collector frees it, as it frees a dead pager
    del doomed
    seen: list[int] = []
    g, y = captured(lambda: (gc.collect(), seen.append(pinned.waiting_bytes())))
    assert replays_right(g, y)
    assert seen[0] >= blocks * BLOCK  # still registered while the capture ran
    pinned_empty((1,))  # the next allocation outside a capture unregisters them
    assert pinned.waiting_bytes() == 0


def test_a_pinned_block_let_go_on_another_thread_mid_capture_is_unregistered_at_once():
    pinned_empty((1,))
    holder = [pinned_empty((BLOCK,))]

    def let_go() -> None:
        thread = threading.Thread(target=holder.clear)  # the last view goes on a thread that is not capturing
        thread.start()
        thread.join()

    g, y = captured(let_go)
    assert replays_right(g, y)
    assert holder == [] and pinned.waiting_bytes() == 0


def test_a_host_copier_closed_inside_a_capture_leaves_the_capture_whole():
    copier = HostCopier(torch.device("cuda"))
    g, y = captured(copier.close)  # its thread syncs and destroys its stream while the graph is captured
    assert replays_right(g, y)


def test_a_torch_pinned_tensor_collected_inside_a_capture_leaves_the_capture_whole():
    """torch's own pinned allocator (the host copier's mailboxes and ring use it) freeing a block mid-capture."""
    doomed: dict = {"t": torch.zeros(BLOCK, dtype=torch.uint8, pin_memory=True)}
    doomed["self"] = doomed
    del doomed
    g, y = captured(gc.collect)
    assert replays_right(g, y)
