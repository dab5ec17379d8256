"""Hot-expert profiles: how often each layer used each expert, saved to warm the tiers.

A profile is counts [layers, experts] (int64) in an .npz with a format version.
It is made from a routing trace (topk_ids [tokens, layers, k], the format the
plugin records), written atomically (temp file, fsync, rename: a crash never
leaves a half-written profile under the real name), and checked on load.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bigmoe_pager.atomic_file import write_atomic

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file is missing, damaged, or made for another model shape."""


@dataclass(frozen=True)
class HotProfile:
    """Per-layer expert use counts."""

    counts: np.ndarray
    """int64 [layers, experts]: times each expert was routed to."""

    @classmethod
    def from_trace(cls, topk_ids: np.ndarray, num_experts: int) -> "HotProfile":
        """Count a trace of int [tokens, layers, k] routing ids (-1 ignored)."""
        ids = np.asarray(topk_ids)
        if ids.ndim != 3:
            raise ProfileError(f"a trace is int [tokens, layers, k]; got shape {ids.shape}")
        if ids.size and (ids.max() >= num_experts or ids.min() < -1):
            raise ProfileError(f"trace ids must lie in [-1, {num_experts}); got {ids.min()}..{ids.max()}")
        layers = ids.shape[1]
        counts = np.zeros((layers, num_experts), dtype=np.int64)
        for layer in range(layers):
            col = ids[:, layer, :].reshape(-1)
            counts[layer] = np.bincount(col[col >= 0], minlength=num_experts)
        return cls(counts)

    @property
    def num_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    def hottest(self, layer: int, n: int | None = None) -> np.ndarray:
        """Expert ids of `layer`, most used first (ties: lower id first), the first n."""
        order = np.lexsort((np.arange(self.num_experts), -self.counts[layer]))
        return order[:n].astype(np.int64)

    def save(self, path: str | Path) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, version=np.int64(PROFILE_VERSION), counts=self.counts.astype(np.int64))
        write_atomic(Path(path), buffer.getvalue())

    @classmethod
    def load(cls, path: str | Path, num_layers: int | None = None, num_experts: int | None = None) -> "HotProfile":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                version = int(data["version"])
                counts = np.array(data["counts"])
        except FileNotFoundError:
            raise ProfileError(f"hot profile {path} does not exist") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise ProfileError(
                f"hot profile {path} is not a readable profile ({type(e).__name__}); record a new one"
            ) from None
        if version != PROFILE_VERSION:
            raise ProfileError(f"hot profile {path} has format {version}; this pager reads format {PROFILE_VERSION}")
        if counts.ndim != 2 or counts.dtype != np.int64:
            raise ProfileError(
                f"hot profile {path}: counts must be int64 [layers, experts], got {counts.dtype} {counts.shape}"
            )
        want = (num_layers or counts.shape[0], num_experts or counts.shape[1])
        if counts.shape != want:
            raise ProfileError(
                f"hot profile {path} is for {counts.shape[0]} layers x {counts.shape[1]} experts; "
                f"this model has {want[0]} x {want[1]}"
            )
        return cls(counts)
