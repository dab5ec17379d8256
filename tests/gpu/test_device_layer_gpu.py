"""DeviceLayerPager on the GPU, as the vLLM adapter drives it: a decode step captured once in a
CUDA graph and replayed with new ids each time must leave every (token, k) pair's slot holding
its expert, over a full RAM tier and over a partial one filled by the real SSD service."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.stats import PagerStats

pytestmark = pytest.mark.gpu


def loaded(layout: ExpertLayout, records: torch.Tensor, vram: int, ram: int, policy: str = "lru") -> DeviceLayerPager:
    layer = DeviceLayerPager(
        layout, TierSizes(records.shape[0], vram, ram), "cuda", layer=0, stats=PagerStats(1, "cuda"), policy=policy
    )
    views = layer.ram_views()
    for e in range(records.shape[0]):
        row = layer.ram_slot_for_load(e)
        if row is not None:
            for name, part in layout.views(records[e]).items():
                views[name][row].copy_(part)
                layer.mark_loaded(e, name)
    return layer


def one_layer_on_disk(tmp_path, experts: int):
    """A one-layer FP8 checkpoint written under tmp_path (skips where O_DIRECT fails there) and its records."""
    import sys
    from pathlib import Path

    from ssd_testkit import make_direct_checkpoint

    ckpt = make_direct_checkpoint(tmp_path, "fp8", num_layers=1, num_experts=experts)
    records = torch.zeros((experts, ckpt.layout.pitch), dtype=torch.uint8)
    for e in range(experts):
        records[e, : ckpt.layout.record_bytes] = ckpt.reference(0, e)
    return ckpt, records


class RecordsSsd:
    """The SSD tier's role played from host memory: the GPU test checks graph replay, not the disk
    (tests/gpu/test_ssd_gpu.py runs the real service against a real file)."""

    def __init__(self, records: torch.Tensor, layer: DeviceLayerPager):
        self.records, self.layer = records, layer

    def fetch(self, experts: torch.Tensor, slots: torch.Tensor) -> None:
        torch.cuda.current_stream().synchronize()
        for e, s in zip(experts.tolist(), slots.tolist()):
            if e >= 0:
                self.layer.ram.records[s].copy_(self.records[e])


@pytest.mark.parametrize(
    "experts,vram,k,tokens,policy",
    [
        (256, 102, 8, 1, "lfu"),
        (256, 32, 8, 4, "lfu"),
        (256, 102, 8, 4, "lru"),
        (64, 16, 4, 2, "lfu"),
        (256, 32, 8, 4, "lfu-duel"),
    ],
)
def test_a_captured_step_replays_with_new_ids(experts, vram, k, tokens, policy):
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    g = torch.Generator().manual_seed(experts + vram)
    records = torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=g) & 0x77
    layer = loaded(layout, records, vram, experts, policy)
    layer.start(layout.slot_buffers(vram, "cuda"))
    ids = torch.zeros((tokens, k), dtype=torch.int32, device="cuda")
    out = torch.empty_like(ids)
    rng = random.Random(vram)
    ids.copy_(torch.tensor([rng.sample(range(experts), k) for _ in range(tokens)]))
    out.copy_(layer.step(ids))  # warm-up outside the graph (Triton compiles here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(layer.step(ids))
    for _ in range(30):
        step_ids = torch.tensor([rng.sample(range(experts), k) for _ in range(tokens)], dtype=torch.int32)
        ids.copy_(step_ids)
        graph.replay()
        torch.cuda.synchronize()
        for expert, slot in zip(step_ids.flatten().tolist(), out.flatten().cpu().tolist()):
            for c in layout.components:
                got = layer.buffers[c.name][slot].reshape(-1).view(torch.uint8).cpu()
                assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes]), (expert, slot, c.name)
    counts = layer.counters()
    assert counts["vram"].lookups > counts["vram"].hits > 0 and counts["ram"].bytes_moved > 0


def test_big_steps_split_into_token_ranges_over_a_partial_ram_tier():
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    experts, vram, ram, k = 64, 8, 24, 4
    records = (
        torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        & 0x77
    )
    layer = loaded(layout, records, vram, ram)
    layer.start(layout.slot_buffers(vram, "cuda"), RecordsSsd(records, layer))
    rng = random.Random(1)
    ids = torch.tensor([rng.sample(range(experts), k) for _ in range(50)], dtype=torch.int32, device="cuda")
    assert not layer.fits(ids)
    for rows in layer.token_chunks(ids):
        slots = layer.step(ids[rows])
        torch.cuda.synchronize()
        for expert, slot in zip(ids[rows].flatten().tolist(), slots.flatten().tolist()):
            got = layer.buffers["w2_weight"][slot].reshape(-1).view(torch.uint8).cpu()
            c = layout["w2_weight"]
            assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes])


def test_the_counter_mirror_copy_is_part_of_the_graph():
    """The exporter reads counters from page-locked host memory that the step's graph fills
    (a CUDA call from the exporter's own thread would invalidate vLLM's capture)."""
    from bigmoe_pager.core.pinned import pinned_empty

    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    records = (
        torch.randint(0, 256, (64, layout.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)) & 0x77
    )
    layer = loaded(layout, records, 16, 64)
    layer.start(layout.slot_buffers(16, "cuda"))
    mirror = pinned_empty(tuple(layer.stats_table.device_counts.shape), torch.int64)
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32, device="cuda")
    layer.step(ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mirror.copy_(layer.stats_table.device_counts, non_blocking=True)
        layer.step(ids)
    rng = random.Random(3)
    for _ in range(5):
        ids.copy_(torch.tensor([rng.sample(range(64), 4)]))
        graph.replay()
    torch.cuda.synchronize()
    before_last_step = mirror.clone()
    ids.copy_(torch.tensor([[5, 6, 7, 8]]))
    graph.replay()
    torch.cuda.synchronize()
    assert (mirror >= before_last_step).all() and int(mirror[0, 0, 0]) > 0  # lookups counted, one step behind
    assert torch.equal(mirror, before_last_step) is False


def test_a_settled_chunked_step_leaves_no_ssd_read_behind_a_gil_holding_wait(tmp_path):
    """After a step outside graphs the engine may block on the GPU while holding the GIL (here the
    driver's context synchronize called through ctypes.PyDLL, which keeps the GIL; in vLLM a launch
    into a full queue or a device-to-host copy). The SSD reads are answered by host threads that
    need the GIL, so every chunk is settled first: no read of the step may be left pending."""
    import ctypes

    from bigmoe_pager.core.ram_tier import ServiceFetch
    from bigmoe_pager.core.ssd_service import SsdService

    experts, vram, ram, k = 64, 8, 16, 4
    ckpt, records = one_layer_on_disk(tmp_path, experts)
    from ssd_testkit import FakeFaultyIO  # on the path once one_layer_on_disk ran

    layout = ckpt.layout
    layer = loaded(layout, records, vram, ram, "lfu")
    slow_disk = FakeFaultyIO(then="slow", delay_s=0.02)  # 20 ms a read: the GPU falls behind the launches
    service = SsdService(
        # 5 s: a pending read fails it as surely as 1 s did, and the H200's early step writes a 32 GB checkpoint
        # beside it (run 8: a read answered after 1.0 s there)
        ckpt.store(io=slow_disk),
        [layer.ram.records],
        io_workers=4,
        read_timeout_s=5.0,
        read_retries=0,
    )
    try:
        layer.start(layout.slot_buffers(vram, "cuda"), ServiceFetch(service, 0))
        rng = random.Random(11)
        ids = torch.tensor([rng.sample(range(experts), k) for _ in range(300)], dtype=torch.int32, device="cuda")
        chunks = layer.token_chunks(ids)
        assert len(chunks) > 50  # enough queued work to outlast a stalled read
        for rows in chunks:
            slots = layer.step(ids[rows])
            layer.settle()
            assert torch.cuda.current_stream().query()  # nothing of the step is left for the host to answer
        driver = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the call keeps the GIL, as a blocking engine call may
        assert driver.cuCtxSynchronize() == 0
        service.check()  # raises if the GPU gave up waiting for a read
        for expert, slot in zip(ids[rows].flatten().tolist(), slots.flatten().tolist()):
            got = layer.buffers["w2_weight"][slot].reshape(-1).view(torch.uint8).cpu()
            c = layout["w2_weight"]
            assert torch.equal(got, records[expert, c.offset : c.offset + c.nbytes])
    finally:
        service.close()


def test_a_big_step_fills_the_whole_layer_buffer_from_pinned_ram():
    layout = ExpertLayout.for_moe(256, 128, torch.float8_e4m3fn, block=128)
    experts, vram, k = 64, 16, 8
    records = (
        torch.randint(0, 256, (experts, layout.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        & 0x77
    )
    layer = loaded(layout, records, vram, experts)
    layer.start(layout.slot_buffers(vram, "cuda"))
    rng = random.Random(4)
    ids = torch.tensor([rng.sample(range(48), k) for _ in range(200)], dtype=torch.int32, device="cuda")
    wide = {name: torch.zeros_like(t) for name, t in layout.slot_buffers(experts, "cuda").items()}
    layer.fill_layer_buffer(ids, wide)
    torch.cuda.synchronize()
    needed = set(ids.flatten().tolist())
    c = layout["w2_weight"]
    for expert in range(experts):
        got = wide["w2_weight"][expert].reshape(-1).view(torch.uint8).cpu()
        want = records[expert, c.offset : c.offset + c.nbytes] if expert in needed else torch.zeros_like(got)
        assert torch.equal(got, want), expert


@pytest.mark.parametrize("vram,ram", [(8, 16), (16, 48)])
def test_a_big_step_fills_the_whole_layer_buffer_through_the_slots_from_a_real_ssd_tier(tmp_path, vram, ram):
    """BIGMOE_PREFILL_BUFFER over a partial RAM tier: the needed experts come from RAM or, read with
    O_DIRECT by the real SSD service from a real checkpoint file, through the VRAM slots; each is read once."""
    from bigmoe_pager.core.ram_tier import ServiceFetch
    from bigmoe_pager.core.ssd_service import SsdService

    experts, k = 64, 8
    ckpt, records = one_layer_on_disk(tmp_path, experts)
    layout = ckpt.layout
    layer = loaded(layout, records, vram, ram, "lfu")
    service = SsdService(ckpt.store(), [layer.ram.records], io_workers=4, read_timeout_s=5.0, read_retries=1)
    try:
        layer.start(layout.slot_buffers(vram, "cuda"), ServiceFetch(service, 0))
        rng = random.Random(vram)
        ids = torch.tensor([rng.sample(range(56), k) for _ in range(300)], dtype=torch.int32, device="cuda")
        wide = {name: torch.zeros_like(t) for name, t in layout.slot_buffers(experts, "cuda").items()}
        layer.fill_layer_buffer(ids, wide)
        torch.cuda.synchronize()
        service.check()
        needed = set(ids.flatten().tolist())
        for expert in range(experts):
            for c in layout.components:
                got = wide[c.name][expert].reshape(-1).view(torch.uint8).cpu()
                want = records[expert, c.offset : c.offset + c.nbytes] if expert in needed else torch.zeros_like(got)
                assert torch.equal(got, want), (expert, c.name)
        assert layer.counters()["ssd"].lookups == len(needed) - ram  # RAM residents first: no expert read twice
    finally:
        service.close()
