"""Make a synthetic Qwen3-MoE checkpoint: random weights, deterministic by seed, no download.

    python scripts/make_tiny_moe.py OUT --layers N --experts E --top-k K --hidden H \
        --moe-intermediate I --dtype fp8|bf16 --seed S [--vocab V] [--device cuda] ...

Two flavours: bf16, and FP8 block-quantized like Qwen's official -FP8 repos
(float8_e4m3fn Linears with 128x128 `weight_scale_inv` scales; embeddings, head,
norms and routers stay bf16). The checkpoint has sharded safetensors with an index,
config.json, generation_config.json and a byte-level BPE tokenizer trained here
with a ChatML chat template.

OUT is written and published as checkpoint_dir says: never found half-written, a no-op
when asked again, made again when damaged (the manifest holds every file's sha256),
and replaced only with --force.

Importable: `make_tiny_moe(out, shape, dtype, seed, device)` with `TinyShape`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import tensors
from .checkpoint_dir import (
    DEFAULT_SHARD_BYTES,
    MANIFEST,
    Architecture,
    CheckpointExistsError,
    DeviceError,
    OneLineParser,
    is_complete,
    make_checkpoint,
    parse_bytes,
    run_cli,
)
from .fp8 import SCALE_DTYPES
from .shape import DTYPES, ShapeError, TinyShape, hf_config, validate

__all__ = [
    "TinyShape",
    "ShapeError",
    "CheckpointExistsError",
    "DeviceError",
    "make_tiny_moe",
    "is_complete",
    "MANIFEST",
    "tensors",
]

QWEN3_MOE = Architecture(
    format=1,
    validate=validate,
    error=ShapeError,
    config=hf_config,
    plan=lambda shape, dtype, config: tensors.plan(shape, dtype),
    tensors=tensors,
    hashes=True,
)
"""Qwen3-MoE, every decoder layer MoE (format 1)."""


def make_tiny_moe(
    out: Path, shape: TinyShape = TinyShape(), dtype: str = "bf16", seed: int = 0, device: str = "cpu", **options
) -> Path:
    """Build the Qwen3-MoE checkpoint at `out` (or find it there already) and return `out`; `options` are
    make_checkpoint's (shard_bytes, scale_dtype, with_tokenizer, force, log)."""
    return make_checkpoint(QWEN3_MOE, out, shape, dtype, seed, device, **options)


def _parser() -> argparse.ArgumentParser:
    d = TinyShape()
    p = OneLineParser(prog="make_tiny_moe.py", description="Make a synthetic Qwen3-MoE checkpoint (random weights).")
    p.add_argument("out", type=Path, metavar="OUT", help="checkpoint directory to create")
    p.add_argument("--layers", type=int, default=d.layers, help=f"decoder layers, all MoE (default {d.layers})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"routed experts per layer (default {d.experts})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"experts per token (default {d.top_k})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden size (default {d.hidden})")
    p.add_argument(
        "--moe-intermediate",
        type=int,
        default=d.moe_intermediate,
        help=f"expert intermediate size (default {d.moe_intermediate})",
    )
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary rows (default {d.vocab})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help=f"key/value heads (default {d.kv_heads})")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head size (default {d.head_dim})")
    p.add_argument(
        "--max-position", type=int, default=d.max_position, help=f"max_position_embeddings (default {d.max_position})"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="bf16", help="bf16, or fp8 block-quantized Linears (default bf16)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where weights are drawn: cpu or cuda (fast for big checkpoints; other bytes than cpu)",
    )
    p.add_argument(
        "--shard-size",
        type=parse_bytes,
        default=DEFAULT_SHARD_BYTES,
        help="largest safetensors shard, e.g. 512MiB (default 4GiB)",
    )
    p.add_argument(
        "--scale-dtype",
        choices=tuple(SCALE_DTYPES),
        default="float32",
        help="dtype of weight_scale_inv (default float32)",
    )
    p.add_argument(
        "--no-tokenizer", action="store_true", help="weights and configs only (where the tokenizers package is missing)"
    )
    p.add_argument("--force", action="store_true", help="replace whatever OUT holds")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, _parser(), TinyShape, make_tiny_moe, _summary)


def _summary(args, shape: TinyShape, size: int) -> str:
    return f"{args.dtype} Qwen3-MoE, {shape.layers} layers x {shape.experts} experts, {size / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
