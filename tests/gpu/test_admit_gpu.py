"""The admit kernel on a real GPU: captured on a side stream in a CUDA graph and replayed, it equals the torch
admit (outputs and table state), and one call costs less than the torch formulation's ~75 small kernels."""

from __future__ import annotations

import pytest
import torch
from bigmoe_pager.core.admit_kernel import SourceRows
from bigmoe_pager.core.slots import SlotTable
from duel_testkit import duel_state  # tests/unit (on pytest's pythonpath)
from graph_timing import replay_us  # tests/gpu, beside this file

pytestmark = pytest.mark.gpu

STATE = ("expert_slot", "slot_expert", "last_use", "step", "use_count", "used_score", "wasted_score", "gate_closed")


def state(table: SlotTable) -> dict[str, torch.Tensor]:
    """The decision state both paths keep (write sinks and scratch areas are not state)."""
    got = {name: getattr(table, name) for name in STATE}
    got |= {"prefetched": table.rounds[0].prefetched[: table.num_slots], "prefetch_step": table.rounds[0].prefetch_step}
    return got | duel_state(table)


class Inputs:
    """Static device tensors a captured graph reads, refilled before each replay."""

    def __init__(self, experts: int, slots: int, tokens: int, k: int, predictions: int, device: str) -> None:
        self.experts, self.slots, self.rows = experts, slots, experts // 2
        self.ids = torch.zeros((tokens, k), dtype=torch.int32, device=device)
        self.predicted = torch.full((tokens, predictions), -1, dtype=torch.int64, device=device)
        self.available = torch.ones(experts, dtype=torch.bool, device=device)
        self.keep = torch.zeros(slots, dtype=torch.bool, device=device)
        self.expert_row = torch.full((experts,), -1, dtype=torch.int64, device=device)
        self.posted = torch.zeros(self.rows + 1, dtype=torch.int64, device=device)

    def refill(self, g: torch.Generator) -> None:
        """Routing with a hot quarter, predictions that are half right, random masks and a partial tier below."""
        e, (tokens, k) = self.experts, self.ids.shape
        hot = torch.randperm(e, generator=g)[: e // 4]
        ids = torch.stack([hot[torch.randperm(hot.numel(), generator=g)[:k]] for _ in range(tokens)])
        guess = torch.randint(0, e, self.predicted.shape, generator=g)
        guess[:, :k] = torch.where(torch.rand(tokens, k, generator=g) < 0.5, ids, guess[:, :k])
        guess[torch.rand(guess.shape, generator=g) < 0.2] = -1
        self.ids.copy_(ids)
        self.predicted.copy_(guess)
        self.available.copy_(torch.rand(e, generator=g) < 0.8)
        self.keep.copy_(torch.rand(self.slots, generator=g) < 0.2)
        row = torch.full((e,), -1, dtype=torch.int64)
        row[torch.randperm(e, generator=g)[: self.rows]] = torch.randperm(self.rows, generator=g)
        self.expert_row.copy_(row)
        posted = torch.where(torch.rand(self.rows + 1, generator=g) < 0.2, 7, 0)
        posted[-1] = 0
        self.posted.copy_(posted)

    def admit(self, table: SlotTable, masks: bool, row: torch.Tensor):
        if not masks:
            return table.admit(self.predicted, stats_row=row, record_bytes=100)
        source = SourceRows(self.expert_row, self.posted)
        return table.admit(self.predicted, self.available, row, 100, keep_slots=self.keep, source=source)


@pytest.mark.parametrize(
    "experts,slots,policy,masks,gate",
    [
        (256, 102, "lru", False, 0),
        (256, 32, "lfu-fast", True, 10),
        (512, 35, "lfu", True, 0),
        (64, 16, "lru", True, 20),
        (64, 16, "lfu-duel", True, 20),
    ],
)
def test_side_stream_admit_in_a_graph_equals_torch(experts, slots, policy, masks, gate):
    """Per replay: acquire on the main stream, admit on a side stream; the torch tables run the same eagerly.
    gate: min_used_percent; these random rounds close a strict gate on some rounds and reopen it on others."""
    tokens, k, predictions = 2, 8, 12
    opts = {"policy": policy, "min_used_percent": gate}
    ker = SlotTable(experts, slots, "cuda", use_kernel=True, **opts)
    ref = SlotTable(experts, slots, "cuda", use_kernel=False, **opts)
    rows = {name: torch.zeros(10, dtype=torch.int64, device="cuda") for name in ("ker", "ref")}
    inputs = Inputs(experts, slots, tokens, k, predictions, "cuda")
    g = torch.Generator().manual_seed(experts + slots)
    side = torch.cuda.Stream()
    out = {}

    def round_on_gpu() -> None:
        ker.acquire(inputs.ids, rows["ker"], record_bytes=100)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out["ker"] = inputs.admit(ker, masks, rows["ker"])
        torch.cuda.current_stream().wait_stream(side)

    def round_in_torch() -> None:
        ref.acquire(inputs.ids, rows["ref"], record_bytes=100)
        out["ref"] = inputs.admit(ref, masks, rows["ref"])

    for _ in range(2):  # compile outside the capture; both tables see the same rounds
        inputs.refill(g)
        round_on_gpu()
        round_in_torch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_on_gpu()
    captured = out["ker"]
    for replay in range(200):
        inputs.refill(g)
        graph.replay()
        round_in_torch()
        torch.cuda.synchronize()
        for field in ("experts", "slots", "evicted", "rows"):
            assert torch.equal(getattr(captured, field), getattr(out["ref"], field)), (replay, field)
        want, got = state(ref), state(ker)
        for name in want:
            assert torch.equal(want[name], got[name]), (replay, name)
        assert torch.equal(rows["ref"], rows["ker"]), replay
    assert int(rows["ker"][7]) > 0 and int(rows["ker"][8]) > 0  # prefetched, and some of it used
    assert (int(ker.gate_closed) > 0) == (gate > 0)  # the gated tables closed on some rounds


def _time_admits(tables: list[SlotTable], inputs: Inputs, replays: int) -> float:
    """Microseconds per admit call, every table's admit captured in one CUDA graph (as in a decode step)."""
    row = torch.zeros(10, dtype=torch.int64, device="cuda")

    def admits() -> None:
        for t in tables:
            inputs.admit(t, False, row)

    return replay_us(admits, replays) / len(tables)


def test_admit_kernel_costs_less_than_torch_admit():
    """Qwen3.6 shapes (102 of 256 slots), 40 layers: one admit call with empty predictions (recall 0, the
    H200's 140 us per layer of pure decision) and with predictions, torch ops against the kernel."""
    layers, experts, slots, replays = 40, 256, 102, 50
    inputs = Inputs(experts, slots, 1, 8, 8, "cuda")
    results = {}
    for use_kernel in (False, True):
        tables = [SlotTable(experts, slots, "cuda", use_kernel=use_kernel) for _ in range(layers)]
        for t in tables:
            t.place(torch.arange(slots))
            t.acquire(torch.arange(8, device="cuda"))
        inputs.predicted.fill_(-1)
        empty = _time_admits(tables, inputs, replays)
        inputs.refill(torch.Generator().manual_seed(1))
        guessed = _time_admits(tables, inputs, replays)
        results["kernel" if use_kernel else "torch"] = (empty, guessed)
    print(
        "one admit call (256 experts, 102 slots), empty / 8 predictions (resident after the first replay): "
        + "; ".join(f"{name} {a:.1f} / {b:.1f} us" for name, (a, b) in results.items())
    )
    assert results["kernel"][0] < results["torch"][0] and results["kernel"][1] < results["torch"][1]
