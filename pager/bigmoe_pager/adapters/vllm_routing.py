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

import numpy as np
import torch
from bigmoe_pager.adapters import vllm_glue
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.prediction import ReplayedPredictions
from bigmoe_pager.settings import PagerSettings, SettingsError

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines

_lock = threading.Lock()
_trace: dict[int, list[np.ndarray]] = {}
_replay: dict[str, object] = {}


def routing_hook(moe_index: int, topk_ids: torch.Tensor) -> torch.Tensor:
    active = settings()
    if active.route_replay is not None:
        topk_ids = _replayed(active.route_replay, moe_index, topk_ids)
        nxt = next((l.pager for l in vllm_glue.all_layers() if getattr(l, "_moe_index", None) == moe_index + 1), None)
        if isinstance(nxt, DeviceLayerPager):  # a trace with predicted_ids: prefetch as a live predictor would
            predicted = ReplayedPredictions.for_trace(active.route_replay, topk_ids.device)
            predicted.feed(moe_index, topk_ids.shape[0], _replay["cursor"], nxt)
    if active.trace_path is not None:
        with _lock:
            first = not _trace
            _trace.setdefault(moe_index, []).append(topk_ids.detach().to("cpu", torch.int32).numpy().copy())
        if first:
            atexit.register(save_trace, active.trace_path)
    return topk_ids


def save_trace(path: Path) -> None:
    """Write topk_ids int32 [tokens, layers, k] (the pager benchmark's trace format)."""
    with _lock:
        if not _trace:
            return
        layers = sorted(_trace)
        per_layer = [np.concatenate(_trace[l], axis=0) for l in layers]
    tokens = min(a.shape[0] for a in per_layer)
    ids = np.stack([a[:tokens] for a in per_layer], axis=1).astype(np.int32)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, topk_ids=ids)
    tmp.replace(path)
    log.warning("bigmoe: wrote routing trace of %d tokens x %d layers to %s", ids.shape[0], ids.shape[1], path)


def _replayed(path: Path, moe_index: int, topk_ids: torch.Tensor) -> torch.Tensor:
    """Benchmark only: the next rows of a recorded trace stand in for the router's choice.

    The trace and each layer's cursor live on the ids' device and advance with tensor ops,
    so a CUDA graph that captured a step replays the next rows on every replay.
    """
    trace, cursor = _replay_state(path, topk_ids.device)
    tokens, layers, k = trace.shape
    if k != topk_ids.shape[1]:
        raise SettingsError(f"BIGMOE_ROUTE_REPLAY: trace has top-{k}, the model routes top-{topk_ids.shape[1]}")
    n = topk_ids.shape[0]
    rows = (torch.arange(n, device=trace.device) + cursor[moe_index]) % tokens
    cursor[moe_index : moe_index + 1].add_(n)
    return trace[:, moe_index % layers][rows].to(topk_ids.dtype)


def _replay_state(path: Path, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with _lock:
        if "trace" not in _replay:
            try:
                ids = np.load(path)["topk_ids"]
            except (OSError, KeyError, ValueError) as e:
                raise SettingsError(f"BIGMOE_ROUTE_REPLAY: cannot read {path}: {e}") from None
            _replay["trace"] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32)).to(device)
            _replay["cursor"] = torch.zeros(1024, dtype=torch.int64, device=device)  # one per MoE layer
        return _replay["trace"], _replay["cursor"]


def settings() -> PagerSettings:
    if "settings" not in _replay:
        _replay["settings"] = PagerSettings.from_env()
    return _replay["settings"]
