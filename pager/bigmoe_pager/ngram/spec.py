"""What the model config says the n-gram table must look like.

Qwen4Exp's n-gram ("PLE") table has one block of rows per n-gram head; head h
of PLE layer d owns the next prime after the previous head's size, starting
from `ngram_vocab_size_base`, and the sum is padded up to
`make_ngram_vocab_size_divisible_by`. The checkpoint splits the padded table
into `split_ngram_parts` shards of ceil(rows / parts) rows each (the last ones
shorter or empty). Each token gathers one row per head:
(ngram_size - 1) * heads_per_ngram rows of ple_embed_dim / heads elements.

For Qwen3.8-Flash-Next: 16 heads of ~20M rows -> 320,001,536 rows of 160 FP8
bytes in 128 shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .errors import NgramLayoutError

ITEM_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}
"""Bytes per element of the safetensors dtypes a table may be stored in."""

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin for n < 3.3e24


@dataclass(frozen=True)
class TableSpec:
    """The shape of one n-gram table as the model config implies it."""

    rows: int
    """Rows of the padded table (what vLLM allocates as num_embeddings)."""
    row_elems: int
    """Elements per row (ple_embed_dim / heads)."""
    dtype: str
    """Safetensors dtype name of the stored rows, e.g. F8_E4M3."""
    parts: int | None
    """Checkpoint shards the table is split into (split_ngram_parts); None = take the checkpoint's split."""
    heads: int = 1
    """Rows gathered per token ((ngram_size - 1) * heads_per_ngram)."""

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES:
            raise NgramLayoutError(f"n-gram table dtype {self.dtype} is not one of {sorted(ITEM_BYTES)}")
        if min(self.rows, self.row_elems, self.parts or 1, self.heads) <= 0:
            raise NgramLayoutError(f"n-gram table spec needs positive rows/row_elems/parts/heads, got {self}")

    @property
    def row_bytes(self) -> int:
        return self.row_elems * ITEM_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def shard_rows(self) -> int:
        """Rows of every full shard: ceil(rows / parts)."""
        if self.parts is None:
            raise ValueError("this TableSpec leaves the split to the checkpoint; it has no shard size")
        return -(-self.rows // self.parts)

    def rows_in_shard(self, index: int) -> int:
        """Rows shard `index` must hold (0 for trailing shards past the end)."""
        return max(0, min(self.shard_rows, self.rows - index * self.shard_rows))

    @classmethod
    def from_config(cls, config: Mapping, ple_layer: int | None = None) -> "TableSpec":
        """The spec of PLE layer `ple_layer` (a 1-based id from ple_layer_ids; default: the only one)."""
        text = config.get("text_config", config)
        layer_ids = sorted(set(text.get("ple_layer_ids") or []))
        if not layer_ids:
            raise NgramLayoutError("model config has no ple_layer_ids: this model has no n-gram table")
        if ple_layer is None:
            if len(layer_ids) != 1:
                raise NgramLayoutError(f"model config has PLE layers {layer_ids}; name one")
            ple_layer = layer_ids[0]
        if ple_layer not in layer_ids:
            raise NgramLayoutError(f"PLE layer {ple_layer} is not in the model's ple_layer_ids {layer_ids}")
        ngram_size = int(text.get("ngram_size", 3))
        heads = (ngram_size - 1) * int(text.get("heads_per_ngram", 8))
        embed_dim = int(text.get("ple_embed_dim") or text["hidden_size"])
        if heads <= 0 or embed_dim % heads:
            raise NgramLayoutError(f"ple_embed_dim {embed_dim} does not split into {heads} n-gram heads")
        sizes = head_vocab_sizes(int(text.get("ngram_vocab_size_base", 20_000_000)), heads, layer_ids.index(ple_layer))
        divisor = int(text.get("make_ngram_vocab_size_divisible_by", 128))
        rows = -(-sum(sizes) // divisor) * divisor
        return cls(
            rows=rows,
            row_elems=embed_dim // heads,
            dtype=_stored_dtype(config, text),
            parts=int(text.get("split_ngram_parts", 512)),
            heads=heads,
        )


def head_vocab_sizes(base: int, heads: int, dense_layer: int) -> list[int]:
    """Rows of each head of PLE layer number `dense_layer` (0-based among PLE layers).

    Global head g (= dense_layer * heads + h) owns the (g+1)-th prime >= base,
    so consecutive heads and layers never share a size.
    """
    primes = primes_from(base, (dense_layer + 1) * heads)
    return primes[dense_layer * heads :]


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start."""
    found, n = [], max(start, 2)
    while len(found) < count:
        if is_prime(n):
            found.append(n)
        n += 1 if n == 2 else (2 if n % 2 else 1)
    return found


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _stored_dtype(config: Mapping, text: Mapping) -> str:
    explicit = text.get("ple_embedding_dtype")
    if explicit == "float8_e4m3fn":
        return "F8_E4M3"
    if explicit is not None:
        raise NgramLayoutError(
            f"ple_embedding_dtype {explicit!r} is not supported by the n-gram reader (FP8 E4M3 or BF16 only)"
        )
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return "F8_E4M3"
    return {"float16": "F16", "float32": "F32"}.get(str(text.get("torch_dtype", config.get("torch_dtype", ""))), "BF16")
