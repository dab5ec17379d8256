"""Sharded safetensors written tensor by tensor, never holding a whole shard in memory.

The layout of every shard is planned first (names, shapes, dtypes, offsets), so each
file starts with its final header and the tensors follow as they are made. A
background thread writes while the caller computes the next tensor.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from .tensors import Param, Stored

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}
"""safetensors dtype tag of each dtype a checkpoint holds."""
INDEX_NAME = "model.safetensors.index.json"
"""The shard index Hugging Face loaders and vLLM read."""
PENDING_WRITES = 8
"""Tensors queued for the writer thread before the producer waits."""


class ShardWriteError(RuntimeError):
    """A shard did not receive exactly the planned tensors; the message is one line."""


@dataclass
class Shard:
    """One safetensors file: the weights it holds and their stored tensors, in file order."""

    filename: str
    """File name inside the checkpoint directory."""
    params: list[Param] = field(default_factory=list)
    """Weights whose tensors live here (a weight and its scales never straddle two shards)."""
    tensors: list[Stored] = field(default_factory=list)
    """Stored tensors in the order of their bytes."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def assign_shards(groups: list[tuple[Param, list[Stored]]], shard_bytes: int) -> list[Shard]:
    """Fill shards in order, starting a new one when the next weight would pass `shard_bytes`."""
    shards: list[Shard] = []
    for param, tensors in groups:
        size = sum(t.nbytes for t in tensors)
        if not shards or (shards[-1].tensors and shards[-1].nbytes + size > shard_bytes):
            shards.append(Shard(""))
        shards[-1].params.append(param)
        shards[-1].tensors.extend(tensors)
    for number, shard in enumerate(shards, start=1):
        shard.filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
    return shards


def header(tensors: list[Stored]) -> bytes:
    """The length-prefixed JSON header of a shard, padded with spaces to 8-byte alignment."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index(shards: list[Shard]) -> dict:
    """model.safetensors.index.json: total tensor bytes and the shard of every tensor."""
    weight_map = {t.name: shard.filename for shard in shards for t in shard.tensors}
    return {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}


class ShardWriter:
    """Writes one planned shard; `write` takes the tensors in plan order, `close` checks and syncs."""

    def __init__(self, path: Path, shard: Shard):
        self.path = path
        self.expected = deque(shard.tensors)
        self.size = len(header(shard.tensors)) + shard.nbytes
        self.file = open(path, "wb")
        self.file.write(header(shard.tensors))
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: deque[Future] = deque()

    def write(self, spec: Stored, tensor: torch.Tensor) -> None:
        want = self.expected.popleft() if self.expected else None
        if want != spec or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ShardWriteError(
                f"{self.path.name}: got {spec.name} {tuple(tensor.shape)} {tensor.dtype}, planned {want}"
            )
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # reshape: 0-dim scalars too
        self.pending.append(self.pool.submit(self.file.write, raw))
        while len(self.pending) > PENDING_WRITES:
            self.pending.popleft().result()

    def close(self) -> None:
        """Finish the writes, then fail unless every planned byte is on disk."""
        try:
            while self.pending:
                self.pending.popleft().result()
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.pool.shutdown(wait=True)
            self.file.close()
        if self.expected:
            raise ShardWriteError(f"{self.path.name}: {len(self.expected)} planned tensors were never written")
        if self.path.stat().st_size != self.size:
            raise ShardWriteError(f"{self.path.name}: {self.path.stat().st_size} bytes on disk, planned {self.size}")

    def abort(self) -> None:
        """Stop without checks (the build failed; the directory is discarded)."""
        for future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)
        self.file.close()


def write_shards(
    directory: Path,
    shards: list[Shard],
    tensors_of: Callable[[Param], Iterable[tuple[Stored, torch.Tensor]]],
    log: Callable[[str], None],
) -> None:
    """Write every shard into `directory`, each weight's tensors as `tensors_of(weight)` makes them, in plan order
    (on an error the open shard's writer stops; the caller discards the directory). One log line per shard."""
    started = time.monotonic()
    for shard in shards:
        writer = ShardWriter(directory / shard.filename, shard)
        try:
            for param in shard.params:
                for spec, values in tensors_of(param):
                    writer.write(spec, values)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        log(f"{shard.filename}: {shard.nbytes / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s")
