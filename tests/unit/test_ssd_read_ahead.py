"""SSD read-ahead (BIGMOE_SSD_READ_AHEAD): predicted experts' SSD reads are posted through the mailbox
without a wait; the step that needs one waits for the rest of that read only and never reads it again.
Runs the real SSD service and its mailbox kernels in Triton's interpreter, the device-driven layer
pager on CPU tensors: what each step reads must be bit-identical with read-ahead on and off."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from bigmoe_bench import traces
from bigmoe_pager.core import ssd_mailbox as mb
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_pager import TierSizes
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.ram_tier import RamTier, RamTierError
from bigmoe_pager.core.ssd_service import SsdError, SsdService
from bigmoe_pager.core.stats import PagerStats
from ssd_testkit import NEEDS_INTERPRETER, FakeFaultyIO, loaded_layers, make_checkpoint

pytestmark = [
    NEEDS_INTERPRETER,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

EXPERTS, LAYERS, K = 10, 2, 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=LAYERS, num_experts=EXPERTS)


def wanted(ckpt, layer: int, expert: int) -> torch.Tensor:
    """The bytes a slot holding `expert` must present to the MoE kernel (its components, in order)."""
    ref = ckpt.reference(layer, expert)
    return torch.cat([ref[c.offset : c.offset + c.nbytes] for c in ckpt.layout.components])


def slot_bytes(pager: DeviceLayerPager, slot: int) -> torch.Tensor:
    return torch.cat([pager.buffers[c.name][slot].reshape(-1).view(torch.uint8) for c in pager.layout.components])


def build(ckpt, vram: int, ram: int, read_ahead: bool, io=None, service_read_ahead=None, store=None, **service):
    """Both layers' pagers, loaded as the engine loads them, over one SSD service (mailbox, interpreter) reading
    `store` (default: the checkpoint)."""
    stats = PagerStats(LAYERS)
    pagers = loaded_layers(ckpt, TierSizes(EXPERTS, vram, ram), "cpu", stats, read_ahead=read_ahead)
    service.setdefault("read_timeout_s", 5.0)
    svc = SsdService(
        store or ckpt.store(io=io, retries=1),
        [p.ram.records for p in pagers],
        mailbox=True,
        read_ahead=read_ahead if service_read_ahead is None else service_read_ahead,
        max_requests=8,
        io_workers=2,
        sinks=[stats.tier(layer, "ssd") for layer in range(LAYERS)],
        **service,
    )
    try:
        for layer, p in enumerate(pagers):
            p.start(ckpt.layout.slot_buffers(vram, "cpu"), svc.fetcher(layer))
    except Exception:
        svc.close()
        raise
    return pagers, svc, stats


def routing(steps: int, accuracy: float, seed: int):
    """ids[t][l] ([1, K]) and predictions pred[t][l] ([K + 2]): each true expert kept with probability
    `accuracy`, the rest of the row wrong guesses or -1 (fixed shape, as a predictor's output)."""
    rng = random.Random(seed)
    hot = rng.sample(range(EXPERTS), 5)
    ids = [[rng.sample(hot if rng.random() < 0.6 else range(EXPERTS), K) for _ in range(LAYERS)] for _ in range(steps)]
    pred = []
    for t in range(steps):
        row = []
        for layer in range(LAYERS):
            right = [e for e in ids[t][layer] if rng.random() < accuracy]
            wrong = [e for e in rng.sample(range(EXPERTS), 3) if e not in ids[t][layer]][: K + 2 - len(right)]
            row.append(torch.tensor((right + wrong + [-1] * (K + 2))[: K + 2], dtype=torch.int64))
        pred.append(row)
    return [[torch.tensor([i], dtype=torch.int32) for i in per_layer] for per_layer in ids], pred


def decode(ckpt, pagers, svc, ids, pred, read_ahead: bool) -> list[list[torch.Tensor]]:
    """Token by token: layer 1's reads posted while layer 0 steps (two layers' distance at L = 2), each
    layer's next step prefetched after its step. Returns, per step and layer, the bytes the kernel reads."""
    seen = []
    for t, per_layer in enumerate(ids):
        row = []
        for layer, step_ids in enumerate(per_layer):
            if read_ahead and layer == 0:
                pagers[1].read_ahead(pred[t][1])
            remapped = pagers[layer].step(step_ids)
            svc.check()
            got = [slot_bytes(pagers[layer], s) for s in remapped.reshape(-1).tolist()]
            for expert, data in zip(step_ids.reshape(-1).tolist(), got):
                assert torch.equal(data, wanted(ckpt, layer, expert)), (t, layer, expert)
            row.append(torch.stack(got))
            if t + 1 < len(ids):
                pagers[layer].prefetch(pred[t + 1][layer])
        seen.append(row)
    return seen


@pytest.mark.parametrize("accuracy", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("vram,ram", [(2, 4), (3, 6), (4, 4)])
def test_steps_read_the_same_bytes_with_read_ahead_on_and_off(ckpt, vram, ram, accuracy):
    ids, pred = routing(8, accuracy, seed=vram * 10 + ram + int(accuracy * 7))
    runs, counts = {}, {}
    for on in (False, True):
        pagers, svc, stats = build(ckpt, vram, ram, on)
        with svc:
            runs[on] = decode(ckpt, pagers, svc, ids, pred, on)
            svc.check()
            ram_row = stats.snapshot()["ram"]
            reads = _reads_settled(svc, ram_row.misses + ram_row.prefetched)  # posted reads nobody waited for
            counts[on] = (ram_row, reads)
            for p in pagers:
                got = p.counters(stats.read())["ssd"]
                assert got.bytes_moved == got.lookups * ckpt.layout.record_bytes
    for a, b in zip(runs[False], runs[True]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    ram_on, reads_on = counts[True]
    assert reads_on <= ram_on.misses + ram_on.prefetched  # one read per demand miss or posted read, at most
    assert counts[False][0].prefetched == 0 and counts[False][1] == counts[False][0].misses
    if accuracy == 1.0:
        assert ram_on.misses < counts[False][0].misses  # read ahead, not on demand
        assert ram_on.prefetch_used > 0
    if accuracy == 0.0:
        assert ram_on.prefetch_used == 0


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_device_driven_pager_reads_a_compressed_paging_file(ckpt, tmp_path, read_ahead):
    """The steps the CUDA graphs replay, over an SSD tier of codec records: each read record is expanded by the
    reader thread before it enters its RAM row, so the kernel reads the checkpoint's bytes."""
    store = ckpt.decoded_store(ckpt.compressed_paging_file(tmp_path / "experts.bmpf"))
    assert store.inner.codec != "raw"
    ids, pred = routing(6, 0.6, seed=5)
    pagers, svc, stats = build(ckpt, 2, 4, read_ahead, store=store)
    with svc:
        decode(ckpt, pagers, svc, ids, pred, read_ahead)  # asserts every slot's bytes
        svc.check()
        ssd = stats.snapshot()["ssd"]
    assert ssd.lookups > 0 and ssd.errors == 0


def _reads_settled(svc: SsdService, expected: int, within_s: float = 10.0) -> int:
    """Reads completed by the service once `expected` are in (or the time is up)."""
    deadline = time.monotonic() + within_s
    while True:
        reads = sum(c["reads"] for c in svc.stats()["layers"])
        if reads >= expected or time.monotonic() > deadline:
            return reads
        time.sleep(0.01)


def test_a_slow_posted_read_is_waited_for_by_the_step_and_never_read_again(ckpt):
    """A step needing experts whose posted reads are still under way waits for those reads (it never requests them
    again) and writes their seqs into their hurry words, so the host takes them before other reads ahead."""
    io = FakeFaultyIO(then="slow", delay_s=2.0)  # margins a loaded CI machine keeps
    pagers, svc, stats = build(ckpt, 2, 4, True, io=io)
    layer = pagers[1]
    cold = [e for e in range(EXPERTS) if layer.ram_slot_for_load(e) is None][:2]
    with svc:
        layer.step(torch.tensor([layer.order[:1]], dtype=torch.int32))  # after start every RAM row is "latest"
        t0 = time.monotonic()
        layer.read_ahead(torch.tensor(cold + [-1, -1]))
        assert time.monotonic() - t0 < 1.5  # posted, not waited for
        posted = layer.ram.posted.clone()
        assert bool((posted != 0).any())
        remapped = layer.step(torch.tensor([cold], dtype=torch.int32))
        assert time.monotonic() - t0 >= 1.9  # the step waited for the rest of the reads
        svc.check()
        rows = torch.nonzero(posted).reshape(-1).tolist()  # the step told the host which reads it waited for
        hurry = mb.hurry_base(svc.entries) + svc.post_base[1]
        assert [int(svc.box[hurry + r]) for r in rows] == [int(posted[r]) for r in rows]
        for expert, slot in zip(cold, remapped.reshape(-1).tolist()):
            assert torch.equal(slot_bytes(layer, slot), wanted(ckpt, 1, expert))
        assert svc.stats()["layers"][1]["reads"] == len(cold)  # one read each: the step requested none again
        assert not bool((layer.ram.posted != 0).any())  # confirmed by the step
    ram = stats.snapshot(1)["ram"]
    assert ram.misses == 0 and ram.hits == len(cold) and ram.prefetched == len(cold)


def test_a_read_ahead_that_a_vram_prefetch_copied_on_counts_as_used(ckpt):
    """Read several layers ahead, a read lands before the layer before its own prefetches; that prefetch copies the
    expert into VRAM and the step hits there. The read served the step: the RAM tier's gate must count it used."""
    pagers, svc, stats = build(ckpt, 2, 4, True)
    layer = pagers[1]
    cold = next(e for e in range(EXPERTS) if layer.ram_slot_for_load(e) is None)
    with svc:
        layer.step(torch.tensor([layer.order[:1]], dtype=torch.int32))
        layer.read_ahead(torch.tensor([cold, -1]))  # as a layer four ahead posts it
        deadline = time.monotonic() + 10
        while not bool(layer.ram.complete()[cold]) and time.monotonic() < deadline:
            time.sleep(0.01)
            layer.read_ahead(torch.tensor([-1, -1]))  # settles landed reads; the same round (no step since)
        layer.prefetch(torch.tensor([cold, -1]))  # the layer before's: copies the whole row into VRAM
        assert int(layer.pager.vram.expert_slot[cold]) >= 0
        remapped = layer.step(torch.tensor([[cold]], dtype=torch.int32))
        svc.check()
        assert torch.equal(slot_bytes(layer, int(remapped.reshape(-1)[0])), wanted(ckpt, 1, cold))
        layer.read_ahead(torch.tensor([-1, -1]))  # the next round judges this one
    ram, vram = stats.snapshot(1)["ram"], stats.snapshot(1)["vram"]
    assert vram.hits >= 1 and ram.prefetched == 1
    assert ram.prefetch_used == 1 and ram.prefetch_wasted_bytes == 0


LAYOUT_SMALL = ExpertLayout.for_moe(64, 32, torch.float8_e4m3fn, block=32)


class FakePostingSsd:
    """An SSD tier for a RamTier alone: posted reads stay in flight until finish_all(); a record's bytes = its id."""

    can_post = True

    def __init__(self, tier: RamTier) -> None:
        self.tier, self.posts, self.demand, self._inflight = tier, [], [], {}

    def fetch(self, experts, slots, wait_rows=None, posted=None) -> None:
        for e, s in zip(experts.tolist(), slots.tolist()):
            if e >= 0:
                self.demand.append(e)
                self.tier.records[s].fill_(e)
        for row in [] if wait_rows is None else wait_rows.tolist():
            if row >= 0 and int(posted[row]):
                self._land(row)
                posted[row] = 0

    def post(self, experts, slots, posted) -> None:
        batch = [(e, s) for e, s in zip(experts.tolist(), slots.tolist()) if e >= 0]
        self.posts.append([e for e, _ in batch])
        for e, s in batch:
            self._inflight[s] = e
            posted[s] = 1

    def settle(self, posted) -> None:
        for row in [r for r, e in self._inflight.items() if e is None]:
            posted[row] = 0
            del self._inflight[row]

    def finish_all(self) -> None:
        for row in list(self._inflight):
            self._land(row)

    def _land(self, row: int) -> None:
        if self._inflight.get(row) is not None:
            self.tier.records[row].fill_(self._inflight[row])
        self._inflight[row] = None


def test_wrong_predictions_never_take_rows_a_step_used_or_rows_with_posted_reads():
    tier = RamTier(LAYOUT_SMALL, 12, 4, read_ahead=True)
    tier.table.min_used_percent = 0  # no prefetch gate: its wasted first read-ahead would close it (test_prefetch_gate)
    ssd = FakePostingSsd(tier)
    tier.attach_ssd(ssd)
    tier.locate(torch.tensor([0, 1]))  # rows 0, 1
    tier.read_ahead(torch.tensor([5, -1]))  # row 2, its read in flight
    tier.locate(torch.tensor([0, 1]))  # a step since: row 2 is no longer "latest", only its posted read keeps it
    rows = {e: int(tier.table.expert_slot[e]) for e in (0, 1, 5)}
    tier.read_ahead(torch.tensor([7, 8, 9, 10, 11]))  # all wrong; only the empty row is theirs
    assert {e: int(tier.table.expert_slot[e]) for e in (0, 1, 5)} == rows
    assert sorted(tier.table.slot_expert.tolist()) == [0, 1, 5, 7]
    assert ssd.posts == [[5], [7]] and ssd.demand == [0, 1]  # 0, 1 read once, on demand; nothing read twice
    assert not bool(tier.complete()[5]) and not bool(tier.complete()[7])  # VRAM prefetch leaves them alone
    ssd.finish_all()
    tier.locate(torch.tensor([0, 1]))
    tier.read_ahead(torch.tensor([9, -1]))  # settled: 5's row (the oldest unneeded) may go now; 0, 1 may not
    assert sorted(tier.table.slot_expert.tolist()) == [0, 1, 7, 9]
    rows = tier.locate(torch.tensor([7, 9]))  # 9's posted read is waited for by the step that needs it
    assert [int(tier.records[r, 0]) for r in rows.tolist()] == [7, 9] and ssd.demand == [0, 1]


def test_a_failing_posted_read_surfaces_through_check_and_the_step_is_flagged(ckpt):
    pagers, svc, _ = build(ckpt, 2, 4, True, io=FakeFaultyIO(then="eio"))
    layer = pagers[0]
    cold = next(e for e in range(EXPERTS) if layer.ram_slot_for_load(e) is None)
    with svc:
        layer.step(torch.tensor([layer.order[:1]], dtype=torch.int32))  # after start every RAM row is "latest"
        layer.read_ahead(torch.tensor([cold, -1]))
        t0 = time.monotonic()
        layer.step(torch.tensor([[cold]], dtype=torch.int32))
        assert time.monotonic() - t0 < 5  # the host's error ends the wait, not the GPU's deadline
        assert int(svc.box[mb.GPU_ERROR]) == mb.GPU_SAW_HOST_ERROR
        with pytest.raises(SsdError, match=rf"layer 0 expert {cold} into RAM slot \d+ failed: ReadError.*EIO"):
            svc.check()
        row = int(layer.ram.table.expert_slot[cold])
        assert int(layer.ram.posted[row]) != 0  # never confirmed: no later VRAM prefetch copies that row
        assert not bool(layer.ram.complete()[cold])


def test_a_step_taking_a_posted_rows_slot_supersedes_the_read(ckpt):
    """The step's own read of a row wins over a slower posted read of another expert into it."""
    bufs = [torch.zeros(4, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(LAYERS)]
    io = FakeFaultyIO(("slow",), delay_s=0.8)
    svc = SsdService(ckpt.store(io=io), bufs, mailbox=True, read_ahead=True, max_requests=8, io_workers=2)
    posted = torch.zeros(5, dtype=torch.int64)
    with svc:
        svc.post(0, torch.tensor([3]), torch.tensor([1]), posted)
        assert int(posted[1]) != 0
        posted[1] = 0  # the step took row 1 for another expert (RamTier.locate clears it)
        svc.request(0, torch.tensor([5]), torch.tensor([1]), torch.tensor([1]), posted)
        svc.check()
        assert torch.equal(bufs[0][1, : ckpt.layout.record_bytes], ckpt.reference(0, 5))
        time.sleep(1.0)  # the posted read of expert 3 finishes now: it must not land
        assert torch.equal(bufs[0][1, : ckpt.layout.record_bytes], ckpt.reference(0, 5))
        svc.check()


def test_read_ahead_needs_a_service_that_posts_and_is_off_by_default(ckpt):
    from bigmoe_pager.settings import PagerSettings

    assert PagerSettings().ssd_read_ahead is False
    assert PagerSettings.from_env({"BIGMOE_SSD_READ_AHEAD": "1"}).ssd_read_ahead is True
    with pytest.raises(RamTierError, match="can post reads"):
        build(ckpt, 2, 4, True, service_read_ahead=False)
    pagers, svc, _ = build(ckpt, 2, 4, False)
    with svc:
        with pytest.raises(RamTierError, match="built without read-ahead"):
            pagers[0].read_ahead(torch.tensor([9, -1]))
        with pytest.raises(ValueError, match="read_ahead=True"):
            svc.post(0, torch.tensor([9]), torch.tensor([0]), torch.zeros(5, dtype=torch.int64))
    tier = RamTier(ckpt.layout, EXPERTS, 4, read_ahead=True)
    tier.attach_ssd(FetchOnly())
    tier.table.acquire(torch.tensor([1]))
    before = tier.table.slot_expert.clone()
    with pytest.raises(RamTierError, match="post reads"):
        tier.read_ahead(torch.tensor([9]))
    assert torch.equal(tier.table.slot_expert, before)  # refused before any row was given away


class FetchOnly:
    """An SSD tier that can only fetch (no read-ahead)."""

    def fetch(self, experts, slots) -> None:
        raise AssertionError("not reached")


def test_admits_with_no_step_between_are_one_round_for_the_counters():
    """Reads posted several layers ahead, then the layer's own prefetch, before its step: one round."""
    from bigmoe_pager.core.slots import SlotTable

    table, row = SlotTable(16, 6, prefetch_budget=0), torch.zeros(10, dtype=torch.int64)
    table.acquire(torch.tensor([0, 1]))
    table.admit(torch.tensor([4, 5]), stats_row=row, record_bytes=10)  # posted ahead
    table.admit(torch.tensor([4, 5, 6]), stats_row=row, record_bytes=10)  # the prefetch: only 6 is new
    table.acquire(torch.tensor([4, 6]))  # 4 and 6 were needed, 5 was not
    table.admit(torch.tensor([-1]), stats_row=row, record_bytes=10)  # judges the round
    from bigmoe_pager.core.stats import COUNTERS

    names = ("prefetched", "prefetch_used", "prefetch_wasted_bytes")
    prefetched, used, wasted = (int(row[COUNTERS.index(n)]) for n in names)
    assert (prefetched, used, wasted) == (3, 2, 10)


def disk_reads(family: str, recall: float | None, gate: int | None = None, tokens: int = 300) -> tuple[int, int]:
    """(reads posted ahead, reads on demand) of one RAM tier (27 of 64 experts, the reference job's 42% share) over
    `tokens` of a routing family, its reads posted ahead from a top-k predictor at `recall` whose wrong ids are cold
    (None: no read-ahead); `gate`: the read-ahead gate's threshold, None: the pager's."""
    trace = traces.named_trace(family, tokens, 2, 64, 8, 0)[:tokens, :2]
    tier = RamTier(LAYOUT_SMALL, 64, 27, read_ahead=recall is not None)
    if gate is not None:
        tier.table.min_used_percent = gate
    ssd = FakePostingSsd(tier)
    tier.attach_ssd(ssd)
    pred = None if recall is None else traces.predictions(trace, recall, None, 64, 0, "uniform")
    for t in range(tokens):
        if pred is not None:
            tier.read_ahead(torch.from_numpy(pred[t, 0].astype(np.int64)))  # layer 0 proposes layer 1's experts
        tier.locate(torch.from_numpy(trace[t, 1].astype(np.int64)))
        ssd.finish_all()  # a token's reads land before the next token's
    return sum(len(p) for p in ssd.posts), len(ssd.demand)


@pytest.mark.parametrize("family", ["standard", "topic-shift"])
def test_reads_ahead_that_are_mostly_wasted_stop_costing_disk_reads(family):
    """Where the disk sets the pace a wasted read costs what a used one saves at most (run 56): a predictor with half
    its ids wrong soon stops posting, and the disk reads about what it reads with no read-ahead at all."""
    posted, demand = disk_reads(family, 0.5)
    ungated, _ = disk_reads(family, 0.5, gate=0)
    _, alone = disk_reads(family, None)
    assert posted < 0.1 * ungated
    assert posted + demand <= 1.1 * alone


@pytest.mark.parametrize("family", ["standard", "topic-shift", "near-uniform", "recorded"])
def test_reads_ahead_that_are_right_keep_every_need_off_the_demand_path(family):
    posted, demand = disk_reads(family, 1.0)
    _, alone = disk_reads(family, None)
    assert demand == 0 and posted == alone  # each read posted ahead, none twice, none wasted
