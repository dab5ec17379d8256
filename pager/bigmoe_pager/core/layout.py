"""How one expert's tensors sit in a flat byte record.

Every tier stores an expert as one record: the RAM tier as a row of a pinned
uint8 buffer, the SSD tier as a byte range of a paging file (or scattered byte
ranges of the checkpoint, gathered into the same record). The VRAM tier keeps
one contiguous tensor per component ([slots, *shape]) in vLLM's own parameter
layout, so its MoE kernel runs on the slot buffers unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

RECORD_ALIGN = 4096  # bytes; O_DIRECT reads need offsets, lengths and buffers aligned to the block size
COMPONENT_ALIGN = 64  # bytes; each component starts on a cache line so copies stay coalesced


@dataclass(frozen=True)
class Component:
    """One tensor of an expert, e.g. w13_weight [2I, H] float8_e4m3fn."""

    name: str
    """vLLM parameter name without the leading expert dimension (w13_weight, w2_weight_scale_inv, ...)."""
    shape: tuple[int, ...]
    """Shape of one expert's slice."""
    dtype: torch.dtype
    """Element type."""
    offset: int = 0
    """Byte offset inside the record."""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype)


@dataclass(frozen=True)
class ExpertLayout:
    """The components of one expert and where each lies in a record."""

    components: tuple[Component, ...]
    """Components in record order, offsets filled in."""
    record_bytes: int
    """Bytes of payload (end of the last component)."""
    pitch: int
    """Bytes from one record to the next: record_bytes rounded up to RECORD_ALIGN."""

    @classmethod
    def build(cls, parts: list[tuple[str, tuple[int, ...], torch.dtype]]) -> "ExpertLayout":
        comps, offset = [], 0
        for name, shape, dtype in parts:
            offset = _round_up(offset, COMPONENT_ALIGN)
            comp = Component(name, tuple(int(d) for d in shape), dtype, offset)
            comps.append(comp)
            offset += comp.nbytes
        return cls(tuple(comps), offset, _round_up(offset, RECORD_ALIGN))

    @classmethod
    def for_moe(cls, hidden: int, intermediate: int, dtype: torch.dtype, block: int | None = None) -> "ExpertLayout":
        """vLLM's fused layout: w13 [2I, H] (gate rows then up rows), w2 [H, I], plus block scales for FP8."""
        parts = [("w13_weight", (2 * intermediate, hidden), dtype), ("w2_weight", (hidden, intermediate), dtype)]
        if block:
            parts += [
                ("w13_weight_scale_inv", (_ceil_div(2 * intermediate, block), _ceil_div(hidden, block)), torch.float32),
                ("w2_weight_scale_inv", (_ceil_div(hidden, block), _ceil_div(intermediate, block)), torch.float32),
            ]
        return cls.build(parts)

    def __getitem__(self, name: str) -> Component:
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> dict[str, Component]:
        return {c.name: c for c in self.components}

    @cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """Byte ranges [start, end) of a record between components (alignment padding), which readers zero."""
        gaps, pos = [], 0
        for comp in sorted(self.components, key=lambda c: c.offset):
            if comp.offset > pos:
                gaps.append((pos, comp.offset))
            pos = max(pos, comp.offset + comp.nbytes)
        return tuple(gaps)

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of the components of one record (a uint8 tensor of >= record_bytes)."""
        return {c.name: record[c.offset : c.offset + c.nbytes].view(c.dtype).view(c.shape) for c in self.components}

    def rows_views(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed [R, *shape] strided views of each component over a uint8 [R, pitch] block of records."""
        rows = records.shape[0]
        return {
            c.name: records[:, c.offset : c.offset + c.nbytes].view(c.dtype).view(rows, *c.shape)
            for c in self.components
        }

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """One record (uint8 [pitch]) holding the given component tensors, padding zeroed."""
        out = torch.zeros(self.pitch, dtype=torch.uint8) if out is None else out
        for c in self.components:
            t = tensors[c.name]
            if tuple(t.shape) != c.shape or t.dtype != c.dtype:
                raise ValueError(f"{c.name}: got {tuple(t.shape)} {t.dtype}, layout wants {c.shape} {c.dtype}")
            out[c.offset : c.offset + c.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        return out

    def slot_buffers(self, slots: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The VRAM tier: one contiguous [slots, *shape] tensor per component."""
        return {c.name: torch.empty((slots, *c.shape), dtype=c.dtype, device=device) for c in self.components}

    def signature(self) -> str:
        """Stable text naming the layout, for paging-file headers."""
        parts = [
            f"{c.name}:{'x'.join(map(str, c.shape))}:{str(c.dtype).removeprefix('torch.')}@{c.offset}"
            for c in self.components
        ]
        return ";".join(parts) + f";pitch={self.pitch}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b
