"""The process's routing trace and replay: what the layers routed is written in the benchmark's trace format,
and a replay hands each layer the trace's next rows, wrapping at its end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.settings import PagerSettings, SettingsError


def test_a_recorded_trace_is_tokens_by_layers_by_k(tmp_path):
    routing = Routing(PagerSettings(enabled=True, trace_path=tmp_path / "t.npz"))
    steps = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6]])]
    for ids in steps:
        for layer in (0, 1):
            assert routing.hook(layer, ids + layer) is not None
    routing.save_trace()
    got = np.load(tmp_path / "t.npz")["topk_ids"]
    want = np.stack([torch.cat(steps).numpy() + layer for layer in (0, 1)], axis=1)
    assert got.dtype == np.int32 and np.array_equal(got, want)


def test_a_trace_is_written_again_only_when_more_was_recorded(tmp_path, monkeypatch):
    """The exit hook after an explicit save (or a second save) rewrites nothing and says nothing."""
    writes = []
    monkeypatch.setattr(np, "savez", lambda path, **arrays: writes.append(arrays["topk_ids"].shape))
    monkeypatch.setattr("pathlib.Path.replace", lambda self, target: None)
    routing = Routing(PagerSettings(enabled=True, trace_path=tmp_path / "t.npz"))
    routing.hook(0, torch.tensor([[1, 2]]))
    routing.save_trace()
    routing.save_trace()
    routing.hook(0, torch.tensor([[3, 4]]))
    routing.save_trace()
    assert writes == [(1, 1, 2), (2, 1, 2)]


def test_a_replay_hands_each_layer_the_next_rows(tmp_path):
    trace = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)  # 3 tokens, 2 layers, top-2
    np.savez(tmp_path / "r.npz", topk_ids=trace)
    routing = Routing(PagerSettings(enabled=False, route_replay=tmp_path / "r.npz"))
    router = torch.zeros((2, 2), dtype=torch.int64)
    assert torch.equal(routing.hook(1, router), torch.from_numpy(trace[[0, 1], 1]).long())
    assert torch.equal(routing.hook(1, router), torch.from_numpy(trace[[2, 0], 1]).long())  # wraps
    assert torch.equal(routing.hook(0, router[:1]), torch.from_numpy(trace[[0], 0]).long())  # own cursor


def test_a_replay_with_another_top_k_is_one_settings_line(tmp_path):
    np.savez(tmp_path / "r.npz", topk_ids=np.zeros((4, 1, 3), dtype=np.int32))
    routing = Routing(PagerSettings(enabled=False, route_replay=tmp_path / "r.npz"))
    with pytest.raises(SettingsError, match="top-3, the model routes top-2"):
        routing.hook(0, torch.zeros((1, 2), dtype=torch.int64))
