"""What a paging file is bound to, and how one is built from a checkpoint.

The app's prepare step builds the file; the plugin opens it with the same
`checkpoint_meta`, so a file made for another model, layout or codec is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.odirect import aligned_empty, as_byte_array
from bigmoe_pager.core.paging_file import PagingFileMeta, write_paging_file
from bigmoe_pager.core.safetensors_index import CheckpointError


def checkpoint_fingerprint(model_dir: Path) -> str:
    """Identity of a checkpoint's contents: its config and every shard's safetensors header."""
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for shard in sorted(model_dir.glob("*.safetensors")):
        with open(shard, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            digest.update(shard.name.encode() + f.read(size))
    return digest.hexdigest()[:32]


def layout_for_checkpoint(model_dir: Path) -> ExpertLayout:
    """The record layout vLLM's paged layer will use for this checkpoint's experts."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, inter = int(text["hidden_size"]), int(text["moe_intermediate_size"])
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        block = int(quant["weight_block_size"][0])
        return ExpertLayout.for_moe(hidden, inter, torch.float8_e4m3fn, block)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    ]
    return ExpertLayout.for_moe(hidden, inter, dtype)


def compressed_pitch(layout: ExpertLayout) -> int:
    """Bytes a compressed record may take: the codec's worst case (raw plus its header), block aligned."""
    from bigmoe_pager.codec import max_record_bytes

    return -(-max_record_bytes(layout) // 4096) * 4096


def checkpoint_meta(
    model_dir: Path, layout: ExpertLayout, num_layers: int, num_experts: int, codec: str = "raw", codec_version: int = 0
) -> PagingFileMeta:
    return PagingFileMeta(
        model_id=str(model_dir.resolve().name),
        revision=checkpoint_fingerprint(model_dir),
        layout_signature=layout.signature(),
        num_layers=num_layers,
        num_experts=num_experts,
        codec=codec,
        codec_version=codec_version,
    )


ENCODE_IN_PROCESS_BYTES = 256 << 20
"""Raw expert bytes under which a paging file is encoded in this process: spawning workers costs seconds."""


def build_paging_file(
    model_dir: Path,
    out: Path,
    compress: bool,
    progress: Callable[[int, int], None] = lambda done, total: None,
    workers: int | None = None,
) -> Path:
    """Write every expert of the checkpoint into a paging file at `out` (atomically). Compressed records are encoded
    on `workers` processes (default: every CPU, or this process alone under ENCODE_IN_PROCESS_BYTES)."""
    layout = layout_for_checkpoint(model_dir)
    store = CheckpointStore(model_dir, layout)
    total = store.num_layers * store.num_experts
    source, codec, version, pitch = store, "raw", 0, None
    if compress:
        from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION

        codec, version, pitch = CODEC_NAME, CODEC_VERSION, compressed_pitch(layout)
        if workers is None:
            workers = 1 if total * layout.record_bytes < ENCODE_IN_PROCESS_BYTES else os.cpu_count() or 1
        source = EncodedStore(store, workers)
    meta = checkpoint_meta(model_dir, layout, store.num_layers, store.num_experts, codec, version)
    try:
        return write_paging_file(out, meta, _Counting(source, progress, total), pitch=pitch)
    finally:
        source.close()  # an EncodedStore stops its workers (a failed build's too), then closes the checkpoint


class EncodedStore:
    """`store`'s records, compressed: encoded on `workers` processes a few records ahead of the reads, which must come
    in key order (layer by layer, expert by expert: write_paging_file's order; read checks it)."""

    def __init__(self, store, workers: int | None = None):
        from bigmoe_pager.codec import CODEC_NAME, encode_many

        self.store, self.layout = store, store.layout
        self.num_layers, self.num_experts, self.codec = store.num_layers, store.num_experts, CODEC_NAME
        self._keys = [(layer, expert) for layer in range(self.num_layers) for expert in range(self.num_experts)]
        self._next = 0
        self._records = encode_many((self._raw(*key) for key in self._keys), self.layout, workers)

    def read(self, layer: int, expert: int, dst: object) -> int:
        """The next record, compressed, into dst (>= its length); ValueError when (layer, expert) is not next."""
        if self._next >= len(self._keys) or self._keys[self._next] != (layer, expert):
            raise ValueError(f"EncodedStore reads in key order; ({layer}, {expert}) asked out of turn")
        self._next += 1
        record = np.frombuffer(next(self._records), np.uint8)
        as_byte_array(dst)[: record.size] = record
        return record.size

    def describe(self, layer: int, expert: int) -> str:
        return self.store.describe(layer, expert)

    def close(self) -> None:
        self._records.close()  # stops the workers of an unfinished run
        self.store.close()

    def _raw(self, layer: int, expert: int) -> np.ndarray:
        buf = aligned_empty(self.layout.pitch).numpy()
        return buf[: self.store.read(layer, expert, buf)]


class _Counting:
    """An ExpertStore that reports progress as records are read."""

    def __init__(self, store, progress: Callable[[int, int], None], total: int):
        self.store, self.progress, self.total, self.done = store, progress, total, 0
        self.layout, self.num_layers, self.num_experts, self.codec = (
            store.layout,
            store.num_layers,
            store.num_experts,
            store.codec,
        )

    def read(self, layer: int, expert: int, dst: object) -> int:
        n = self.store.read(layer, expert, dst)
        self.done += 1
        self.progress(self.done, self.total)
        return n

    def describe(self, layer: int, expert: int) -> str:
        return self.store.describe(layer, expert)

    def close(self) -> None:
        self.store.close()


__all__ = [
    "CheckpointError",
    "EncodedStore",
    "build_paging_file",
    "checkpoint_fingerprint",
    "checkpoint_meta",
    "layout_for_checkpoint",
]
