"""Where the SSD tier reads whole experts from: the `ExpertStore` protocol and the checkpoint store.

A store fills a caller's buffer with one expert's record (see layout.py) and
says how many bytes it wrote. `CheckpointStore` gathers the record straight
from the checkpoint's safetensors byte ranges, so an uncompressed SSD tier needs
no second copy of the model on disk. The paging file store is in paging_file.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .expert_names import MAIN_SCHEMES, ExpertNameError, ExpertNames, describe_schemes, discover
from .layout import ExpertLayout
from .odirect import DirectFile, SystemFileIO, as_byte_array
from .read_stats import ReadCounters
from .record_reads import ReadsBuilder, RecordReads
from .safetensors_index import CheckpointError, TensorEntry, index_files, shard_paths

DEFAULT_PREFIX = MAIN_SCHEMES[0]  # Qwen3-MoE's names; expert_names.py knows every scheme the store reads
MERGE_GAP = 64 << 10  # bytes; tensors of one expert closer than this are read as one span (fewer, larger reads)
_PROJECTIONS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}  # vLLM's fused w13 = gate rows, then up rows


@runtime_checkable
class ExpertStore(Protocol):
    """A read-only source of expert records, indexed by MoE layer (0-based, MoE layers only) and expert.

    MoE layer i is the i-th decoder layer with experts: the main model's in order, then the MTP head's.
    """

    layout: ExpertLayout
    num_layers: int
    num_experts: int
    codec: str
    """"raw" when records are plain layout bytes; otherwise the codec that decodes them."""
    counters: ReadCounters
    """File-level read counters (reads, bytes, time, retries after EIO/short reads, errors)."""

    def read(self, layer: int, expert: int, dst: object) -> int:
        """Write the record into dst (uint8 memory of >= layout.pitch bytes); return its length in bytes."""
        ...

    def describe(self, layer: int, expert: int) -> str:
        """Where the record lives, for error messages (file and offset)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Run:
    """One contiguous byte span of a shard and the record pieces cut from it."""

    file: str
    """Shard path."""
    offset: int
    """Absolute file offset of the span."""
    length: int
    """Span length in bytes."""
    pieces: tuple[tuple[int, int, int], ...]
    """(offset in span, offset in record, bytes) for each tensor in the span."""


class CheckpointStore:
    """Reads experts from a safetensors checkpoint in place, with O_DIRECT."""

    codec = "raw"

    def __init__(
        self,
        root: str | os.PathLike,
        layout: ExpertLayout,
        *,
        model_layers: list[int] | None = None,
        num_experts: int | None = None,
        retries: int = 2,
        io: SystemFileIO | None = None,
        counters: ReadCounters | None = None,
    ):
        """model_layers: the decoder layers (vLLM numbering, expert_names.py) to serve; default every one named."""
        self.root = Path(root)
        self.layout = layout
        self.counters = counters if counters is not None else ReadCounters()
        index = index_files(shard_paths(self.root))
        try:
            self.names = discover(index, num_hidden_layers(self.root))
        except ExpertNameError as e:
            raise CheckpointError(f"{self.root}: {e}") from None
        self.model_layers = list(model_layers) if model_layers is not None else self.names.layers
        self.num_layers = len(self.model_layers)
        self.num_experts = num_experts if num_experts is not None else self.names.num_experts
        if not self.model_layers or not self.num_experts:
            raise CheckpointError(f"{self.root}: no expert tensors named like {describe_schemes()}")
        unknown = [layer for layer in self.model_layers if layer not in self.names.heads]
        if unknown:
            raise CheckpointError(
                f"{self.root}: no experts for decoder layers {unknown[:5]} (it has {self.names.layers})"
            )
        self._runs = self._plan(index, self.names)
        self._gaps = layout.gaps
        files = sorted({run.file for runs in self._runs for run in runs})
        self._files = {p: DirectFile(p, retries=retries, io=io, counters=self.counters) for p in files}

    def read(self, layer: int, expert: int, dst: object) -> int:
        out = as_byte_array(dst)
        if out.nbytes < self.layout.record_bytes:
            raise ValueError(f"destination holds {out.nbytes} bytes; a record needs {self.layout.record_bytes}")
        for run in self._runs[self._key(layer, expert)]:
            span = self._files[run.file].read_view(run.offset, run.length)
            for src, dst_off, n in run.pieces:
                out[dst_off : dst_off + n] = span[src : src + n]
        for start, end in self._gaps:
            out[start:end] = 0
        return self.layout.record_bytes

    def record_reads(self) -> RecordReads:
        """Every record as aligned reads and pieces, for the native SSD reader (its gaps zeroed after them)."""
        plan = ReadsBuilder([self._files[p] for p in sorted(self._files)])
        for runs in self._runs:
            for run in runs:
                staged = plan.read(run.file, run.offset, run.length)
                for src, dst_off, n in run.pieces:
                    plan.piece(staged + src, dst_off, n)
            plan.end_key(self.layout.record_bytes)
        return plan.build(list(self._gaps))

    def describe(self, layer: int, expert: int) -> str:
        runs = self._runs[self._key(layer, expert)]
        where = ", ".join(f"{Path(r.file).name}@{r.offset}+{r.length}" for r in runs)
        return f"checkpoint {self.root} (model layer {self.model_layers[layer]}, expert {expert}: {where})"

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(
                f"expert ({layer}, {expert}) outside {self.num_layers} layers x {self.num_experts} experts"
            )
        return layer * self.num_experts + expert

    def _plan(self, index: dict[str, TensorEntry], names: ExpertNames) -> list[list[_Run]]:
        """Per (layer, expert): the spans to read; every tensor checked against the layout first."""
        sources = [src for comp in self.layout.components for src in _component_sources(comp)]
        plans, missing = [], []
        for model_layer in self.model_layers:
            for expert in range(self.num_experts):
                head = names.head(model_layer, expert)
                pieces = []
                for suffix, shape, dtype, record_offset in sources:
                    entry = index.get(head + suffix)
                    if entry is None:
                        missing.append(head + suffix)
                        continue
                    if entry.shape != shape or entry.dtype != dtype:
                        raise CheckpointError(
                            f"{entry.path}: {head + suffix} is {_fmt(entry.dtype, entry.shape)} but the expert "
                            f"layout wants {_fmt(dtype, shape)}; the layout does not match this checkpoint"
                        )
                    pieces.append((entry, record_offset))
                plans.append(_merge(pieces))
        if missing:
            raise CheckpointError(f"{self.root}: {len(missing)} expert tensors missing, e.g. {', '.join(missing[:3])}")
        return plans


def _component_sources(comp) -> list[tuple[str, tuple[int, ...], object, int]]:
    """(checkpoint name suffix, shape, dtype, record offset) of each tensor that fills one layout component."""
    head, _, param = comp.name.partition("_")
    projections = _PROJECTIONS.get(head)
    if projections is None or not param:
        raise CheckpointError(f"layout component {comp.name} has no checkpoint source (known: w13_*, w2_*)")
    parts = len(projections)
    if comp.shape[0] % parts:
        raise CheckpointError(
            f"layout component {comp.name} has {comp.shape[0]} rows, which do not split into {'/'.join(projections)}; "
            "for block-quantized FP8 the intermediate size must be a multiple of the block"
        )
    shape = (comp.shape[0] // parts, *comp.shape[1:])
    part_bytes = comp.nbytes // parts
    return [(f"{proj}.{param}", shape, comp.dtype, comp.offset + i * part_bytes) for i, proj in enumerate(projections)]


def _merge(pieces: list[tuple[TensorEntry, int]]) -> list[_Run]:
    """Group one expert's tensors into few spans: same file, gaps under MERGE_GAP."""
    runs: list[_Run] = []
    group: list[tuple[TensorEntry, int]] = []
    for entry, rec in sorted(pieces, key=lambda p: (str(p[0].path), p[0].offset)):
        if group and (entry.path != group[0][0].path or entry.offset - _end(group) > MERGE_GAP):
            runs.append(_run(group))
            group = []
        group.append((entry, rec))
    if group:
        runs.append(_run(group))
    return runs


def _run(group: list[tuple[TensorEntry, int]]) -> _Run:
    start = group[0][0].offset
    pieces = tuple((e.offset - start, rec, e.nbytes) for e, rec in group)
    return _Run(str(group[0][0].path), start, _end(group) - start, pieces)


def _end(group: list[tuple[TensorEntry, int]]) -> int:
    return max(e.offset + e.nbytes for e, _ in group)


def num_hidden_layers(root: Path) -> int | None:
    """config.json's num_hidden_layers (text_config first), where vLLM starts numbering MTP layers; None without one."""
    path = root / "config.json" if root.is_dir() else root.parent / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = text.get("num_hidden_layers", config.get("num_hidden_layers"))
    return int(layers) if isinstance(layers, int) else None


def _fmt(dtype: object, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"
