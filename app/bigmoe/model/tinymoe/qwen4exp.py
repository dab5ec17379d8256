"""Make a synthetic Qwen4Exp (Qwen3.8-Flash-Next architecture) checkpoint: random weights, no download.

    python scripts/make_qwen4exp.py OUT --layers 4 --experts 512 --dtype fp8|bf16 --device cuda ...

Every part of the released model gets weights vLLM's Qwen4Exp loader accepts:
hyper-connections, QSA attention with its indexer, gated-delta-net linear attention,
a PLE layer with its n-gram table (160-byte FP8 rows in row shards, far fewer rows than
320M), routed experts plus a shared expert in every layer, and the MTP head. FP8 is
Qwen's 128x128 block layout (`weight_scale_inv`); bf16 is for vLLM's CPU build.

Weights are drawn and written tensor by tensor (a background thread writes while the
next is drawn), so memory stays at one tensor; OUT appears only when complete, and
asking again for the same checkpoint is a no-op (the Qwen3-MoE maker's machinery).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

from bigmoe.units import size_text

from . import qwen4exp_tensors as qt
from . import tokenizer
from .fp8 import SCALE_DTYPES
from .make import (
    DEFAULT_SHARD_BYTES,
    MANIFEST,
    CheckpointExistsError,
    _device,
    _difference,
    _fsync_dir,
    _occupied,
    _OneLineParser,
    _publish,
    _remove_stale,
    _write_json,
    is_complete,
    parse_bytes,
)
from .qwen4exp_shape import DTYPES, Qwen4ExpShape, Qwen4ExpShapeError, hf_config, validate
from .safetensors_io import INDEX_NAME, ShardWriter, assign_shards, index

__all__ = ["Qwen4ExpShape", "Qwen4ExpShapeError", "CheckpointExistsError", "make_qwen4exp", "is_complete", "main"]

FORMAT = "qwen4exp-1"
"""Bumped whenever the same request would produce different bytes."""


def make_qwen4exp(
    out: Path,
    shape: Qwen4ExpShape = Qwen4ExpShape(),
    dtype: str = "fp8",
    seed: int = 0,
    device: str = "cpu",
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    scale_dtype: str = "float32",
    with_tokenizer: bool = True,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build the checkpoint at `out` (or find it there already) and return `out`."""
    out = Path(out).absolute()
    validate(shape, dtype, scale_dtype)
    torch_device = _device(device)
    request = _request(shape, dtype, seed, torch_device.type, shard_bytes, scale_dtype, with_tokenizer)
    if _occupied(out) and not force:
        if is_complete(out, request):
            return out
        raise CheckpointExistsError(f"{out} {_difference(out, request)}; pass --force (force=True) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.{os.getpid()}.", dir=out.parent))
    work.chmod(0o755)
    try:
        _build(work, request, shape, torch_device, log or (lambda line: None))
        return _publish(work, out, request)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _request(shape, dtype, seed, device_kind, shard_bytes, scale_dtype, with_tokenizer) -> dict:
    if not isinstance(seed, int) or seed < 0:
        raise Qwen4ExpShapeError(f"seed must be a non-negative integer, not {seed!r}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise Qwen4ExpShapeError(f"shard size must be a positive number of bytes, not {shard_bytes!r}")
    return {
        "format": FORMAT,
        "shape": asdict(shape),
        "dtype": dtype,
        "seed": seed,
        "device": device_kind,
        "shard_bytes": shard_bytes,
        "scale_dtype": scale_dtype if dtype == "fp8" else None,
        "tokenizer": with_tokenizer,
    }


def _build(work: Path, request: dict, shape: Qwen4ExpShape, device, log: Callable[[str], None]) -> None:
    """Write every file of the checkpoint into `work`, the manifest last."""
    started = time.monotonic()
    if request["tokenizer"]:
        tokenizer.write(work, shape.vocab, request["seed"], shape.max_position)
    config = hf_config(shape, request["dtype"], tokenizer.special_ids(shape.vocab))
    scale_dtype = SCALE_DTYPES[request["scale_dtype"] or "float32"]
    weights = qt.plan(shape, request["dtype"], config)
    shards = assign_shards([(w, qt.stored(w, scale_dtype)) for w in weights], request["shard_bytes"])
    for shard in shards:
        writer = ShardWriter(work / shard.filename, shard)
        try:
            for weight in shard.params:
                for spec, values in qt.materialize(weight, request["seed"], device, scale_dtype):
                    writer.write(spec, values)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        log(f"{shard.filename}: {shard.nbytes / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s")
    _write_json(work / INDEX_NAME, index(shards))
    _write_json(work / "config.json", config)
    _write_json(work / "generation_config.json", _generation_config(config))
    files = {p.name: p.stat().st_size for p in sorted(work.iterdir())}
    _write_json(work / MANIFEST, {**request, "files": files})
    _fsync_dir(work)


def _generation_config(config: dict) -> dict:
    text = config["text_config"]
    return {
        "bos_token_id": text["bos_token_id"],
        "do_sample": False,
        "eos_token_id": [text["eos_token_id"], text["bos_token_id"]],
        "pad_token_id": text["bos_token_id"],
    }


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
    p = _OneLineParser(prog="make_qwen4exp.py", description="Make a synthetic Qwen4Exp checkpoint (random weights).")
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
    args = _parser().parse_args(argv)
    shape = Qwen4ExpShape(**{f.name: getattr(args, f.name) for f in fields(Qwen4ExpShape)})
    started = time.monotonic()
    try:
        existed = is_complete(args.out) and not args.force
        out = make_qwen4exp(
            args.out,
            shape,
            args.dtype,
            args.seed,
            args.device,
            shard_bytes=args.shard_size,
            scale_dtype=args.scale_dtype,
            with_tokenizer=not args.no_tokenizer,
            force=args.force,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"make_qwen4exp.py: error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    verb = "already complete" if existed else f"written in {time.monotonic() - started:.1f} s"
    print(
        f"{out}: {args.dtype} Qwen4Exp, {shape.layers} layers x {shape.experts} experts (+ shared, "
        f"{shape.mtp_layers} MTP), {size_text(size, 2)}, {verb}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
