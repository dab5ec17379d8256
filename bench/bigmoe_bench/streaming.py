"""A step streamed through an ExpertPager's slots in chunks, for the benchmark's MoE models.

When a step can need more distinct experts than slots, the benchmark streams them:

    pairs = None
    for chunk in chunks(pager, topk_ids):
        y = per_pair_moe(x, pager.buffers, chunk.remapped)   # [T, K, H], zero where remapped == -1
        pairs = chunk.merge(pairs, y)
    out = combine(pairs, topk_weights)                       # the same reduction as unchunked

(`stream_pairs(pager, topk_ids, lambda remapped: per_pair_moe(...))` is that loop.)

Each chunk's experts are brought in just before the caller computes it, so at
most the chunk's experts must be resident at once. Because every (token, k)
output is computed by the same kernel on the same bytes, and merged by
selection rather than addition, the result is bit-identical to one unchunked
per-pair run followed by the same combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from bigmoe_pager.core.pager import ExpertPager


@dataclass(frozen=True)
class Chunk:
    """One pass of a streamed step: the pairs whose experts this chunk made resident."""

    index: int
    """Position in the stream, from 0."""
    remapped: torch.Tensor
    """topk_ids' shape: VRAM slot for the pairs of this chunk, -1 for every other pair."""
    mask: torch.Tensor
    """topk_ids' shape, bool: the pairs this chunk serves."""

    def merge(self, acc: torch.Tensor | None, pair_out: torch.Tensor) -> torch.Tensor:
        """Take this chunk's pairs from pair_out ([*topk shape, H]) into acc; selection, never addition."""
        mask = self.mask.unsqueeze(-1)
        if acc is None:
            return torch.where(mask, pair_out, torch.zeros((), dtype=pair_out.dtype, device=pair_out.device))
        return torch.where(mask, pair_out, acc)


def chunk_count(pager: ExpertPager, topk_ids: torch.Tensor, sync: bool = False) -> int:
    """Chunks `chunks()` yields: a bound from shapes alone, or (sync=True) the exact count, reading one number."""
    w = pager.work_slots
    if sync:
        distinct = int(_need(pager, topk_ids.reshape(-1).long())[0][: pager.num_experts].sum())
        return max(1, -(-distinct // w))
    return max(1, -(-min(pager.num_experts, topk_ids.numel()) // w))


def chunks(pager: ExpertPager, topk_ids: torch.Tensor, sync: bool | None = None) -> Iterator[Chunk]:
    """Stream a step's experts through the VRAM slots, at most `pager.work_slots` distinct experts per chunk.

    Chunk c's experts are loaded when the caller asks for chunk c, so compute
    chunk c before advancing. Experts already resident come first (they cost
    nothing), then the rest in ascending id. sync=None syncs once to skip empty
    chunks unless a CUDA graph is being captured.
    """
    if sync is None:
        sync = not (pager.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    shape = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    pair_chunk = _pair_chunks(pager, flat)
    for c in range(chunk_count(pager, topk_ids, sync)):
        mask = pair_chunk == c
        ids = torch.where(mask, flat, -1).reshape(shape).to(topk_ids.dtype)
        yield Chunk(c, pager.prepare(ids), mask.reshape(shape))


def stream_pairs(pager: ExpertPager, topk_ids: torch.Tensor, pair_fn, sync: bool | None = None) -> torch.Tensor:
    """Per-pair outputs of a whole step, streamed chunk by chunk: [*topk shape, H].

    pair_fn(remapped) must return the per-(token, k) outputs for slot ids `remapped`
    (zeros where -1), computed from the slot buffers as they are at the call.
    """
    pairs = None
    for chunk in chunks(pager, topk_ids, sync):
        pairs = chunk.merge(pairs, pair_fn(chunk.remapped))
    return pairs


def _need(pager: ExpertPager, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e = pager.num_experts
    idx = torch.where((flat >= 0) & (flat < e), flat, e).to(pager.device)
    need = torch.zeros(e + 1, dtype=torch.bool, device=pager.device)
    need.index_fill_(0, idx, True)
    need[e:].fill_(False)
    return need, idx


def _pair_chunks(pager: ExpertPager, flat: torch.Tensor) -> torch.Tensor:
    """Chunk index of every (token, k) pair; -1 for ids that need no expert."""
    e = pager.num_experts
    need, idx = _need(pager, flat)
    resident = pager.vram.expert_slot >= 0
    first = need[:e] & resident
    later = need[:e] & ~resident
    rank = torch.where(first, torch.cumsum(first, 0) - 1, torch.cumsum(later, 0) - 1 + first.sum())
    chunk_of = torch.full((e + 1,), -1, dtype=torch.int64, device=pager.device)
    chunk_of[:e] = torch.where(need[:e], rank // pager.work_slots, -1)
    return chunk_of[idx]
