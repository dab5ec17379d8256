"""Routing trace and replay for the paged layers: what the router chose, recorded or replaced.

`BIGMOE_TRACE_PATH` records each MoE layer's top-k ids (read on the host, so eager
only) and writes them at exit in the pager benchmark's trace format.
`BIGMOE_ROUTE_REPLAY` (benchmark only) replaces the router's ids with a trace's next
rows; trace and cursors live on the ids' device, so a replayed CUDA graph takes the
next rows too.
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.prediction import ReplayedPredictions
from bigmoe_pager.settings import PagerSettings, SettingsError

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


class Routing:
    """The process's routing trace (ids recorded per MoE layer) and replay (trace and cursors on the device)."""

    def __init__(self, settings: PagerSettings, layer_after: Callable[[int], object] = lambda moe_index: None):
        """layer_after(i): the paged layer i + 1, if any (a replayed trace's predictions prefetch into it)."""
        self.layer_after = layer_after
        self.trace_path = settings.trace_path
        self.replay_path = settings.route_replay
        self._lock = threading.Lock()
        self._trace: dict[int, list[np.ndarray]] = {}
        self._replay: tuple[torch.Tensor, torch.Tensor] | None = None  # trace [tokens, layers, k], cursors [1024]

    def hook(self, moe_index: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The ids the layer routes by (replayed when asked), recorded when a trace is asked for."""
        if self.replay_path is not None:
            topk_ids = self._replayed(moe_index, topk_ids)
            nxt = getattr(self.layer_after(moe_index), "pager", None)
            if isinstance(nxt, DeviceLayerPager):  # a trace with predicted_ids: prefetch as a live predictor would
                predicted = ReplayedPredictions.for_trace(self.replay_path, topk_ids.device)
                predicted.feed(moe_index, topk_ids.shape[0], self._replay[1], nxt)
        if self.trace_path is not None:
            with self._lock:
                first = not self._trace
                self._trace.setdefault(moe_index, []).append(topk_ids.detach().to("cpu", torch.int32).numpy().copy())
            if first:
                atexit.register(self.save_trace)
        return topk_ids

    def save_trace(self) -> None:
        """Write topk_ids int32 [tokens, layers, k] (the pager benchmark's trace format) to trace_path."""
        with self._lock:
            if not self._trace:
                return
            layers = sorted(self._trace)
            per_layer = [np.concatenate(self._trace[l], axis=0) for l in layers]
        tokens = min(a.shape[0] for a in per_layer)
        ids = np.stack([a[:tokens] for a in per_layer], axis=1).astype(np.int32)
        path = Path(self.trace_path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, topk_ids=ids)
        tmp.replace(path)
        log.warning("bigmoe: wrote routing trace of %d tokens x %d layers to %s", ids.shape[0], ids.shape[1], path)

    def _replayed(self, moe_index: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Benchmark only: the next rows of a recorded trace stand in for the router's choice.

        The trace and each layer's cursor live on the ids' device and advance with tensor ops,
        so a CUDA graph that captured a step replays the next rows on every replay.
        """
        trace, cursor = self._replay_state(topk_ids.device)
        tokens, layers, k = trace.shape
        if k != topk_ids.shape[1]:
            raise SettingsError(f"BIGMOE_ROUTE_REPLAY: trace has top-{k}, the model routes top-{topk_ids.shape[1]}")
        n = topk_ids.shape[0]
        rows = (torch.arange(n, device=trace.device) + cursor[moe_index]) % tokens
        cursor[moe_index : moe_index + 1].add_(n)
        return trace[:, moe_index % layers][rows].to(topk_ids.dtype)

    def _replay_state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._replay is None:
                try:
                    ids = np.load(self.replay_path)["topk_ids"]
                except (OSError, KeyError, ValueError) as e:
                    raise SettingsError(f"BIGMOE_ROUTE_REPLAY: cannot read {self.replay_path}: {e}") from None
                trace = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32)).to(device)
                self._replay = trace, torch.zeros(1024, dtype=torch.int64, device=device)  # one cursor per MoE layer
            return self._replay
