"""The replayed-rows kernel (Triton's interpreter, CPU tensors) against the torch reference, replayed_predictions;
and ReplayedPredictions.rows off CUDA keeps the torch path."""

from __future__ import annotations

import pytest
import torch
from bigmoe_pager.core import replay_kernel
from bigmoe_pager.core.prediction import ReplayedPredictions, replayed_predictions


def trace(length: int, layers: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[length, layers, width] ids in [-1, 64): -1 is padding, as in a trace's predicted_ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 64, (length, layers, width), generator=g).to(dtype)


def reference(predicted, cursor, index, offset, layer, tokens) -> torch.Tensor:
    return replayed_predictions(predicted, cursor[index] + offset, layer, tokens).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("length,layers,width", [(1, 1, 1), (5, 3, 3), (64, 4, 8)])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("layer", [0, 2, 7])
@pytest.mark.parametrize("position", ["start", "end", "past", "before"])
def test_kernel_rows_equal_the_torch_rows(dtype, length, layers, width, tokens, layer, position):
    predicted = trace(length, layers, width, dtype, seed=length * 31 + width)
    # start: first rows; end: the rows run past the trace's end; past: the cursor beyond one length;
    # before: the first row is negative (cursor - tokens at a cursor below tokens), wrapped from the end.
    value = {"start": tokens, "end": length + tokens - 1, "past": 3 * length + 2, "before": 0}[position]
    cursor = torch.zeros(8, dtype=torch.int64)
    cursor[5] = value
    got = replay_kernel.launch_replayed_rows(predicted, cursor, 5, -tokens, layer, tokens)
    want = reference(predicted, cursor, 5, -tokens, layer, tokens)
    assert got.dtype == torch.int64 and got.shape == (tokens * width,)
    assert torch.equal(got, want)


def test_many_programs_and_a_strided_trace():
    """A prefill-sized step (more ids than one program's block) over a view that skips a layer."""
    whole = trace(50, 4, 8, torch.int32, seed=3)
    predicted = whole[:, 1:]  # not contiguous: strides (32, 8, 1)
    tokens = replay_kernel.BLOCK // 8 + 37
    cursor = torch.tensor([123], dtype=torch.int64)
    got = replay_kernel.launch_replayed_rows(predicted, cursor, 0, 0, 2, tokens)
    assert torch.equal(got, reference(predicted, cursor, 0, 0, 2, tokens))


def test_the_kernel_reads_the_cursor_it_is_given_each_launch():
    predicted = trace(7, 2, 2, torch.int32, seed=1)
    cursor = torch.tensor([3], dtype=torch.int64)
    first = replay_kernel.launch_replayed_rows(predicted, cursor, 0, 0, 1, 2)
    cursor.add_(4)
    moved = replay_kernel.launch_replayed_rows(predicted, cursor, 0, 0, 1, 2)
    assert torch.equal(first, predicted[3:5, 1].reshape(-1).long())
    assert torch.equal(moved, predicted[[0, 1], 1].reshape(-1).long())  # rows 7 and 8 wrap to 0 and 1


@pytest.mark.parametrize("moe_index,tokens,ahead", [(0, 1, 1), (2, 3, 1), (1, 2, 2)])
def test_rows_off_cuda_take_the_torch_path(monkeypatch, moe_index, tokens, ahead):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was launched for CPU tensors")

    monkeypatch.setattr(replay_kernel, "launch_replayed_rows", no_kernel)
    predicted = trace(6, 3, 4, torch.int32, seed=moe_index)
    cursor = torch.tensor([5, 7, 2, 0], dtype=torch.int64)
    got = ReplayedPredictions(predicted).rows(moe_index, tokens, cursor, ahead)
    start = cursor[moe_index] - tokens
    assert torch.equal(got, replayed_predictions(predicted, start, moe_index + ahead - 1, tokens).reshape(-1))
