"""Make a synthetic Qwen3-MoE checkpoint: random weights, deterministic by seed, no download.

    python scripts/make_tiny_moe.py OUT --layers N --experts E --top-k K --hidden H \
        --moe-intermediate I --dtype fp8|bf16 --seed S [--vocab V] [--device cuda] ...

Two flavours: bf16, and FP8 block-quantized like Qwen's official -FP8 repos
(float8_e4m3fn Linears with 128x128 `weight_scale_inv` scales; embeddings, head,
norms and routers stay bf16). The checkpoint has sharded safetensors with an index,
config.json, generation_config.json and a byte-level BPE tokenizer trained here
with a ChatML chat template.

OUT is built in a hidden directory beside it and renamed into place when complete,
so a half-written checkpoint is never found at OUT. Asking again for the same
checkpoint is a no-op; the same one found damaged (a file missing, cut short or
with bytes that no longer match the manifest's sha256) is made again; a different
one at OUT needs --force.

Importable: `make_tiny_moe(out, shape, dtype, seed, device)` with `TinyShape`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from . import tensors, tokenizer
from .fp8 import SCALE_DTYPES
from .safetensors_io import INDEX_NAME, ShardWriter, assign_shards, index
from .shape import DTYPES, ShapeError, TinyShape, generation_config, hf_config, validate

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

MANIFEST = "tiny_moe.json"
"""Written last: what was asked for and the size and sha256 of every file, the mark of a complete checkpoint."""
_FILE_KEYS = ("files", "sha256")
"""Manifest keys that describe the files, not the request."""
FORMAT_VERSION = 1
"""Bumped whenever the same request would produce different bytes."""
DEFAULT_SHARD_BYTES = 4 << 30
"""Largest shard the writer fills before starting the next one (bytes)."""


class CheckpointExistsError(FileExistsError):
    """OUT holds something other than the requested checkpoint; the message is one line."""


class DeviceError(RuntimeError):
    """The requested device cannot generate weights here; the message is one line."""


def make_tiny_moe(
    out: Path,
    shape: TinyShape = TinyShape(),
    dtype: str = "bf16",
    seed: int = 0,
    device: str = "cpu",
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    scale_dtype: str = "float32",
    with_tokenizer: bool = True,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build the checkpoint at `out` (or find it there already) and return `out`.

    Bytes are a function of (shape, dtype, seed, device kind, shard_bytes, scale_dtype).
    """
    out = Path(out).absolute()
    validate(shape, dtype, scale_dtype)
    torch_device = _device(device)
    request = _request(shape, dtype, seed, torch_device.type, shard_bytes, scale_dtype, with_tokenizer)
    if _occupied(out) and not force:
        if is_complete(out, request, hashes=True):
            return out
        if not _made_for(out, request):
            raise CheckpointExistsError(
                f"{out} {_difference(out, request)}; delete it, or replace it with --force (force=True)"
            )
        (log or (lambda line: None))(f"{out} {_difference(out, request)}; making it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.{os.getpid()}.", dir=out.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the published checkpoint is an ordinary directory
    try:
        _build(work, request, shape, torch_device, log or (lambda line: None))
        return _publish(work, out, request)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def is_complete(out: Path, request: dict | None = None, hashes: bool = False) -> bool:
    """True when `out` has a manifest (matching `request` if given) and every file it lists at its size
    (and, with `hashes`, with its sha256: about 0.1 s for tiny-moe)."""
    try:
        manifest = json.loads((Path(out) / MANIFEST).read_text())
        files = manifest["files"]
        if request is not None and not _made_for(out, request, manifest):
            return False
        if not all((Path(out) / name).stat().st_size == size for name, size in files.items()):
            return False
        digests = manifest.get("sha256") if hashes else None
        return not digests or all(_sha256(Path(out) / name) == digest for name, digest in digests.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _made_for(out: Path, request: dict, manifest: dict | None = None) -> bool:
    """Whether the manifest at out says it was made for `request` (whatever state its files are in now)."""
    try:
        manifest = manifest if manifest is not None else json.loads((Path(out) / MANIFEST).read_text())
        return {k: v for k, v in manifest.items() if k not in _FILE_KEYS} == request
    except (OSError, ValueError, AttributeError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _difference(out: Path, request: dict) -> str:
    """Why `out` is not the requested checkpoint, as a phrase."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"exists but has no readable {MANIFEST} (not a complete checkpoint from this script)"
    if not isinstance(manifest, dict):
        return f"has a malformed {MANIFEST}"
    keys = [k for k in request if manifest.get(k) != request[k]]
    if keys:
        return (
            "holds a different checkpoint ("
            + ", ".join(f"{k} {manifest.get(k)!r} != {request[k]!r}" for k in keys)
            + ")"
        )
    return "is incomplete or damaged (a listed file is missing, has the wrong size or different bytes)"


def _request(shape, dtype, seed, device_kind, shard_bytes, scale_dtype, with_tokenizer) -> dict:
    if not isinstance(seed, int) or seed < 0:
        raise ShapeError(f"seed must be a non-negative integer, not {seed!r}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ShapeError(f"shard size must be a positive number of bytes, not {shard_bytes!r}")
    return {
        "format": FORMAT_VERSION,
        "shape": asdict(shape),
        "dtype": dtype,
        "seed": seed,
        "device": device_kind,
        "shard_bytes": shard_bytes,
        "scale_dtype": scale_dtype if dtype == "fp8" else None,
        "tokenizer": with_tokenizer,
    }


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not a torch device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is not supported; use cpu or cuda")
    return device


def _build(work: Path, request: dict, shape: TinyShape, device: torch.device, log: Callable[[str], None]) -> None:
    """Write every file of the checkpoint into `work`, the manifest last."""
    started = time.monotonic()
    max_length = shape.max_position
    if request["tokenizer"]:
        # First, so a missing `tokenizers` fails before minutes of weight generation.
        tokenizer.write(work, shape.vocab, request["seed"], max_length)
    special = tokenizer.special_ids(shape.vocab)
    scale_dtype = SCALE_DTYPES[request["scale_dtype"] or "float32"]
    params = tensors.plan(shape, request["dtype"])
    shards = assign_shards([(p, tensors.stored(p, scale_dtype)) for p in params], request["shard_bytes"])
    for shard in shards:
        writer = ShardWriter(work / shard.filename, shard)
        try:
            for param in shard.params:
                for spec, values in tensors.materialize(param, request["seed"], device, scale_dtype):
                    writer.write(spec, values)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        log(f"{shard.filename}: {shard.nbytes / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s")
    _write_json(work / INDEX_NAME, index(shards))
    _write_json(work / "config.json", hf_config(shape, request["dtype"], special))
    _write_json(work / "generation_config.json", generation_config(special))
    files = {p.name: p.stat().st_size for p in sorted(work.iterdir())}
    _write_json(work / MANIFEST, {**request, "files": files, "sha256": {name: _sha256(work / name) for name in files}})
    _fsync_dir(work)


def _publish(work: Path, out: Path, request: dict) -> Path:
    """Rename the finished `work` to `out`, replacing whatever `out` held."""
    if _occupied(out):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.{os.getpid()}.", dir=out.parent))
        os.rename(out, old / "checkpoint")
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(work, out)
    except OSError:
        # Another process published the same OUT between our check and our rename.
        if is_complete(out, request):
            shutil.rmtree(work, ignore_errors=True)
            return out
        raise
    _fsync_dir(out.parent)
    return out


def _occupied(out: Path) -> bool:
    return out.is_symlink() or out.is_file() or (out.is_dir() and any(out.iterdir()))


def _remove_stale(out: Path) -> None:
    """Delete leftovers of builds of `out` whose process is gone (killed before it could clean up)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|old)\.(\d+)\.")
    for entry in out.parent.iterdir():
        match = pattern.match(entry.name)
        if match and not _alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_bytes(text: str) -> int:
    """Bytes from '512MiB', '4GiB', '1e9' or a plain integer."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512MiB, 4GiB or 1000000")
    try:
        value = int(float(match.group(1)) * units[match.group(2).lower()])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512MiB, 4GiB or 1000000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    d = TinyShape()
    p = _OneLineParser(prog="make_tiny_moe.py", description="Make a synthetic Qwen3-MoE checkpoint (random weights).")
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
    args = _parser().parse_args(argv)
    shape = TinyShape(
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        moe_intermediate=args.moe_intermediate,
        vocab=args.vocab,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position=args.max_position,
    )
    started = time.monotonic()
    try:
        existed = is_complete(args.out) and not args.force
        out = make_tiny_moe(
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
        print(f"make_tiny_moe.py: error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    verb = "already complete" if existed else f"written in {time.monotonic() - started:.1f} s"
    print(
        f"{out}: {args.dtype} Qwen3-MoE, {shape.layers} layers x {shape.experts} experts, "
        f"{size / 2**20:.1f} MiB, {verb}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
