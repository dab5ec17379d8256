"""Synthetic MoE expert checkpoints for SSD-tier tests and benchmarks.

Writes safetensors shards holding only expert tensors, named as Qwen3-MoE names
them (model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.{weight,weight_scale_inv}),
with random bytes: bf16 experts, or FP8 E4M3 experts with float32 128x128 block
scales; FP8 weights may instead follow a trained model's Student-t law (law=), which
the codec compresses as it would real experts. `reference_record` rebuilds the record
an SSD read must return, through the safetensors package's own loader (an independent
path from the pager's).

    PYTHONPATH=pager:bench python scripts/synth_experts.py DIR --hidden 2048 --intermediate 512 --layers 2 --experts 64
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch
from bigmoe_pager.core.expert_store import DEFAULT_PREFIX
from bigmoe_pager.core.layout import ExpertLayout
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = 128  # FP8 block-quantization tile, elements per side


def make_layout(hidden: int, intermediate: int, fp8: bool) -> ExpertLayout:
    """The vLLM-fused layout of one expert of these shapes."""
    if fp8:
        return ExpertLayout.for_moe(hidden, intermediate, torch.float8_e4m3fn, block=BLOCK)
    return ExpertLayout.for_moe(hidden, intermediate, torch.bfloat16)


LAWS = ("bytes", "student_t", "mixed")
"""FP8 weights: every bit pattern (NaNs included), Student-t weights quantized like a trained model's, or the
two by turns (even experts Student-t, odd ones bytes)."""


def expert_tensors(
    hidden: int, intermediate: int, fp8: bool, gen: torch.Generator, trained: bool = False
) -> dict[str, torch.Tensor]:
    """Random tensors of one expert, keyed by checkpoint suffix (gate_proj.weight, ...); trained: FP8 weights
    follow the Student-t law instead of being random bytes."""
    wdtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shapes = {
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }
    out = {}
    for proj, shape in shapes.items():
        out[f"{proj}.weight"] = _trained(shape, gen) if fp8 and trained else _random(shape, wdtype, gen)
        if fp8:
            blocks = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            out[f"{proj}.weight_scale_inv"] = torch.rand(blocks, generator=gen, dtype=torch.float32) + 0.5
    return out


def write_checkpoint(
    root: str | Path,
    hidden: int,
    intermediate: int,
    num_layers: int,
    num_experts: int,
    *,
    fp8: bool = True,
    shards: int = 2,
    seed: int = 0,
    first_layer: int = 0,
    prefix: str = DEFAULT_PREFIX,
    law: str = "bytes",
) -> list[Path]:
    """Write experts of MoE layers first_layer.. into `shards` safetensors files under root; returns their paths.
    law: one of LAWS (FP8 weights only)."""
    if law not in LAWS:
        raise ValueError(f"unknown weight law {law!r}; known: {', '.join(LAWS)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    layers = range(first_layer, first_layer + num_layers)
    keys = [(layer, expert) for layer in layers for expert in range(num_experts)]
    per_shard = -(-len(keys) // shards)
    paths = []
    for s in range(shards):
        tensors = {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)} if s == 0 else {}
        for layer, expert in keys[s * per_shard : (s + 1) * per_shard]:
            head = prefix.format(layer=layer, expert=expert)
            trained = law == "student_t" or (law == "mixed" and expert % 2 == 0)
            for suffix, t in expert_tensors(hidden, intermediate, fp8, gen, trained).items():
                tensors[head + suffix] = t
        path = root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths


def reference_record(
    root: str | Path, layout: ExpertLayout, model_layer: int, expert: int, prefix: str = DEFAULT_PREFIX
) -> torch.Tensor:
    """The record (uint8 [pitch]) for one expert, built with safetensors' own loader and layout.pack."""
    head = prefix.format(layer=model_layer, expert=expert)
    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(head):
                    found[name[len(head) :]] = f.get_tensor(name)
    parts = {
        "w13_weight": torch.cat([found["gate_proj.weight"], found["up_proj.weight"]]),
        "w2_weight": found["down_proj.weight"],
    }
    if "gate_proj.weight_scale_inv" in found:
        parts["w13_weight_scale_inv"] = torch.cat(
            [found["gate_proj.weight_scale_inv"], found["up_proj.weight_scale_inv"]]
        )
        parts["w2_weight_scale_inv"] = found["down_proj.weight_scale_inv"]
    return layout.pack(parts)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as dtype (every bit pattern, NaNs included: the pager copies bytes, never values)."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def _trained(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """FP8 E4M3 weights drawn byte by byte from a trained model's law (codec_samples' Student-t), seeded from gen."""
    picks = torch.randint(0, QUANTILES, shape, generator=gen)
    return _trained_quantiles()[picks].view(torch.float8_e4m3fn)


QUANTILES = 1 << 16


@functools.lru_cache(maxsize=1)
def _trained_quantiles() -> torch.Tensor:
    """The FP8 bytes at QUANTILES evenly spaced ranks of a sample of Student-t weights (uint8): an index drawn
    uniformly draws a byte as often as the law makes it, a thousand times faster than drawing the weights."""
    from .codec_samples import pattern_bytes

    sample = np.sort(pattern_bytes("student_t", 1 << 22, np.random.default_rng(0)))
    return torch.from_numpy(sample[np.linspace(0, sample.size - 1, QUANTILES).astype(np.int64)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--bf16", action="store_true", help="bf16 experts instead of FP8 with block scales")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    paths = write_checkpoint(
        a.root, a.hidden, a.intermediate, a.layers, a.experts, fp8=not a.bf16, shards=a.shards, seed=a.seed
    )
    print(f"wrote {len(paths)} shards, {sum(q.stat().st_size for q in paths) / 1e9:.2f} GB, under {a.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
