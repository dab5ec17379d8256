"""plan_memory: the memory table of a plan (rows that sum to what each tier holds) and the
sizes of the things that are not experts: KV cache, activations, fixed reserves."""

from __future__ import annotations

from dataclasses import dataclass

from bigmoe.model.presets import Arch
from bigmoe.units import GIB, MIB

CODEC_RATIO = 0.86
"""Compressed / raw bytes of an FP8 expert record (the codec's expected ratio until measured)."""
DEFAULT_CONTEXT = 32768
"""Tokens of context planned when --context is not given (clamped to the model's limit)."""
KV_SLACK = 1.25
"""Factor on the KV cache for block rounding and vLLM's per-layer page padding (assumed)."""
KV_FIXED_BYTES = 256 * MIB
"""KV-cache bytes on top, for linear-attention state and one spare block per layer (assumed)."""
BATCH_TOKENS = 2048
"""Most tokens per scheduler step (vLLM's --max-num-batched-tokens, passed so it holds)."""
DEFAULT_MAX_SEQS = 256
"""vLLM's default --max-num-seqs, used when the preset does not set it."""
ACT_HIDDEN_COPIES = 24
"""Live bf16 hidden-state-sized buffers per batched token during a step (assumed)."""
GRAPH_POOL_BYTES = 512 * MIB
"""CUDA-graph memory pool and kernel workspaces (assumed)."""
CUDA_CONTEXT_BYTES = 800 * MIB
"""CUDA context, cuBLAS and Triton workspaces outside PyTorch's allocator (assumed)."""
VRAM_MARGIN = 0.05
"""Share of VRAM kept free for fragmentation and allocator slack."""
WSL2_DESKTOP_VRAM_BYTES = 1 * GIB
"""VRAM the Windows desktop keeps on a WSL2 machine whose GPU was stated, not probed (assumed)."""
OS_RESERVE_FRACTION, OS_RESERVE_MIN = 0.06, 2 * GIB
"""RAM the OS and other programs use on a stated machine: a share of RAM, at least the minimum (assumed)."""
VLLM_HOST_BYTES = {"cuda": 5 * GIB, "cpu": 2 * GIB}
"""Host RAM of vLLM's API server, engine and worker processes besides weights (assumed)."""
NGRAM_PAGE_CACHE_BYTES = 4 * GIB
"""RAM left to the OS page cache for the n-gram table's hot rows (assumed hot set)."""
RAM_HEADROOM = 0.05
"""Share of RAM left free for spikes and the page cache of everything else."""
DISK_HEADROOM_BYTES = 2 * GIB
"""Disk space left free besides the model and paging file (logs, temporary files)."""


@dataclass(frozen=True)
class MemoryRow:
    """One use of a tier's bytes."""

    item: str
    """What it is, e.g. "dense weights"."""
    bytes: int
    """How many bytes it takes."""
    reason: str
    """Where the number comes from, one line."""


@dataclass(frozen=True)
class MemoryTable:
    """What one tier (VRAM, RAM or a disk) holds under a plan."""

    tier: str
    """"VRAM", "RAM" or "disk <path>"."""
    capacity_bytes: int | None
    """Bytes the tier offers (None = not known, so not checked)."""
    rows: tuple[MemoryRow, ...]
    """Uses of the tier; their sum is `used_bytes`."""

    @property
    def used_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def fits(self) -> bool | None:
        """Whether the rows fit the capacity (None when the capacity is unknown)."""
        return None if self.capacity_bytes is None else self.used_bytes <= self.capacity_bytes

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "fits": self.fits,
            "rows": [{"item": r.item, "bytes": r.bytes, "reason": r.reason} for r in self.rows],
        }


def default_context(arch: Arch) -> int:
    return min(DEFAULT_CONTEXT, arch.max_context)


def kv_cache_bytes(arch: Arch, context: int) -> int:
    """KV cache for one sequence of `context` tokens, with slack (passed to vLLM exactly)."""
    return int(arch.kv_bytes_per_token * context * KV_SLACK) + KV_FIXED_BYTES


def kv_reason(arch: Arch, context: int) -> str:
    return (
        f"{context} tokens x {arch.kv_bytes_per_token} B/token x {KV_SLACK} slack + "
        f"{KV_FIXED_BYTES // MIB} MiB for linear-attention state and spare blocks (assumed)"
    )


def batch_tokens(max_seqs: int, context: int) -> int:
    """--max-num-batched-tokens: BATCH_TOKENS, but at least one per sequence (vLLM requires it)
    and no more than every sequence's whole context (vLLM warns beyond that)."""
    return max(max_seqs, min(BATCH_TOKENS, max_seqs * context))


def activation_bytes(arch: Arch, device: str, max_seqs: int, batch: int) -> int:
    """Activation peak of one step: batched hidden states and expert intermediates (bf16),
    fp32 logits of every running sequence, and on a GPU the CUDA-graph pool."""
    per_token = arch.hidden * 2 * ACT_HIDDEN_COPIES + arch.top_k * 2 * arch.moe_intermediate * 2 * 2
    logits = max_seqs * arch.vocab * 4
    return batch * per_token + logits + (GRAPH_POOL_BYTES if device == "cuda" else 0)


def activation_reason(device: str, max_seqs: int, batch: int) -> str:
    pool = f" + {GRAPH_POOL_BYTES // MIB} MiB CUDA-graph pool" if device == "cuda" else ""
    return (
        f"{batch} batched tokens x ({ACT_HIDDEN_COPIES} hidden-size buffers + expert intermediates) "
        f"+ logits of {max_seqs} sequences{pool} (assumed)"
    )


def os_reserve_bytes(total: int) -> int:
    return max(OS_RESERVE_MIN, int(total * OS_RESERVE_FRACTION))
