"""make_tiny_moe --device cuda: same layout as CPU builds, deterministic, and fast at real expert shapes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import make_tiny_moe as tiny  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.gpu

# Qwen3.6-35B-A3B's routed experts (256 of 2048 -> 512, top-8) in two layers: 1.5 GiB of FP8.
QWEN36_SLICE = tiny.TinyShape(
    layers=2, experts=256, top_k=8, hidden=2048, moe_intermediate=512, vocab=8192, heads=32, kv_heads=4, head_dim=128
)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(path / shard, framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}
    return out


def test_cuda_build_is_deterministic_and_its_fp8_dequantizes_to_its_bf16(tmp_path):
    shape = tiny.TinyShape()
    first = tiny.make_tiny_moe(tmp_path / "a", shape, "fp8", 0, device="cuda", with_tokenizer=False)
    second = tiny.make_tiny_moe(tmp_path / "b", shape, "fp8", 0, device="cuda", with_tokenizer=False)
    source = tiny.make_tiny_moe(tmp_path / "c", shape, "bf16", 0, device="cuda", with_tokenizer=False)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == {p.name: p.read_bytes() for p in second.iterdir()}
    fp8, bf16 = tensors(first), tensors(source)
    for name, weight in fp8.items():
        if weight.dtype != torch.float8_e4m3fn:
            continue
        scale = fp8[name.replace(".weight", ".weight_scale_inv")]
        per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        exact = bf16[name].float()
        err = (weight.float() * per_element - exact).abs()
        assert bool((err <= exact.abs() / 16 + per_element * 2.0**-9).all()), name
        rows, cols = weight.shape
        block_max = weight.float().abs().reshape(rows // 128, 128, cols // 128, 128).amax(3).amax(1)
        assert bool((block_max == 448.0).all()), name


def test_cuda_build_writes_real_expert_shapes_fast(tmp_path):
    started = time.monotonic()
    out = tiny.make_tiny_moe(
        tmp_path / "q36", QWEN36_SLICE, "fp8", 0, device="cuda", with_tokenizer=False, shard_bytes=512 << 20
    )
    seconds = time.monotonic() - started
    size = sum(p.stat().st_size for p in out.iterdir())
    rate = size / seconds / 2**20
    print(f"\n{size / 2**30:.2f} GiB in {seconds:.1f} s: {rate:.0f} MiB/s")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    name = "model.layers.1.mlp.experts.255.down_proj"
    with safe_open(out / index["weight_map"][f"{name}.weight"], framework="pt") as f:
        assert f.get_slice(f"{name}.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice(f"{name}.weight").get_shape() == [2048, 512]
        assert f.get_slice(f"{name}.weight_scale_inv").get_shape() == [16, 4]
    # Qwen3.6-35B-A3B's 40 layers (about 32 GiB) then take under 2 minutes.
    assert rate > 300, f"{rate:.0f} MiB/s"
