"""The fused prefetch (decide + copy in one launch, run by Triton's interpreter here) equals SlotTable.admit
followed by copy_records, both the torch reference and the two-launch kernel path: outputs, table state, counters
and slot bytes after every call, over rounds of steps and admits."""

from __future__ import annotations

import random

import pytest
import torch
from bigmoe_pager.core import prefetch_kernel
from bigmoe_pager.core.copy_kernel import copy_records_torch, copy_records_triton
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.pager import ExpertPager
from bigmoe_pager.core.ram_tier import RamTier
from bigmoe_pager.core.slots import SlotTable
from duel_testkit import shifting_ids
from test_admit_kernel import RowsFromRecords, state

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds

LAYOUT = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
ADMITTED = ("experts", "slots", "evicted", "rows")
RECORD_BYTES = LAYOUT.record_bytes  # what the counters charge per copied expert (the fused launch charges this)
PATHS = ("torch", "two-launch", "fused")


def records(experts: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (experts, LAYOUT.pitch), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


class Layer:
    """One table, its slot buffers and its counters, prefetched along one of PATHS."""

    def __init__(self, path: str, experts: int, slots: int, policy: str, gate: int, programs: int, block: int):
        self.path, self.programs, self.block = path, programs, block
        decay = 3 if policy == "lfu" else None
        self.table = SlotTable(
            experts, slots, use_kernel=path != "torch", policy=policy, decay=decay, min_used_percent=gate
        )
        self.buffers = LAYOUT.slot_buffers(slots, "cpu")
        for b in self.buffers.values():
            b.view(slots, -1).view(torch.uint8).fill_(0xA5)  # bytes no copy wrote stay recognisable
        self.row = torch.zeros(10, dtype=torch.int64)

    def prefetch(self, predicted: torch.Tensor, rec: torch.Tensor) -> dict[str, torch.Tensor]:
        t = self.table
        if self.path == "fused":
            return prefetch_kernel.launch_prefetch(
                t.admit_state(),
                predicted,
                t.num_experts,
                t.num_slots,
                t.miss_capacity(predicted.numel()),
                rec,
                LAYOUT,
                self.buffers,
                programs_per_record=self.programs,
                stats_row=self.row,
                lfu=t.lfu,
                min_used_percent=t.min_used_percent,
                block_bytes=self.block,
            )
        got = t.admit(predicted, stats_row=self.row, record_bytes=RECORD_BYTES)
        if self.path == "torch":
            copy_records_torch(rec, got.rows, got.slots, LAYOUT, self.buffers)
        else:
            copy_records_triton(rec, got.rows, got.slots, LAYOUT, self.buffers, self.block, self.programs)
        return {name: getattr(got, name) for name in ADMITTED}

    def step(self, ids: torch.Tensor, rec: torch.Tensor) -> None:
        got = self.table.acquire(ids, self.row, record_bytes=RECORD_BYTES)
        copy_records_torch(rec, got.miss_experts, got.miss_slots, LAYOUT, self.buffers)

    def slot_bytes(self) -> dict[str, torch.Tensor]:
        return {n: b.view(b.shape[0], -1).view(torch.uint8) for n, b in self.buffers.items()}


def proposal(rng: random.Random, experts: int, ids: list[list[int]], width: int) -> torch.Tensor:
    """Predictions for the next step [tokens, width]: some of its ids, some wrong, duplicates and -1 padding; now
    and then an invalid id, all -1 (recall 0) or no predictions at all."""
    roll = rng.random()
    if roll < 0.08:
        return torch.empty(0, dtype=torch.int64)
    if roll < 0.16:
        return torch.full((len(ids), width), -1, dtype=torch.int64)
    rows = []
    for row in ids:
        guess = [e for e in row if rng.random() < 0.6] + rng.sample(range(experts), 3)
        if rng.random() < 0.3:
            guess.append(guess[0])
        if rng.random() < 0.1:
            guess.append(experts + 5)
        rows.append((guess + [-1] * width)[:width])
    return torch.tensor(rows, dtype=torch.int64)


def assert_same(ref: Layer, other: Layer, what: str) -> None:
    want, got = state(ref.table), state(other.table)
    for name in want:
        assert torch.equal(want[name], got[name]), (what, other.path, name)
    assert torch.equal(ref.row, other.row), (what, other.path, ref.row.tolist(), other.row.tolist())
    want, got = ref.slot_bytes(), other.slot_bytes()
    for name in want:
        assert torch.equal(want[name], got[name]), (what, other.path, name)


@pytest.mark.parametrize(
    "experts,slots,tokens,width,policy,gate,programs,block",
    [
        (24, 6, 1, 8, "lru", 0, 16, 8192),  # the pager's copy grid: 16 programs per expert (fewer blocks)
        (40, 10, 2, 6, "lru", 60, 3, 512),
        (32, 32, 1, 8, "lru", 100, 2, 1024),  # every expert has a slot; a strict gate stays closed once it wasted
        (30, 12, 2, 5, "lfu", 60, 0, 1024),  # one program per block
        (64, 16, 1, 10, "lfu-fast", 0, 4, 256),
        (64, 16, 2, 6, "lfu-duel", 60, 2, 2048),
        (40, 8, 1, 8, "lfu-duel", 100, 1, 8192),
    ],
)
def test_fused_prefetch_equals_admit_then_copy(experts, slots, tokens, width, policy, gate, programs, block):
    """Three layers fed the same rounds (a step, then one or two admits with no step between): each admit's lists,
    the whole table state, the counters and every slot byte agree; the sync words are 0 after every launch."""
    rng = random.Random(experts * 31 + slots + gate)
    rec = records(experts, seed=experts)
    layers = [Layer(p, experts, slots, policy, gate, programs, block) for p in PATHS]
    ref, *others = layers
    hot = rng.sample(range(experts), max(8, experts // 3))
    admits = 0
    for t in range(14):
        if ref.table.duel:
            ids = shifting_ids(rng, experts, tokens, 4, 20 * t)
        else:
            ids = [rng.sample(hot if rng.random() < 0.7 else range(experts), 4) for _ in range(tokens)]
        for layer in layers:
            layer.step(torch.tensor(ids, dtype=torch.int32), rec)
        for layer in others:
            assert_same(ref, layer, f"step {t}")
        nxt = [rng.sample(hot, 4) for _ in range(tokens)]
        for _ in range(1 + (t % 5 == 3)):
            guess = proposal(rng, experts, nxt, width)
            outs = [layer.prefetch(guess, rec) for layer in layers]
            admits += 1
            for layer, out in zip(others, outs[1:]):
                for name in ADMITTED:
                    assert torch.equal(outs[0][name], out[name]), (t, layer.path, name)
                assert_same(ref, layer, f"admit {t}")
            assert layers[-1].table.admit_state()["sync"].tolist() == [0, 0, 0]  # reset for the next launch
    copied, closed = int(ref.row[7]), int(ref.table.gate_closed)
    assert copied > 0  # some admits copied: the bytes were compared, not only the empty lists
    if gate == 0:
        assert closed == 0
    else:
        assert 0 < closed < admits  # the gate closed on some rounds: closed rounds were compared too


def make_pager(experts: int, slots: int, rows: int, fused_prefetch: bool | None, rec: torch.Tensor) -> ExpertPager:
    ram = RamTier(LAYOUT, experts, rows)
    if rows == experts:
        ram.load_all(rec)
    else:
        ram.attach_ssd(RowsFromRecords(ram, rec))
    return ExpertPager(LAYOUT, experts, slots, ram, fused_prefetch=fused_prefetch, prefetch_gate=0)


@pytest.mark.parametrize("policy", ["lru", "lfu-duel"])
def test_pager_prefetch_takes_the_fused_launch_only_when_asked_and_changes_nothing(policy, monkeypatch):
    """ExpertPager.prefetch with fused_prefetch=True (one launch) leaves what the default CPU path (torch admit +
    copy) leaves; with fused_prefetch off the fused launch is never called."""
    experts, slots = 32, 8
    rec = records(experts, seed=3)
    calls = []
    launch = prefetch_kernel.launch_prefetch
    monkeypatch.setattr(prefetch_kernel, "launch_prefetch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    fused, plain = make_pager(experts, slots, experts, True, rec), make_pager(experts, slots, experts, None, rec)
    assert plain.fused_prefetch is False  # the CPU default: the table decides with torch ops
    rng = random.Random(7)
    for t in range(8):
        guess = torch.tensor([rng.sample(range(experts), 6) + [-1, -1]])
        a, b = plain.prefetch(guess), fused.prefetch(guess)
        for name in ADMITTED:
            assert torch.equal(getattr(a, name), getattr(b, name)), (t, name)
        ids = torch.tensor([rng.sample(range(experts), 4)])
        assert torch.equal(plain.acquire(ids).remapped, fused.acquire(ids).remapped)
        assert torch.equal(state(plain.vram)["slot_expert"], state(fused.vram)["slot_expert"])
        for name, buf in plain.buffers.items():
            assert torch.equal(buf.view(torch.uint8), fused.buffers[name].view(torch.uint8)), (t, name)
    assert len(calls) == 8


def test_pager_keeps_two_launches_over_a_partial_ram_tier(monkeypatch):
    """A partial RAM tier (record row != expert id) never takes the fused launch, even when asked for it: its
    prefetch still copies each expert from the row that holds it."""
    monkeypatch.setattr(prefetch_kernel, "launch_prefetch", lambda *a, **k: pytest.fail("fused launch called"))
    rec = records(32, seed=1)
    pager = make_pager(32, 8, 16, True, rec)
    for ids in ([[9, 10, 11, 12, 13, 14, 15, 16]], [[20, 21, 22, 23]]):
        pager.acquire(torch.tensor(ids))  # RAM holds both sets, VRAM 13..16 and 20..23
    got = pager.prefetch(torch.tensor([10, 12, 31]))
    assert got.experts.tolist() == [10, 12, -1]  # 31 is in no RAM row
    assert got.rows.tolist()[:2] == pager.ram.table.expert_slot[[10, 12]].tolist() != [10, 12]
    for expert, slot in zip(got.experts.tolist()[:2], got.slots.tolist()[:2]):
        for c in LAYOUT.components:
            flat = pager.buffers[c.name].view(8, -1).view(torch.uint8)
            assert torch.equal(flat[slot], rec[expert, c.offset : c.offset + c.nbytes]), (expert, c.name)


def test_shapes_it_does_not_take_are_refused():
    layout = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)
    assert prefetch_kernel.fits(16, layout)
    assert not prefetch_kernel.fits(prefetch_kernel.MAX_SLOTS + 1, layout)
    table = SlotTable(32, 8)
    with pytest.raises(prefetch_kernel.PrefetchKernelError):
        prefetch_kernel.launch_prefetch(
            table.admit_state(),
            torch.tensor([1]),
            32,
            8,
            1,
            records(32, seed=0),
            LAYOUT,
            LAYOUT.slot_buffers(8, "cpu"),
            programs_per_record=-1,
        )
