"""Make a synthetic Qwen4Exp (Qwen3.8-Flash-Next architecture) checkpoint: random weights, no download.

    python scripts/make_qwen4exp.py OUT --layers 4 --experts 512 --dtype fp8|bf16 --device cuda ...

Every part of the released model gets weights vLLM's Qwen4Exp loader accepts:
hyper-connections, QSA attention with its indexer, gated-delta-net linear attention,
a PLE layer with its n-gram table (160-byte FP8 rows in row shards, far fewer rows than
320M), routed experts plus a shared expert in every layer, and the MTP head. FP8 is
Qwen's 128x128 block layout (`weight_scale_inv`); bf16 is for vLLM's CPU build.

Weights are drawn and written tensor by tensor (a background thread writes while the
next is drawn), so memory stays at one tensor. OUT is written and published as
checkpoint_dir says: never found half-written, a no-op when asked again, made again
when damaged (a listed file missing or of the wrong size), replaced only with --force.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from bigmoe.units import size_text

from . import qwen4exp_tensors as qt
from .checkpoint_dir import (
    DEFAULT_SHARD_BYTES,
    Architecture,
    CheckpointExistsError,
    OneLineParser,
    is_complete,
    make_checkpoint,
    parse_bytes,
    run_cli,
)
from .fp8 import SCALE_DTYPES
from .qwen4exp_shape import Qwen4ExpShape, Qwen4ExpShapeError, hf_config, validate
from .shape import DTYPES

__all__ = ["Qwen4ExpShape", "Qwen4ExpShapeError", "CheckpointExistsError", "make_qwen4exp", "is_complete", "main"]

QWEN4EXP = Architecture(
    format="qwen4exp-1",
    validate=validate,
    error=Qwen4ExpShapeError,
    config=hf_config,
    plan=qt.plan,
    tensors=qt,
    hashes=False,
)
"""Qwen4Exp (Qwen3.8-Flash-Next's architecture), format qwen4exp-1."""


def make_qwen4exp(
    out: Path, shape: Qwen4ExpShape = Qwen4ExpShape(), dtype: str = "fp8", seed: int = 0, device: str = "cpu", **options
) -> Path:
    """Build the Qwen4Exp checkpoint at `out` (or find it there already) and return `out`; `options` are
    make_checkpoint's (shard_bytes, scale_dtype, with_tokenizer, force, log)."""
    return make_checkpoint(QWEN4EXP, out, shape, dtype, seed, device, **options)


# ---- command line ------------------------------------------------------------------------------

_HELP = {
    "layers": "decoder layers, the released 3:1 linear/full pattern scaled down (released 48)",
    "experts": "routed experts per layer",
    "top_k": "experts per token",
    "hidden": "hidden size",
    "moe_intermediate": "routed expert intermediate size",
    "shared_intermediate": "shared expert intermediate size",
    "vocab": "vocabulary rows",
    "ngram_vocab_base": "smallest n-gram head size (16 heads; released 20000000)",
    "ngram_parts": "n-gram table shards (released 128)",
    "mtp_layers": "MTP layers",
}


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="make_qwen4exp.py", description="Make a synthetic Qwen4Exp checkpoint (random weights).")
    p.add_argument("out", type=Path, metavar="OUT", help="checkpoint directory to create")
    default = Qwen4ExpShape()
    for field in fields(Qwen4ExpShape):
        flag = "--" + field.name.replace("_", "-")
        what = _HELP.get(field.name, field.name.replace("_", " "))
        p.add_argument(
            flag,
            type=int,
            default=getattr(default, field.name),
            help=f"{what} (default {getattr(default, field.name)})",
        )
    p.add_argument("--dtype", choices=DTYPES, default="fp8", help="fp8 block-quantized Linears, or bf16 (default fp8)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default="cpu", help="where weights are drawn: cpu or cuda (fast; other bytes than cpu)")
    p.add_argument(
        "--shard-size", type=parse_bytes, default=DEFAULT_SHARD_BYTES, help="largest safetensors shard (default 4GiB)"
    )
    p.add_argument("--scale-dtype", choices=tuple(SCALE_DTYPES), default="float32", help="dtype of weight_scale_inv")
    p.add_argument("--no-tokenizer", action="store_true", help="weights and configs only")
    p.add_argument("--force", action="store_true", help="replace whatever OUT holds")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, _parser(), Qwen4ExpShape, make_qwen4exp, _summary)


def _summary(args, shape: Qwen4ExpShape, size: int) -> str:
    return (
        f"{args.dtype} Qwen4Exp, {shape.layers} layers x {shape.experts} experts (+ shared, "
        f"{shape.mtp_layers} MTP), {size_text(size, 2)}"
    )


if __name__ == "__main__":
    sys.exit(main())
