"""Routing trace and replay for the paged layers: what the router chose, recorded or replaced.

`BIGMOE_TRACE_PATH` records each MoE layer's top-k ids (read on the host, so eager
only) and writes them at exit in the pager benchmark's trace format, with the live
predictor's proposals (BIGMOE_PREDICT=router) as its predicted_ids, and those it made for layers further
ahead (BIGMOE_SSD_READ_AHEAD_LAYERS > 1) as its predicted_ids_ahead.
`BIGMOE_ROUTE_REPLAY` (benchmark only) replaces the router's ids with a trace's next
rows; trace and cursors live on the ids' device, so a replayed CUDA graph takes the
next rows too. `load_replay` (benchmark only) swaps in another trace of the same shape in place.
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path

import numpy as np
import torch
from bigmoe_pager.core.prediction import ReplayedPredictions
from bigmoe_pager.settings import PagerSettings, SettingsError

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


class Routing:
    """The process's routing trace (ids recorded per MoE layer) and replay (trace and cursors on the device)."""

    def __init__(self, settings: PagerSettings):
        self.trace_path = settings.trace_path
        self.replay_path = settings.route_replay
        self._lock = threading.Lock()
        self._trace: dict[int, list[np.ndarray]] = {}
        self._predicted: dict[int, dict[int, list[np.ndarray]]] = {}  # [d][l]: layer l's live proposals for l + d
        self._replay: tuple[torch.Tensor, torch.Tensor] | None = None  # trace [tokens, layers, k], cursors [1024]
        self._saved: tuple[int, int] | None = None  # (ids, proposals) recorded when save_trace last wrote

    def hook(self, moe_index: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The ids the layer routes by (replayed when asked), recorded when a trace is asked for."""
        if self.replay_path is not None:
            topk_ids = self._replayed(moe_index, topk_ids)
        if self.trace_path is not None:
            with self._lock:
                first = not self._trace
                self._trace.setdefault(moe_index, []).append(topk_ids.detach().to("cpu", torch.int32).numpy().copy())
            if first:
                atexit.register(self.save_trace)
        return topk_ids

    def record_predictions(self, moe_index: int, ids: torch.Tensor, ahead: int = 1) -> None:
        """Record the live proposal [tokens, P] layer moe_index made for layer moe_index + ahead (same rows as its
        ids)."""
        rows = ids.detach().to("cpu", torch.int32).numpy().copy()
        with self._lock:
            self._predicted.setdefault(ahead, {}).setdefault(moe_index, []).append(rows)

    def replays_predictions(self, device: torch.device) -> bool:
        """Whether a replayed trace carries predictions (they keep priority over the live predictor's)."""
        if self.replay_path is None:
            return False
        return ReplayedPredictions.for_trace(self.replay_path, device).predicted is not None

    def replayed_proposal(
        self, moe_index: int, tokens: int, device: torch.device, ahead: int = 1
    ) -> torch.Tensor | None:
        """The replayed trace's predictions for layer moe_index + ahead of the rows layer moe_index just replayed
        (int64 [tokens * P]; None: no replay, or a trace without predictions)."""
        if self.replay_path is None or self._replay is None:
            return None
        found = ReplayedPredictions.for_trace(self.replay_path, device)
        return found.rows(moe_index, tokens, self._replay[1], ahead)

    def replayed_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Benchmark only: the replayed trace's predictions (int32 [tokens, layers, P] on `device`) and the replay
        cursors (int64, one per MoE layer: layer l's has moved past the rows its step replayed); None: no replay
        under way, or a trace without predictions."""
        if self.replay_path is None or self._replay is None:
            return None
        predicted = ReplayedPredictions.for_trace(self.replay_path, device).predicted
        return None if predicted is None else (predicted, self._replay[1])

    def save_trace(self) -> None:
        """Write topk_ids int32 [tokens, layers, k] (the pager benchmark's trace format) to trace_path, the live
        proposals for the next layer as predicted_ids int32 [tokens, layers, P] when there are any, and those for
        layers 2, 3, ... ahead as predicted_ids_ahead int32 [depths, tokens, layers, P] (docs/routing.md). Nothing
        is rewritten when nothing was recorded since the last write (the exit hook after an explicit save)."""
        with self._lock:
            made = sum(len(rows) for by_layer in self._predicted.values() for rows in by_layer.values())
            recorded = (sum(map(len, self._trace.values())), made)
            if not self._trace or recorded == self._saved:
                return
            self._saved = recorded
            layers = sorted(self._trace)
            per_layer = [np.concatenate(self._trace[l], axis=0) for l in layers]
            proposed = {
                d: [np.concatenate(by_layer[l], axis=0) if l in by_layer else None for l in layers]
                for d, by_layer in self._predicted.items()
            }
        tokens = min(a.shape[0] for a in per_layer)
        ids = np.stack([a[:tokens] for a in per_layer], axis=1).astype(np.int32)
        arrays = {"topk_ids": ids}
        if 1 in proposed:  # deeper proposals are kept only beside the next layer's (the trace format's rule)
            arrays["predicted_ids"] = predicted_ids(per_layer, proposed[1], tokens)
            deeper = [proposed.get(d, []) for d in range(2, max(proposed) + 1)]
            if deeper:
                width = max((p.shape[1] for depth in deeper for p in depth if p is not None), default=1)
                arrays["predicted_ids_ahead"] = np.stack([predicted_ids(per_layer, d, tokens, width) for d in deeper])
        path = Path(self.trace_path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        depths = len(arrays.get("predicted_ids_ahead", ())) + ("predicted_ids" in arrays)
        log.warning(
            "bigmoe: wrote routing trace of %d tokens x %d layers%s to %s",
            ids.shape[0],
            ids.shape[1],
            f" with the live predictor's proposals ({depths} layer(s) ahead)" if depths else "",
            path,
        )

    def load_replay(self, path) -> None:
        """Benchmark only: replay the trace at `path` from its first row on, in place.

        Its topk_ids (and predicted_ids, predicted_ids_ahead) are copied into the device tensors the replay holds, so
        CUDA graphs captured on them replay the new trace, and every layer's cursor goes back to 0. The
        new trace must have the shape of the replayed one (and predictions of the same shape, or neither):
        SettingsError otherwise, with nothing changed. Before the first replayed step it only names the file.
        """
        if self.replay_path is None:
            raise SettingsError("load_replay: this process replays no trace (BIGMOE_ROUTE_REPLAY is not set)")
        if self._replay is None:
            self.replay_path = Path(path)  # nothing read or captured yet: the first step reads this one
            return
        try:
            with np.load(path, allow_pickle=False) as data:
                ids = np.ascontiguousarray(data["topk_ids"], dtype=np.int32)
                predicted = data["predicted_ids"] if "predicted_ids" in data.files else None
                ahead = data["predicted_ids_ahead"] if "predicted_ids_ahead" in data.files else None
        except (OSError, KeyError, ValueError) as e:
            raise SettingsError(f"load_replay: cannot read {path}: {e}") from None
        trace, cursor = self._replay
        if tuple(ids.shape) != tuple(trace.shape):
            raise SettingsError(f"load_replay: {path} is {tuple(ids.shape)}, the replayed trace {tuple(trace.shape)}")
        # vLLM made these tensors in its forward, under inference mode: in-place updates must run in it too.
        with torch.inference_mode():
            try:
                ReplayedPredictions.for_trace(self.replay_path, trace.device).replace(predicted, ahead)
            except ValueError as e:
                raise SettingsError(f"load_replay: {path}: {e}") from None
            trace.copy_(torch.from_numpy(ids))
            cursor.zero_()
        if trace.device.type == "cuda":
            torch.cuda.synchronize(trace.device)  # the copies are done before the next step is issued

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


def predicted_ids(
    topk: list[np.ndarray], proposed: list[np.ndarray | None], tokens: int, width: int | None = None
) -> np.ndarray:
    """int32 [tokens, layers, P], -1 padded: each layer's proposals (for a layer ahead of it) beside its ids, row for
    row (P: `width`, default the widest proposal; 1 where there is none).

    A layer without proposals (the last ones, one whose router ahead was not usable) is all -1; so is one
    whose proposals do not match its ids row for row (not expected: both are taken in the same call).
    """
    width = width or max((p.shape[1] for p in proposed if p is not None), default=1)
    out = np.full((tokens, len(topk), width), -1, dtype=np.int32)
    for column, (ids, p) in enumerate(zip(topk, proposed)):
        if p is None:
            continue
        if p.shape[0] != ids.shape[0]:
            log.warning("bigmoe: trace layer %d has %d proposals for %d rows; left out", column, len(p), len(ids))
            continue
        out[:, column, : p.shape[1]] = p[:tokens]
    return out
