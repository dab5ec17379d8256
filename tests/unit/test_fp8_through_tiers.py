"""FP8 experts with 128x128 block scales travel through every tier bit for bit.

A real FP8 checkpoint (Qwen's layout) is read from SSD by CheckpointStore, kept in
RAM records and installed into slots by HostPager; what the kernel's slots hold
must be the checkpoint's own FP8 bytes and scales, and dequantize to exactly what
the checkpoint's weights dequantize to."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe.model.tinymoe.fp8 import dequantize_blocks
from bigmoe.model.tinymoe.shape import TinyShape
from bigmoe_pager.adapters.vllm.ssd_source import SsdStores
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.host_pager import HostPager, TierSizes
from bigmoe_pager.core.paging_build import build_paging_file, layout_for_checkpoint
from bigmoe_pager.core.safetensors_index import index_files, shard_paths
from safetensors import safe_open

SHAPES = [
    TinyShape(layers=2, experts=8, top_k=2, hidden=256, moe_intermediate=128, vocab=512),
    TinyShape(layers=1, experts=6, top_k=3, hidden=128, moe_intermediate=256, vocab=512),
]


def checkpoint_expert(model_dir, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """The expert as vLLM fuses it, read with safetensors itself (the reference)."""
    index = index_files(shard_paths(model_dir))
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    out = {}
    for suffix, name in (("weight", "w"), ("weight_scale_inv", "s")):
        parts = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"{prefix}{proj}.{suffix}"
            with safe_open(str(index[key].path), "pt") as f:
                parts[proj] = f.get_tensor(key)
        out[f"w13_{name}"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=0)
        out[f"w2_{name}"] = parts["down_proj"]
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=["256x128", "128x256"])
@pytest.mark.parametrize("vram,ram", [(3, 4), (4, 6)])
@pytest.mark.parametrize("ssd", ["checkpoint", "compressed paging file"])
def test_fp8_slots_hold_the_checkpoint_bytes_and_dequantize_exactly(tiny_checkpoint, tmp_path, shape, vram, ram, ssd):
    model = tiny_checkpoint(shape, "fp8", seed=11, with_tokenizer=False)
    layout = layout_for_checkpoint(model)
    assert layout["w13_weight"].dtype == torch.float8_e4m3fn
    store = CheckpointStore(model, layout)
    if ssd != "checkpoint":
        paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=True)
        raw_records = shape.layers * shape.experts * layout.record_bytes
        assert paging.stat().st_size < 0.95 * raw_records, "the codec must shrink FP8 experts on SSD"
    for layer in range(shape.layers):
        if ssd == "checkpoint":
            source = type("Src", (), {"read_record": lambda self, e, dst, l=layer: store.read(l, e, dst)})()
        else:
            source = SsdStores().paging_file_source(paging, model, layout, layer, shape.experts, compressed=True)
        pager = HostPager(layout, TierSizes(shape.experts, vram, ram), source)
        for e in range(shape.experts):
            r = pager.ram_slot_for_load(e)
            if r is not None:
                store.read(layer, e, pager.ram[r])
                for c in layout.components:
                    pager.mark_loaded(e, c.name)
        slots = layout.slot_buffers(vram, "cpu")

        def install(slot, views):
            for name, t in views.items():
                slots[name][slot].copy_(t)

        rng = random.Random(layer)
        for _ in range(30):
            ids = torch.tensor([rng.sample(range(shape.experts), shape.top_k)])
            for rows in pager.token_chunks(ids):
                remapped = pager.prepare(ids[rows], install)
                for e, s in zip(ids[rows].flatten().tolist(), remapped.flatten().tolist()):
                    ref = checkpoint_expert(model, layer, e)
                    for w in ("w13", "w2"):
                        assert torch.equal(slots[f"{w}_weight"][s].view(torch.uint8), ref[f"{w}_w"].view(torch.uint8))
                        assert torch.equal(slots[f"{w}_weight_scale_inv"][s], ref[f"{w}_s"])
                        assert torch.equal(
                            dequantize_blocks(slots[f"{w}_weight"][s], slots[f"{w}_weight_scale_inv"][s]),
                            dequantize_blocks(ref[f"{w}_w"], ref[f"{w}_s"]),
                        )
        assert pager.stats["ssd"].lookups > 0 or ram == shape.experts
    store.close()
