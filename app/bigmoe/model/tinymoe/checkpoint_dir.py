"""A synthetic checkpoint's directory, whichever architecture fills it: the request it was made for, its files
written in one order with the manifest that marks it complete last, the atomic publish, and the command-line
shell of the scripts that make one.

OUT is built in a hidden directory beside it and renamed into place when complete, so a half-written
checkpoint is never found at OUT. Asking again for the same checkpoint is a no-op; the same one found
damaged (a file missing, cut short or, where the manifest has them, bytes that no longer match its
sha256) is made again; a different one at OUT needs force.
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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from bigmoe_pager.atomic_file import fsync_dir

from . import tokenizer
from .fp8 import SCALE_DTYPES
from .safetensors_io import INDEX_NAME, assign_shards, index, write_shards
from .shape import generation_config

MANIFEST = "tiny_moe.json"
"""Written last: what was asked for and the size (and sha256) of every file, the mark of a complete checkpoint."""
_FILE_KEYS = ("files", "sha256")
"""Manifest keys that describe the files, not the request."""
DEFAULT_SHARD_BYTES = 4 << 30
"""Largest shard the writer fills before starting the next one (bytes)."""

Log = Callable[[str], None]


class CheckpointExistsError(FileExistsError):
    """OUT holds something other than the requested checkpoint; the message is one line."""


class DeviceError(RuntimeError):
    """The requested device cannot generate weights here; the message is one line."""


@dataclass(frozen=True)
class Architecture:
    """What one maker's checkpoints have of their own; everything else (directory, files, manifest) is shared."""

    format: Any
    """The request's "format": bumped whenever the same request would produce different bytes."""
    validate: Callable[[Any, str, str], None]
    """validate(shape, dtype, scale_dtype) raises `error` with one line for a shape it cannot make."""
    error: type[ValueError]
    """The shape error, also raised for a bad seed or shard size."""
    config: Callable[[Any, str, dict], dict]
    """config.json from (shape, dtype, the tokenizer's special token ids)."""
    plan: Callable[[Any, str, dict], list]
    """The weights in file order from (shape, dtype, config)."""
    tensors: ModuleType
    """The module whose stored(weight, scale dtype) and materialize(weight, seed, device, scale dtype) make them."""
    hashes: bool
    """The manifest lists every file's sha256 as well as its size."""


def make_checkpoint(
    arch: Architecture,
    out: Path,
    shape,
    dtype: str,
    seed: int = 0,
    device: str = "cpu",
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    scale_dtype: str = "float32",
    with_tokenizer: bool = True,
    force: bool = False,
    log: Log | None = None,
) -> Path:
    """Build an `arch` checkpoint at `out` (or find it there already) and return `out`.

    Bytes are a function of (shape, dtype, seed, device kind, shard_bytes, scale_dtype, with_tokenizer)."""
    out = Path(out).absolute()
    arch.validate(shape, dtype, scale_dtype)
    torch_dev = torch_device(device)
    request = _request(arch, shape, dtype, seed, torch_dev.type, shard_bytes, scale_dtype, with_tokenizer)
    log = log or (lambda line: None)
    config = arch.config(shape, dtype, tokenizer.special_ids(shape.vocab))
    if occupied(out) and not force:
        if is_complete(out, request, hashes=True):
            return out
        if not made_for(out, request):
            raise CheckpointExistsError(
                f"{out} {difference(out, request)}; delete it, or replace it with --force (force=True)"
            )
        log(f"{out} {difference(out, request)}; making it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.{os.getpid()}.", dir=out.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the published checkpoint is an ordinary directory
    try:
        _write_files(work, arch, request, shape, config, torch_dev, log)
        return publish(work, out, request)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _request(arch: Architecture, shape, dtype, seed, device_kind, shard_bytes, scale_dtype, with_tokenizer) -> dict:
    """What a checkpoint is made for: the manifest records it, and a later request is compared with it."""
    if not isinstance(seed, int) or seed < 0:
        raise arch.error(f"seed must be a non-negative integer, not {seed!r}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise arch.error(f"shard size must be a positive number of bytes, not {shard_bytes!r}")
    return {
        "format": arch.format,
        "shape": asdict(shape),
        "dtype": dtype,
        "seed": seed,
        "device": device_kind,
        "shard_bytes": shard_bytes,
        "scale_dtype": scale_dtype if dtype == "fp8" else None,
        "tokenizer": with_tokenizer,
    }


def torch_device(name: str) -> torch.device:
    """The torch device weights are drawn on; DeviceError when it cannot be used here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not a torch device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is not supported; use cpu or cuda")
    return device


def _write_files(work: Path, arch: Architecture, request: dict, shape, config: dict, device, log: Log) -> None:
    """Write every file of the checkpoint into `work`, the manifest last: the tokenizer (first, so a missing
    `tokenizers` fails before minutes of weight generation), the shards, the index, config.json and
    generation_config.json."""
    if request["tokenizer"]:
        tokenizer.write(work, shape.vocab, request["seed"], shape.max_position)
    scale_dtype = SCALE_DTYPES[request["scale_dtype"] or "float32"]
    weights = arch.plan(shape, request["dtype"], config)
    shards = assign_shards([(w, arch.tensors.stored(w, scale_dtype)) for w in weights], request["shard_bytes"])
    write_shards(work, shards, lambda w: arch.tensors.materialize(w, request["seed"], device, scale_dtype), log)
    write_json(work / INDEX_NAME, index(shards))
    write_json(work / "config.json", config)
    write_json(work / "generation_config.json", generation_config(tokenizer.special_ids(shape.vocab)))
    files = {p.name: p.stat().st_size for p in sorted(work.iterdir())}
    digests = {"sha256": {name: sha256(work / name) for name in files}} if arch.hashes else {}
    write_json(work / MANIFEST, {**request, "files": files, **digests})
    fsync_dir(work)


def is_complete(out: Path, request: dict | None = None, hashes: bool = False) -> bool:
    """True when `out` has a manifest (matching `request` if given) and every file it lists at its size
    (and, with `hashes`, with its sha256 where the manifest has them: about 0.1 s for tiny-moe)."""
    try:
        manifest = json.loads((Path(out) / MANIFEST).read_text())
        files = manifest["files"]
        if request is not None and not made_for(out, request, manifest):
            return False
        if not all((Path(out) / name).stat().st_size == size for name, size in files.items()):
            return False
        digests = manifest.get("sha256") if hashes else None
        return not digests or all(sha256(Path(out) / name) == digest for name, digest in digests.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def made_for(out: Path, request: dict, manifest: dict | None = None) -> bool:
    """Whether the manifest at out says it was made for `request` (whatever state its files are in now)."""
    try:
        manifest = manifest if manifest is not None else json.loads((Path(out) / MANIFEST).read_text())
        return {k: v for k, v in manifest.items() if k not in _FILE_KEYS} == request
    except (OSError, ValueError, AttributeError):
        return False


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def difference(out: Path, request: dict) -> str:
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


def publish(work: Path, out: Path, request: dict) -> Path:
    """Rename the finished `work` to `out`, replacing whatever `out` held."""
    if occupied(out):
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
    fsync_dir(out.parent)
    return out


def occupied(out: Path) -> bool:
    return out.is_symlink() or out.is_file() or (out.is_dir() and any(out.iterdir()))


def remove_stale(out: Path) -> None:
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


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---- command line ------------------------------------------------------------------------------


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


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_cli(
    argv: list[str] | None,
    parser: argparse.ArgumentParser,
    shape_class: type,
    make: Callable[..., Path],
    summary: Callable[[argparse.Namespace, Any, int], str],
) -> int:
    """A maker script: parse `argv` (one flag per field of `shape_class`, plus dtype, seed, device, shard size,
    scale dtype, tokenizer and force), make the checkpoint with `make(out, shape, dtype, seed, device, **options)`,
    print one line `OUT: summary(args, shape, size in bytes), how long it took` and return 0, or one error
    line and return 2."""
    args = parser.parse_args(argv)
    shape = shape_class(**{f.name: getattr(args, f.name) for f in fields(shape_class)})
    started = time.monotonic()
    try:
        existed = is_complete(args.out) and not args.force
        out = make(
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
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    verb = "already complete" if existed else f"written in {time.monotonic() - started:.1f} s"
    print(f"{out}: {summary(args, shape, size)}, {verb}")
    return 0
