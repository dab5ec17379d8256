"""ReplayedPredictions.rows on the GPU: one kernel launch, and captured in a CUDA graph (alone, and on the prefetch
side stream as the vLLM adapter forks it) each replay returns the rows at the cursor's new value, wrapping at the
trace's end as the torch reference does."""

from __future__ import annotations

import pytest
import torch
from bigmoe_pager.core.prediction import LivePredictions, ReplayedPredictions, replayed_predictions

pytestmark = pytest.mark.gpu

MOE_INDEX = 4


def replay(length: int, width: int) -> ReplayedPredictions:
    g = torch.Generator().manual_seed(length + width)
    return ReplayedPredictions(torch.randint(-1, 256, (length, 6, width), generator=g, dtype=torch.int32).cuda())


def reference(found: ReplayedPredictions, cursor: torch.Tensor, tokens: int, ahead: int) -> torch.Tensor:
    start = cursor[MOE_INDEX] - tokens
    return replayed_predictions(found.predicted, start, MOE_INDEX + ahead - 1, tokens).reshape(-1)


def test_rows_launch_one_kernel():
    found = replay(37, 8)
    cursor = torch.full((16,), 5, dtype=torch.int64, device="cuda")
    found.rows(MOE_INDEX, 2, cursor)  # compiled outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        found.rows(MOE_INDEX, 2, cursor)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("length,width,tokens,ahead", [(37, 8, 1, 1), (37, 8, 4, 1), (5, 3, 3, 2)])
def test_captured_rows_follow_the_cursor(length, width, tokens, ahead, side):
    found = replay(length, width)
    cursor = torch.zeros(16, dtype=torch.int64, device="cuda")
    cursor[MOE_INDEX] = tokens
    live = LivePredictions()
    source = torch.zeros(1, device="cuda")

    def rows() -> torch.Tensor:
        if not side:
            return found.rows(MOE_INDEX, tokens, cursor, ahead)
        made = []
        live.feed_ids(lambda: made.append(found.rows(MOE_INDEX, tokens, cursor, ahead)), None, source)
        live.join(source.device)
        return made[0]

    rows()  # Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows()
    for _ in range(2 * length + 1):  # past the trace's end twice
        cursor[MOE_INDEX : MOE_INDEX + 1].add_(tokens)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference(found, cursor, tokens, ahead))


@pytest.mark.parametrize("ahead", [2, 3])
def test_captured_rows_further_ahead_read_their_own_depths_slice(ahead):
    """A trace with proposals further ahead (predicted_ids_ahead [depths, tokens, layers, P]): the kernel reads the
    depth's slice (a view at an offset into one tensor) at the replayed layer's own column, under capture too."""
    g = torch.Generator().manual_seed(ahead)
    length, width, tokens = 23, 8, 2
    nxt = torch.randint(-1, 256, (length, 6, width), generator=g, dtype=torch.int32).cuda()
    deeper = torch.randint(-1, 256, (2, length, 6, width), generator=g, dtype=torch.int32).cuda()
    found = ReplayedPredictions(nxt, deeper)
    cursor = torch.zeros(16, dtype=torch.int64, device="cuda")
    cursor[MOE_INDEX] = tokens
    found.rows(MOE_INDEX, tokens, cursor, ahead)  # Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = found.rows(MOE_INDEX, tokens, cursor, ahead)
    for _ in range(length + 1):
        cursor[MOE_INDEX : MOE_INDEX + 1].add_(tokens)
        graph.replay()
        torch.cuda.synchronize()
        start = cursor[MOE_INDEX] - tokens
        want = replayed_predictions(deeper[ahead - 2], start, MOE_INDEX, tokens).reshape(-1)
        assert torch.equal(out, want)
