"""Per-layer, per-tier pager counters.

The step path adds to an int64 tensor on the model's device with tensor ops
only (no sync, capturable in a CUDA graph). Host threads (the SSD workers) add
to a host array under a lock. `snapshot()` syncs once and sums both; it is
called on demand (the metrics exporter, the benchmark), never per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

TIERS = ("vram", "ram", "ssd")
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "bytes",
    "read_ns",
    "retries",
    "errors",
    "prefetched",
    "prefetch_used",
    "prefetch_wasted_bytes",
    "prefetch_late",
    "hurried",
)
"""lookups/hits/misses count distinct experts per step; bytes moved into the tier (prefetches included);
read_ns of SSD reads; prefetched: experts copied in ahead of need; prefetch_used: of those, needed by the
step they were fetched for; prefetch_wasted_bytes: bytes of the others; prefetch_late: needed experts whose
prefetch copy was still under way when their step reached them (joinless forwards only: the step waits for it);
hurried (SSD tier): reads ahead a step came to wait for before an I/O worker had started them, moved ahead of the
other reads ahead."""

# Index of each tier and counter in the tables (the decision kernels and the torch paths add by index).
VRAM, RAM, SSD = (TIERS.index(t) for t in ("vram", "ram", "ssd"))
LOOKUPS = COUNTERS.index("lookups")
HITS = COUNTERS.index("hits")
MISSES = COUNTERS.index("misses")
BYTES = COUNTERS.index("bytes")
READ_NS = COUNTERS.index("read_ns")
RETRIES = COUNTERS.index("retries")
ERRORS = COUNTERS.index("errors")
PREFETCHED = COUNTERS.index("prefetched")
PREFETCH_USED = COUNTERS.index("prefetch_used")
PREFETCH_WASTED_BYTES = COUNTERS.index("prefetch_wasted_bytes")
PREFETCH_LATE = COUNTERS.index("prefetch_late")
HURRIED = COUNTERS.index("hurried")


class StatsError(KeyError):
    """A tier or counter name the stats do not know."""


class TierCounters:
    """The counters of one layer and tier: a view into PagerStats' tensors."""

    def __init__(self, owner: "PagerStats", layer: int, tier: int) -> None:
        self._owner = owner
        self._layer = layer
        self._tier = tier
        self._row = owner.device_counts[layer, tier]
        self._index_cache: dict[tuple[str, ...], torch.Tensor] = {}

    def add(self, **values: torch.Tensor | int) -> None:
        """Add device tensors (0-dim) or ints to the named counters, without a sync."""
        names = tuple(values)
        index = self._index_cache.get(names)
        if index is None:
            index = torch.tensor([_counter(n) for n in names], dtype=torch.int64, device=self._row.device)
            self._index_cache[names] = index
        parts = [torch.as_tensor(v, dtype=torch.int64, device=self._row.device).reshape(()) for v in values.values()]
        self._row.index_add_(0, index, torch.stack(parts))

    def add_host(self, **values: int) -> None:
        """Add plain ints from a host thread (SSD workers: read time, retries, errors, hurried reads ahead)."""
        with self._owner.lock:
            for name, v in values.items():
                self._owner.host_counts[self._layer, self._tier, _counter(name)] += int(v)


@dataclass(frozen=True)
class TierSnapshot:
    """Counter values of one tier, read at one moment."""

    lookups: int
    """Distinct experts looked up in this tier."""
    hits: int
    """Of those, found here."""
    misses: int
    """Of those, fetched from the tier below."""
    bytes: int
    """Bytes moved into this tier."""
    read_ns: int
    """Nanoseconds spent reading into this tier (SSD reads)."""
    retries: int
    """Reads retried."""
    errors: int
    """Reads that failed for good, plus invalid routing ids seen by the VRAM tier."""
    prefetched: int = 0
    """Experts copied into this tier ahead of need (next-layer prefetch)."""
    prefetch_used: int = 0
    """Of those, needed by the step they were fetched for."""
    prefetch_wasted_bytes: int = 0
    """Bytes of prefetched experts that step did not need."""
    prefetch_late: int = 0
    """Needed experts whose prefetch copy was still under way when their step reached them (joinless forwards)."""
    hurried: int = 0
    """Reads ahead a step came to wait for before an I/O worker had started them (SSD tier)."""

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


class PagerStats:
    """Counters for every paged layer of a model, in one device tensor [layers, tiers, counters]."""

    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        self.device_counts = torch.zeros((num_layers, len(TIERS), len(COUNTERS)), dtype=torch.int64, device=device)
        self.host_counts = np.zeros((num_layers, len(TIERS), len(COUNTERS)), dtype=np.int64)
        self.lock = threading.Lock()
        self._views = [[TierCounters(self, layer, t) for t in range(len(TIERS))] for layer in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return self.device_counts.shape[0]

    def tier(self, layer: int, tier: str) -> TierCounters:
        return self._views[layer][_tier(tier)]

    def row(self, layer: int, tier: str) -> torch.Tensor:
        """int64 [counters] device view that step-path kernels add to directly."""
        return self.device_counts[layer, _tier(tier)]

    def read(self) -> np.ndarray:
        """int64 [layers, tiers, counters]: device and host counters summed (one sync)."""
        device = self.device_counts.cpu().numpy()
        with self.lock:
            return device + self.host_counts

    def snapshot(self, layer: int | None = None) -> dict[str, TierSnapshot]:
        """Per tier, one layer or (None) all layers summed."""
        counts = self.read()
        counts = counts.sum(axis=0) if layer is None else counts[layer]
        return {name: TierSnapshot(*(int(x) for x in counts[t])) for t, name in enumerate(TIERS)}

    def reset(self) -> None:
        self.device_counts.zero_()
        with self.lock:
            self.host_counts[:] = 0


def _tier(name: str) -> int:
    try:
        return TIERS.index(name)
    except ValueError:
        raise StatsError(f"unknown tier {name!r}; tiers are {', '.join(TIERS)}") from None


def _counter(name: str) -> int:
    try:
        return COUNTERS.index(name)
    except ValueError:
        raise StatsError(f"unknown counter {name!r}; counters are {', '.join(COUNTERS)}") from None
