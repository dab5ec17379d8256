"""The SSD tier on a real GPU: requests from a captured CUDA graph, answered by host workers over pinned memory.

Run on the H200: PYTHONPATH=pager:app python -m pytest tests/gpu/test_ssd_gpu.py -m gpu -q
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)


from bigmoe_pager.core import ssd_mailbox as mb  # noqa: E402
from bigmoe_pager.core.copy_kernel import copy_records  # noqa: E402
from bigmoe_pager.core.ssd_service import SsdError, SsdService  # noqa: E402
from ssd_testkit import FakeFaultyIO, make_direct_checkpoint  # noqa: E402

LAYERS, EXPERTS, RAM_SLOTS, K = 2, 16, 8, 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_direct_checkpoint(root, "fp8", num_layers=LAYERS, num_experts=EXPERTS)


@pytest.fixture(scope="module")
def refs(ckpt):
    return {(l, e): ckpt.reference(l, e) for l in range(LAYERS) for e in range(EXPERTS)}


@pytest.fixture(scope="module")
def compressed_path(ckpt, tmp_path_factory):
    return ckpt.compressed_paging_file(tmp_path_factory.mktemp("pfc") / "experts.bmpf")


def _service(ckpt, io=None, store=None, **kw):
    store = store or ckpt.store(io=io, retries=1)
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8, pin_memory=True) for _ in range(LAYERS)]
    kw.setdefault("read_timeout_s", 5.0)
    return SsdService(store, bufs, io_workers=4, max_requests=16, **kw), bufs


class Step:
    """Device-side request lists for every layer, rewritten in place between graph replays."""

    def __init__(self):
        self.experts = [torch.full((K,), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
        self.slots = [torch.full((K,), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]

    def set(self, gen: torch.Generator) -> list[list[tuple[int, int]]]:
        plan = []
        for layer in range(LAYERS):
            n = int(torch.randint(0, K + 1, (1,), generator=gen))
            ex = torch.randperm(EXPERTS, generator=gen)[:n]
            sl = torch.randperm(RAM_SLOTS, generator=gen)[:n]
            pad = torch.full((K - n,), -1, dtype=torch.int64)
            self.experts[layer].copy_(torch.cat([ex, pad]))
            self.slots[layer].copy_(torch.cat([sl, pad]))
            plan.append(list(zip(ex.tolist(), sl.tolist())))
        return plan


def _run(svc, step, ckpt, bufs, vram):
    for layer in range(LAYERS):
        svc.request(layer, step.experts[layer], step.slots[layer])
        # the RAM tier's copy kernel moves the fresh rows on to VRAM slot = RAM slot
        copy_records(bufs[layer], step.slots[layer], step.slots[layer], ckpt.layout, vram[layer])


@pytest.mark.parametrize("source", ["checkpoint", "compressed paging file"])
@pytest.mark.parametrize("reader", ["native", "python"])
def test_graph_replay_with_changing_ids_fills_ram_and_vram_slots_exactly(ckpt, refs, reader, source, compressed_path):
    """Captured requests replayed 60 times with new ids, answered by the native reader's C threads or the Python
    ones (which alone expand a compressed paging file's records): every RAM and VRAM slot holds its expert's bytes."""
    store = ckpt.decoded_store(compressed_path) if source != "checkpoint" else None
    svc, bufs = _service(ckpt, store=store, reader=reader)
    assert svc.native == (reader == "native" and store is None)
    vram = [ckpt.layout.slot_buffers(RAM_SLOTS, "cuda") for _ in range(LAYERS)]
    step, gen = Step(), torch.Generator().manual_seed(0)
    with svc:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # warm up (compiles the kernels) outside the graph
            step.set(gen)
            _run(svc, step, ckpt, bufs, vram)
        torch.cuda.synchronize()
        svc.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _run(svc, step, ckpt, bufs, vram)
        for replay in range(60):
            plan = step.set(gen)
            graph.replay()
            torch.cuda.synchronize()  # releases the GIL: the host workers answer while we wait
            svc.check()
            for layer, pairs in enumerate(plan):
                for e, s in pairs:
                    want = refs[(layer, e)]
                    assert torch.equal(bufs[layer][s, : ckpt.layout.record_bytes], want), ("ram", replay, layer, e, s)
                    got = torch.cat(
                        [vram[layer][c.name][s].reshape(-1).view(torch.uint8).cpu() for c in ckpt.layout.components]
                    )
                    flat = torch.cat([want[c.offset : c.offset + c.nbytes] for c in ckpt.layout.components])
                    assert torch.equal(got, flat), ("vram", replay, layer, e, s)
        reads = sum(c["reads"] for c in svc.stats()["layers"])
        assert reads > 60 and int(svc.box[mb.GPU_ERROR]) == 0 == int(svc.error_flag[0])


def test_injected_read_failure_is_flagged_without_hang(ckpt):
    io = FakeFaultyIO(("ok",) * 4, then="eio")
    svc, _ = _service(ckpt, io=io)
    step = Step()
    with svc:
        ex = torch.tensor([0, 1, -1, -1, -1, -1], device="cuda")
        sl = torch.tensor([0, 1, -1, -1, -1, -1], device="cuda")
        svc.request(0, ex, sl)  # two good reads, and a compiled kernel before capture
        torch.cuda.synchronize()
        svc.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            svc.request(0, step.experts[0], step.slots[0])
        step.experts[0].copy_(torch.tensor([5, 6, 7, -1, -1, -1]))
        step.slots[0].copy_(torch.tensor([2, 3, 4, -1, -1, -1]))
        t0 = time.monotonic()
        graph.replay()
        torch.cuda.synchronize()
        assert time.monotonic() - t0 < 5.0  # the host error ends the wait, not the GPU's deadline
        assert int(svc.box[mb.GPU_ERROR]) == mb.GPU_SAW_HOST_ERROR == int(svc.error_flag[0])
        with pytest.raises(SsdError, match=r"layer 0 expert [567] into RAM slot [234] failed: ReadError.*EIO"):
            svc.check()
        t0 = time.monotonic()
        graph.replay()  # a failed tier answers at once from now on
        torch.cuda.synchronize()
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(SsdError):
            svc.check()


def test_gpu_deadline_when_host_never_answers(ckpt):
    svc, _ = _service(ckpt, io=FakeFaultyIO(then="slow", delay_s=2.0), wait_timeout_s=0.2)
    with svc:
        ex = torch.tensor([-1, -1], device="cuda")
        sl = torch.tensor([-1, -1], device="cuda")
        svc.request(1, ex, sl)  # nothing to read: compiles this specialization outside the timed part
        torch.cuda.synchronize()
        ex[0], sl[0] = 3, 1
        t0 = time.monotonic()
        svc.request(1, ex, sl)
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        assert 0.15 < waited < 1.5, waited
        assert int(svc.box[mb.GPU_ERROR]) == mb.GPU_TIMED_OUT == int(svc.error_flag[0])
        with pytest.raises(SsdError, match="the GPU waited 0.2 s"):
            svc.check()


def test_host_driven_load_into_pinned_slots(ckpt, refs):
    svc, bufs = _service(ckpt)
    with svc:
        svc.load(1, [9, 2, 15], [7, 0, 3])
        for e, s in [(9, 7), (2, 0), (15, 3)]:
            assert torch.equal(bufs[1][s, : ckpt.layout.record_bytes], refs[(1, e)])
