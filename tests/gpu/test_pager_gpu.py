"""The expert pager on a real GPU: kernels against their references, CUDA-graph replay, copy bandwidth."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_bench import moe_ref
from bigmoe_bench.moe_decode import ExpertWeights, moe_combine, moe_decode, moe_pairs
from bigmoe_bench.streaming import chunk_count, stream_pairs
from bigmoe_pager.core.copy_kernel import copy_records, copy_records_torch
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.pinned import pinned_empty
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.slots import SlotTable
from bigmoe_pager.core.stats import PagerStats

pytestmark = pytest.mark.gpu

QWEN36 = dict(hidden=2048, intermediate=512)  # Qwen3.6-35B-A3B expert shapes


def fp8_layout(hidden: int = 256, intermediate: int = 128) -> ExpertLayout:
    return ExpertLayout.for_moe(hidden, intermediate, torch.float8_e4m3fn, block=128)


def random_records(layout: ExpertLayout, n: int, seed: int) -> torch.Tensor:
    """Pinned records with random FP8 weights (no NaN bytes) and scales in [0.01, 0.02)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rec = torch.randint(0, 256, (n, layout.pitch), dtype=torch.uint8, device="cuda", generator=g) & 0xF7
    w = ExpertWeights.from_records(rec, layout, 128)
    for s in (w.w13_scale, w.w2_scale):
        s.copy_(torch.rand(s.shape, device="cuda", generator=g) * 0.01 + 0.01)
    host = pinned_empty((n, layout.pitch))
    host.copy_(rec)
    return host


def slot_bytes(buffers: dict[str, torch.Tensor], layout: ExpertLayout) -> torch.Tensor:
    """uint8 [S, record_bytes-ish]: every component's bytes of each slot, laid out as in a record."""
    s = next(iter(buffers.values())).shape[0]
    out = torch.zeros((s, layout.record_bytes), dtype=torch.uint8, device="cuda")
    for c in layout.components:
        out[:, c.offset : c.offset + c.nbytes] = buffers[c.name].reshape(s, -1).view(torch.uint8)
    return out


def record_bytes(records: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The same view of records, with inter-component padding zeroed."""
    out = torch.zeros((records.shape[0], layout.record_bytes), dtype=torch.uint8)
    for c in layout.components:
        out[:, c.offset : c.offset + c.nbytes] = records[:, c.offset : c.offset + c.nbytes]
    return out.cuda()


def test_pinned_buffers_are_locked_and_readable_by_kernels():
    layout = fp8_layout()
    host = random_records(layout, 4, seed=0)
    assert host.is_pinned() and host.data_ptr() % 4096 == 0
    slots = layout.slot_buffers(2, "cuda")
    copy_records(host, torch.tensor([3, 1], device="cuda"), torch.tensor([0, 1], device="cuda"), layout, slots)
    torch.cuda.synchronize()
    assert torch.equal(slot_bytes(slots, layout).cpu(), record_bytes(host, layout).cpu()[[3, 1]])


@pytest.mark.parametrize("name", ["fp8-qwen36", "odd-bytes"])
@pytest.mark.parametrize("programs", [0, 16, 1], ids=["program-per-block", "prefetch-16", "one-program"])
def test_copy_kernel_equals_torch(name, programs):
    layout = (
        fp8_layout(**QWEN36)
        if name == "fp8-qwen36"
        else ExpertLayout.build([("a", (3, 5), torch.uint8), ("b", (7,), torch.int16), ("c", (2,), torch.float32)])
    )
    records = pinned_empty((9, layout.pitch))
    records.copy_(torch.randint(0, 256, records.shape, dtype=torch.uint8))
    src = torch.tensor([8, -1, 0, 4, 2, 7])
    dst = torch.tensor([1, 3, -1, 0, 5, 2])
    want = layout.slot_buffers(6, "cpu")
    got = layout.slot_buffers(6, "cuda")
    for b in list(want.values()) + list(got.values()):
        b.view(b.shape[0], -1).view(torch.uint8).fill_(0x5A)
    copy_records_torch(records, src, dst, layout, want)
    copy_records(records, src.cuda(), dst.cuda(), layout, got, programs_per_record=programs)
    for k in want:
        assert torch.equal(want[k].view(6, -1).view(torch.uint8), got[k].cpu().view(6, -1).view(torch.uint8)), k


@pytest.mark.parametrize(
    "experts,slots,tokens,k", [(256, 32, 1, 8), (512, 205, 1, 10), (64, 16, 4, 4), (300, 40, 8, 8)]
)
def test_acquire_kernel_equals_torch_on_gpu(experts, slots, tokens, k):
    rng = random.Random(experts)
    ker = SlotTable(experts, slots, "cuda", use_kernel=True)
    ref = SlotTable(experts, slots, "cuda", use_kernel=False)
    hot = rng.sample(range(experts), experts // 8)
    for _ in range(300):
        rows = [rng.sample(hot if rng.random() < 0.7 else range(experts), k) for _ in range(tokens)]
        ids = torch.tensor(rows, dtype=torch.int32, device="cuda")
        if rng.random() < 0.05:
            ids[0, 0] = -1
        a, b = ref.acquire(ids), ker.acquire(ids)
        for f in ("remapped", "miss_experts", "miss_slots", "evicted", "hits", "misses", "loaded", "overflow"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("expert_slot", "slot_expert", "last_use", "step"):
        assert torch.equal(getattr(ref, f), getattr(ker, f)), f


@pytest.mark.parametrize("from_records", [False, True])
def test_moe_kernel_matches_reference(from_records):
    layout = fp8_layout(**QWEN36)
    host = random_records(layout, 6, seed=1)
    dev = host.cuda()
    experts = ExpertWeights.from_records(host if from_records else dev, layout, 128)
    ref = ExpertWeights.from_records(dev, layout, 128)
    ref_bufs = {
        "w13_weight": ref.w13,
        "w2_weight": ref.w2,
        "w13_weight_scale_inv": ref.w13_scale,
        "w2_weight_scale_inv": ref.w2_scale,
    }
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn((3, 2048), device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 5, -1, 2], [1, 1, 3, 4], [5, 4, 3, 2]], device="cuda")
    w = torch.rand((3, 4), device="cuda", generator=g)
    got = moe_decode(x, ids, w, experts)
    want = moe_ref.moe(x, ids, w, ref_bufs, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("fused", [True, False])
def test_graph_replay_leaves_exact_bytes_in_every_slot(fused):
    """acquire + copy captured once (one fused launch, or two), replayed 200 steps
    with new ids written into the captured input."""
    layout = fp8_layout()
    experts, slots, k = 64, 12, 4
    host = random_records(layout, experts, seed=3)
    expected = record_bytes(host, layout)
    ram = RamTier(layout, experts, experts, "cuda")
    ram.load_all(host)
    stats = PagerStats(1, "cuda")
    pager = ExpertPager(layout, experts, slots, ram, device="cuda", stats=stats, fused=fused)
    shadow = SlotTable(experts, slots, "cpu")  # the torch decision on CPU, step by step
    static_ids = torch.zeros((2, k), dtype=torch.int32, device="cuda")
    rng = random.Random(5)
    hot = rng.sample(range(experts), 16)
    totals = {"lookups": 0, "hits": 0}

    def step_ids() -> torch.Tensor:
        ids = torch.tensor(
            [rng.sample(hot if rng.random() < 0.6 else range(experts), k) for _ in range(2)], dtype=torch.int32
        )
        want = shadow.acquire(ids)
        totals["lookups"] += int(want.lookups)
        totals["hits"] += int(want.hits)
        return ids

    for _ in range(3):  # compile outside the capture
        static_ids.copy_(step_ids())
        pager.prepare(static_ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        remapped = pager.prepare(static_ids)
    for _ in range(200):
        ids = step_ids()
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pager.vram.slot_expert.cpu(), shadow.slot_expert)
        held = pager.vram.slot_expert
        assert torch.equal(held[remapped.long()].cpu(), ids.long())
        full = held >= 0
        assert torch.equal(slot_bytes(pager.buffers, layout)[full], expected[held[full]])
    snap = stats.snapshot()["vram"]
    assert (snap.lookups, snap.hits) == (totals["lookups"], totals["hits"])
    assert snap.bytes == snap.misses * layout.record_bytes and 0 < snap.hits < snap.lookups


@pytest.mark.parametrize("work", [0, 5])
def test_streamed_prefill_is_bit_identical_on_gpu(work):
    """A 64-token step needing ~all 64 experts through 12 slots equals the all-resident run, bit for bit."""
    layout = fp8_layout()
    experts = 64
    host = random_records(layout, experts, seed=7)
    ram = RamTier(layout, experts, experts, "cuda")
    ram.load_all(host)
    pager = ExpertPager(layout, experts, 12, ram, device="cuda", work_slots=work)
    g = torch.Generator(device="cuda").manual_seed(8)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:6] for _ in range(64)])
    ids[3, 2] = -1
    x = torch.randn((64, 256), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand((64, 6), device="cuda", generator=g)
    everything = ExpertWeights.from_records(host.cuda(), layout, 128)
    want = moe_decode(x, ids, w, everything)
    slots = ExpertWeights.from_slots(pager.buffers, 128)
    pairs = stream_pairs(pager, ids, lambda remapped: moe_pairs(x, remapped, slots))
    assert chunk_count(pager, ids) > 1
    assert torch.equal(moe_combine(pairs, w), want)


def test_copy_bandwidth_from_pinned_ram():
    """The UVA copy kernel at Qwen3.6 expert size; the H200 reaches ~50 GB/s over PCIe with enough in flight."""
    layout = fp8_layout(**QWEN36)
    n = 96
    host = pinned_empty((n, layout.pitch))
    host.zero_()
    slots = layout.slot_buffers(n, "cuda")
    for m in (8, 96):
        src = torch.arange(m, device="cuda")
        copy_records(host, src, src, layout, slots)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            copy_records(host, src, src, layout, slots)
        b.record()
        b.synchronize()
        gbps = 5 * m * layout.record_bytes / (a.elapsed_time(b) * 1e-3) / 1e9
        print(f"copy kernel, {m} experts of {layout.record_bytes / 2**20:.2f} MiB: {gbps:.1f} GB/s")
        assert gbps > 10, f"{gbps:.1f} GB/s: the copy kernel is far below PCIe speed"
