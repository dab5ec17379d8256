"""DeviceLayerPager: the layer pager the vLLM adapter drives on CUDA, run here on CPU tensors
(the Triton kernels under Triton's interpreter). Loading through record views, decode steps and
host-chunked prefill must leave each (token, k) pair's slot holding exactly its expert."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core.device_layer import DeviceLayerPager, warm_step_sizes
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.pager import PagerError
from bigmoe_pager.core.ssd_mailbox import _block as request_block
from bigmoe_pager.core.stats import PagerStats
from bigmoe_pager.core.step_kernel import MAX_IDS, ids_block
from test_pager import FakeSsdService, make_layout, make_records


def loaded_layer(layout, records, vram, ram, warm=None, skip=None, policy="lru", budget=0):
    """A layer whose RAM records were written the way vLLM's weight loader writes them: component views. budget: its
    prefetch budget (0: a whole proposal a round, what these tests check; the budget has tests of its own)."""
    experts = records.shape[0]
    sizes = TierSizes(experts, vram, ram)
    layer = DeviceLayerPager(
        layout, sizes, "cpu", layer=1, stats=PagerStats(2), warm_order=warm, policy=policy, prefetch_budget=budget
    )
    views = layer.ram_views()
    for e in range(experts):
        row = layer.ram_slot_for_load(e)
        if row is None:
            continue
        parts = layout.views(records[e])
        for c in layout.components:
            if (e, c.name) == skip:
                continue
            views[c.name][row].copy_(parts[c.name])
            layer.mark_loaded(e, c.name)
    return layer


def slot_bytes(layer, slot):
    return torch.cat([layer.buffers[c.name][slot].reshape(-1).view(torch.uint8) for c in layer.layout.components])


def record_bytes(layout, records, expert):
    return torch.cat([records[expert, c.offset : c.offset + c.nbytes] for c in layout.components])


@pytest.mark.parametrize("fp8,policy", [(True, "lfu"), (True, "lru"), (False, "lfu")])
@pytest.mark.parametrize("experts,vram,ram,k", [(16, 6, 16, 2), (16, 4, 8, 4), (12, 3, 3, 3)])
def test_decode_and_chunked_prefill_put_each_pairs_expert_in_its_slot(fp8, policy, experts, vram, ram, k):
    layout = make_layout(fp8)
    records = make_records(layout, experts, seed=experts + vram)
    layer = loaded_layer(layout, records, vram, ram, warm=[5, 2], policy=policy)
    ssd = None if ram == experts else FakeSsdService(records, layer.ram)
    layer.start(layout.slot_buffers(vram, "cpu"), ssd)
    rng = random.Random(vram * 7 + k)
    steps = [1, 1, 2, 9, 1, 30, 1]
    for tokens in steps:
        ids = torch.tensor([rng.sample(range(experts), k) for _ in range(tokens)], dtype=torch.int32)
        ranges = [slice(0, tokens)] if layer.fits(ids) else layer.token_chunks(ids)
        assert sum(r.stop - r.start for r in ranges) == tokens
        for rows in ranges:
            remapped = layer.step(ids[rows])
            assert remapped.dtype == ids.dtype and remapped.shape == ids[rows].shape
            for expert, slot in zip(ids[rows].flatten().tolist(), remapped.flatten().tolist()):
                assert 0 <= slot < vram
                assert torch.equal(slot_bytes(layer, slot), record_bytes(layout, records, expert)), (expert, slot)
    counts = layer.counters()
    assert counts["vram"].lookups >= counts["vram"].hits > 0
    assert counts["ram"].bytes_moved > 0
    if ssd is not None:
        assert counts["ssd"].lookups == ssd.reads > 0 and counts["ssd"].bytes_moved == ssd.reads * layout.record_bytes


def test_start_warms_vram_with_the_hottest_experts_and_a_warm_step_hits():
    layout = make_layout(True)
    records = make_records(layout, 8, seed=1)
    layer = loaded_layer(layout, records, vram=2, ram=4, warm=[6, 3, 1])
    assert {layer.ram_slot_for_load(e) for e in (6, 3, 1)} <= {0, 1, 2, 3} and layer.ram_slot_for_load(0) is not None
    assert layer.ram_slot_for_load(7) is None  # fifth in heat order: stays on SSD
    layer.start(layout.slot_buffers(2, "cpu"), FakeSsdService(records, layer.ram))
    layer.step(torch.tensor([[6, 3]], dtype=torch.int64))
    counts = layer.counters()
    assert (counts["vram"].lookups, counts["vram"].hits, counts["ssd"].lookups) == (2, 2, 0)


def test_a_record_the_checkpoint_did_not_fill_is_refused_at_start():
    layout = make_layout(True)
    records = make_records(layout, 8, seed=2)
    layer = loaded_layer(layout, records, vram=2, ram=8, skip=(3, layout.components[1].name))
    with pytest.raises(PagerError, match="expert 3: the checkpoint did not provide"):
        layer.start(layout.slot_buffers(2, "cpu"))


def test_partial_ram_without_an_ssd_tier_and_steps_before_start_are_refused():
    layout = make_layout(False)
    records = make_records(layout, 8, seed=3)
    layer = loaded_layer(layout, records, vram=2, ram=4)
    with pytest.raises(PagerError, match="step before start"):
        layer.step(torch.tensor([[0, 1]]))
    with pytest.raises(PagerError, match="no SSD tier was attached"):
        layer.start(layout.slot_buffers(2, "cpu"))


@pytest.mark.parametrize("fp8", [True, False])
def test_a_big_step_fills_the_whole_layer_buffer_with_exactly_the_experts_it_needs(fp8):
    layout = make_layout(fp8)
    experts, vram, k = 12, 3, 3
    records = make_records(layout, experts, seed=4)
    layer = loaded_layer(layout, records, vram, experts)
    layer.start(layout.slot_buffers(vram, "cpu"))
    rng = random.Random(2)
    ids = torch.tensor([rng.sample(range(8), k) for _ in range(20)], dtype=torch.int32)  # experts 8-11 unused
    ids[3, 1] = -1  # an invalid id is skipped, as in a slot step
    wide = {name: torch.zeros_like(t) for name, t in layout.slot_buffers(experts, "cpu").items()}
    layer.fill_layer_buffer(ids, wide)
    needed = {int(e) for e in ids.flatten().tolist() if e >= 0}
    for expert in range(experts):
        got = torch.cat([wide[c.name][expert].reshape(-1).view(torch.uint8) for c in layout.components])
        if expert in needed:
            assert torch.equal(got, record_bytes(layout, records, expert)), expert
        else:
            assert not got.any(), expert  # rows of experts the step does not use are not copied
    counts = layer.counters()
    assert counts["ram"].bytes_moved == len(needed) * layout.record_bytes and counts["vram"].lookups == len(needed)


@pytest.mark.parametrize("vram,ram", [(3, 6), (2, 2), (4, 11)])
def test_over_a_partial_ram_tier_the_whole_layer_buffer_reads_each_needed_expert_once(vram, ram):
    layout = make_layout(True)
    experts, k = 12, 3
    records = make_records(layout, experts, seed=5 + vram)
    layer = loaded_layer(layout, records, vram, ram, warm=[0, 9, 4])
    ssd = FakeSsdService(records, layer.ram)
    layer.start(layout.slot_buffers(vram, "cpu"), ssd)
    in_ram_before = {e for e in range(experts) if layer.ram_slot_for_load(e) is not None}
    rng = random.Random(vram + ram)
    ids = torch.tensor([rng.sample(range(10), k) for _ in range(25)], dtype=torch.int32)  # experts 10, 11 unused
    wide = {name: torch.zeros_like(t) for name, t in layout.slot_buffers(experts, "cpu").items()}
    layer.fill_layer_buffer(ids, wide)
    needed = set(ids.flatten().tolist())
    for expert in range(experts):
        got = torch.cat([wide[c.name][expert].reshape(-1).view(torch.uint8) for c in layout.components])
        if expert in needed:
            assert torch.equal(got, record_bytes(layout, records, expert)), expert
        else:
            assert not got.any(), expert
    assert ssd.reads == len(needed - in_ram_before)  # the RAM residents go first: nothing is read twice
    # The slots are left consistent: a decode step after the big one still finds each expert in its slot.
    step = torch.tensor([[1, 5]], dtype=torch.int32)  # fits the smallest slot count here
    for expert, slot in zip(step.flatten().tolist(), layer.step(step).flatten().tolist()):
        assert torch.equal(slot_bytes(layer, slot), record_bytes(layout, records, expert))


@pytest.mark.parametrize("ram", [4, 8])
def test_a_step_outside_a_graph_settles_over_a_partial_ram_tier_only(monkeypatch, ram):
    """With an SSD tier the GPU waits inside a step for reads that host threads answer, and they need
    the GIL; the engine's next call may block on the GPU holding it. So an uncaptured step over a
    partial RAM tier returns only once the GPU is done (waiting with the GIL released)."""
    layout = make_layout(True)
    records = make_records(layout, 8, seed=9)
    layer = loaded_layer(layout, records, vram=2, ram=ram)
    layer.start(layout.slot_buffers(2, "cpu"), None if ram == 8 else FakeSsdService(records, layer.ram))
    waits = []
    monkeypatch.setattr(DeviceLayerPager, "_wait", staticmethod(lambda device: waits.append(device)))
    layer.step(torch.tensor([[1, 6]], dtype=torch.int32))
    assert waits == ([] if ram == 8 else [layer.device])


def test_prefetch_counters_say_what_was_brought_ahead_and_what_came_of_it():
    layout = make_layout(False)
    records = make_records(layout, 8, seed=2)
    layer = loaded_layer(layout, records, vram=4, ram=8, warm=[0, 1, 2, 3])
    layer.start(layout.slot_buffers(4, "cpu"))
    layer.step(torch.tensor([[0, 1]], dtype=torch.int64))
    layer.prefetch(torch.tensor([5, 6], dtype=torch.int64))  # 5 is needed next, 6 is not
    layer.step(torch.tensor([[0, 5]], dtype=torch.int64))
    layer.prefetch(torch.tensor([-1, -1], dtype=torch.int64))  # the next round settles the first one's counts
    vram = layer.counters()["vram"]
    assert (vram.prefetched, vram.prefetch_used) == (2, 1)
    assert vram.prefetch_wasted_bytes == layout.record_bytes
    assert (vram.lookups, vram.hits) == (4, 4)  # the prefetched expert was a hit


def _decisions(layer, steps, predictions) -> list[list[int]]:
    """Each real step's slots, with the prefetch round after it (what the pager decides, given these inputs)."""
    out = []
    for ids, predicted in zip(steps, predictions):
        out.append(layer.step(ids).flatten().tolist())
        layer.prefetch(predicted)
    return out


def _kernel_variant(num_ids: int, vram: int) -> tuple:
    """What a Triton variant of an eager step of num_ids ids depends on (its size arguments are unspecialized): the
    fused kernel's id block, or the unfused path's SSD request block; and whether it streams in token ranges."""
    fused = num_ids <= MAX_IDS
    return (fused, ids_block(num_ids) if fused else request_block(num_ids), num_ids > vram)


@pytest.mark.parametrize("vram", [1, 10, 64, 65, 100, 128, 129, 130, 300, 1024, 4096])
def test_warm_up_sizes_reach_every_kernel_variant_with_few_steps(vram):
    warmed = warm_step_sizes(vram)
    variants = {_kernel_variant(n, vram) for n in warmed}
    missing = [n for n in range(1, vram + 2) if _kernel_variant(n, vram) not in variants]
    assert missing == []
    assert warmed == sorted(set(warmed)) and max(warmed) == max(MAX_IDS, vram) + 1
    assert len(warmed) <= MAX_IDS + 1 + vram.bit_length()  # one size a block past the fused kernel's sizes


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-duel"])
@pytest.mark.parametrize("vram,ram", [(4, 12), (3, 6)])
def test_kernel_warm_up_runs_every_step_size_and_changes_nothing_the_pager_does(policy, vram, ram):
    """Engine warm-up runs a step of every size that has kernel variants of its own, with every id -1: no expert
    moves, no counter counts, and the steps after it decide exactly as a layer that was never warmed."""
    layout = make_layout(True)
    records = make_records(layout, 12, seed=vram + ram)
    layers = []
    for _ in range(2):
        layer = loaded_layer(layout, records, vram, ram, warm=[3, 7, 1], policy=policy)
        layer.start(layout.slot_buffers(vram, "cpu"), None if ram == 12 else FakeSsdService(records, layer.ram))
        layers.append(layer)
    warmed, cold = layers
    held = warmed.pager.vram.slot_expert.clone()

    steps = warmed.warm_kernels((torch.int32, torch.int64), predict_width=2)

    assert steps == 2 * 65 + 16  # sizes 1..step_kernel.MAX_IDS + 1 in each dtype, then 16 prefetch rounds
    assert torch.equal(warmed.pager.vram.slot_expert, held)
    assert warmed.counters() == cold.counters()
    rng = random.Random(vram * 3 + ram)
    sizes = [1, 2, 1, 5, 1, 1, 3, 1]
    steps = [torch.tensor([rng.sample(range(12), 2) for _ in range(n)], dtype=torch.int32) for n in sizes]
    predictions = [torch.tensor(rng.sample(range(12), 2), dtype=torch.int64) for _ in sizes]
    fit = [ids for ids in steps if warmed.fits(ids)]
    assert _decisions(warmed, fit, predictions) == _decisions(cold, fit, predictions)
    assert warmed.counters() == cold.counters()
