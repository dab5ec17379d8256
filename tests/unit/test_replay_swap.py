"""Routing.load_replay (benchmark only): one engine measures several routing traces by swapping the replayed trace
and its predictions in place, so tensors captured before the swap (as CUDA graphs capture them) read the new ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_pager.adapters.vllm.routing import Routing
from bigmoe_pager.core.prediction import ReplayedPredictions
from bigmoe_pager.settings import PagerSettings, SettingsError

TOKENS, LAYERS, K = 6, 2, 2


def write(path, seed: int, predicted: bool = True, shape=(TOKENS, LAYERS, K), ahead: int = 0):
    """A trace file; ahead: depths of proposals further ahead it also carries (predicted_ids_ahead)."""
    rng = np.random.default_rng(seed)
    arrays = {"topk_ids": rng.integers(0, 16, shape).astype(np.int32)}
    if predicted:
        arrays["predicted_ids"] = rng.integers(0, 16, shape).astype(np.int32)
    if ahead:
        arrays["predicted_ids_ahead"] = rng.integers(0, 16, (ahead, *shape)).astype(np.int32)
    np.savez(path, **arrays)
    return arrays


def started(tmp_path, predicted: bool = True, ahead: int = 0) -> Routing:
    """A replay that has run one step (its device tensors exist, as after vLLM's profile run and graph capture)."""
    write(tmp_path / "a.npz", 0, predicted, ahead=ahead)
    routing = Routing(PagerSettings(enabled=True, route_replay=tmp_path / "a.npz"))
    with torch.inference_mode():  # as vLLM runs its forwards: the replay's tensors are inference tensors
        routing.hook(0, torch.zeros((3, K), dtype=torch.int64))
        ReplayedPredictions.for_trace(routing.replay_path, torch.device("cpu"))
    return routing


@pytest.mark.parametrize("predicted", [True, False])
def test_a_swap_is_read_through_tensors_taken_before_it_from_row_0(tmp_path, predicted):
    routing = started(tmp_path, predicted)
    trace = routing._replay[0]  # the tensor a captured graph holds
    held = ReplayedPredictions.for_trace(routing.replay_path, trace.device).predicted
    new = write(tmp_path / "b.npz", 1, predicted)
    routing.load_replay(tmp_path / "b.npz")
    assert np.array_equal(trace.numpy(), new["topk_ids"])
    if predicted:
        assert np.array_equal(held.numpy(), new["predicted_ids"])
    with torch.inference_mode():  # a step, as vLLM runs it
        got = routing.hook(0, torch.zeros((2, K), dtype=torch.int64))
        proposal = routing.replayed_proposal(0, 2, trace.device)
    assert torch.equal(got, torch.from_numpy(new["topk_ids"][[0, 1], 0]).long())  # from row 0
    want = torch.from_numpy(new["predicted_ids"][[0, 1], 0]).long().reshape(-1) if predicted else None
    assert (proposal is None) if not predicted else torch.equal(proposal, want)


@pytest.mark.parametrize(
    "shape,predicted,message",
    [
        ((TOKENS + 1, LAYERS, K), True, r"is \(7, 2, 2\), the replayed trace \(6, 2, 2\)"),
        ((TOKENS, LAYERS, K), False, "carries predictions, the new one none"),
    ],
)
def test_another_shape_is_one_settings_line_and_changes_nothing(tmp_path, shape, predicted, message):
    routing = started(tmp_path)
    before = routing._replay[0].clone()
    write(tmp_path / "b.npz", 1, predicted, shape)
    with pytest.raises(SettingsError, match=message):
        routing.load_replay(tmp_path / "b.npz")
    assert torch.equal(routing._replay[0], before)


def test_a_swap_before_the_first_step_replays_the_new_file(tmp_path):
    write(tmp_path / "a.npz", 0)
    new = write(tmp_path / "b.npz", 1)
    routing = Routing(PagerSettings(enabled=True, route_replay=tmp_path / "a.npz"))
    routing.load_replay(tmp_path / "b.npz")
    got = routing.hook(1, torch.zeros((1, K), dtype=torch.int64))
    assert torch.equal(got, torch.from_numpy(new["topk_ids"][[0], 1]).long())


def test_a_swap_replaces_the_proposals_further_ahead_in_place_too(tmp_path):
    routing = started(tmp_path, ahead=2)
    held = ReplayedPredictions.for_trace(routing.replay_path, torch.device("cpu")).ahead
    new = write(tmp_path / "b.npz", 1, ahead=2)
    routing.load_replay(tmp_path / "b.npz")
    assert np.array_equal(held.numpy(), new["predicted_ids_ahead"])
    with torch.inference_mode():
        routing.hook(0, torch.zeros((2, K), dtype=torch.int64))
        proposal = routing.replayed_proposal(0, 2, torch.device("cpu"), ahead=2)
    assert torch.equal(proposal, torch.from_numpy(new["predicted_ids_ahead"][0, [0, 1], 0]).long().reshape(-1))


@pytest.mark.parametrize(
    "held,new,message",
    [(2, 0, "carries predictions further ahead, the new one none"), (0, 2, "no predictions further ahead")],
)
def test_a_swap_that_adds_or_drops_proposals_further_ahead_is_refused_and_changes_nothing(tmp_path, held, new, message):
    routing = started(tmp_path, ahead=held)
    before = routing._replay[0].clone()
    write(tmp_path / "b.npz", 1, ahead=new)
    with pytest.raises(SettingsError, match=message):
        routing.load_replay(tmp_path / "b.npz")
    assert torch.equal(routing._replay[0], before)
