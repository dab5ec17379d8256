"""SsdService, host-driven path: exact bytes in RAM slots, retries, and bounded, clear failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from bigmoe_pager.core.ssd_service import SsdError, SsdService
from ssd_testkit import FakeFaultyIO, make_checkpoint

pytestmark = pytest.mark.timeout(60)

RAM_SLOTS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=2, num_experts=6)


@pytest.fixture(scope="module")
def paging_path(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("pf") / "experts.bmpf"
    ckpt.paging_file(path).close()
    return path


@pytest.fixture(scope="module")
def compressed_path(ckpt, tmp_path_factory):
    return ckpt.compressed_paging_file(tmp_path_factory.mktemp("pfc") / "experts.bmpf")


@pytest.fixture(params=["checkpoint", "paging-file", "compressed-paging-file"])
def open_store(request, ckpt, paging_path, compressed_path):
    """A function opening the chosen store, optionally with fake I/O (a compressed paging file through the
    raw-record store both pagers read it by, which expands each record in the reading thread)."""
    if request.param == "checkpoint":
        return lambda **kw: ckpt.store(**kw)
    if request.param == "compressed-paging-file":
        return lambda **kw: ckpt.decoded_store(compressed_path, **kw)
    from bigmoe_pager.core.paging_file import PagingFileStore

    return lambda **kw: PagingFileStore(paging_path, ckpt.layout, ckpt.meta(), **kw)


def _service(ckpt, store, **kw):
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
    kw.setdefault("read_timeout_s", 5.0)
    return SsdService(store, bufs, mailbox=False, **kw), bufs


def _assert_slots(ckpt, bufs, layer, experts, slots):
    for e, s in zip(experts, slots):
        if e >= 0:
            assert torch.equal(bufs[layer][s, : ckpt.layout.record_bytes], ckpt.reference(layer, e)), (layer, e, s)


def test_load_fills_slots_exactly_and_reuses_them(ckpt, open_store):
    svc, bufs = _service(ckpt, open_store(), io_workers=3)
    with svc:
        for experts, slots in [([5, -1, 0, 3], [0, -1, 1, 3]), ([1, 2, 4, 5], [3, 0, 1, 2]), ([0], [2])]:
            svc.request(1, torch.tensor(experts), torch.tensor(slots))  # no mailbox: same as load, raises directly
            _assert_slots(ckpt, bufs, 1, experts, slots)
        svc.check()
        stats = svc.stats()
    assert stats["layers"][1]["reads"] == 3 + 4 + 1 and stats["layers"][1]["errors"] == 0
    assert stats["layers"][1]["bytes"] == 8 * ckpt.layout.record_bytes


def test_concurrent_loads_from_many_threads_are_exact(ckpt, open_store):
    svc, bufs = _service(ckpt, open_store(), io_workers=4)
    plans = [
        (layer, [(layer * 3 + r + s) % ckpt.num_experts for s in range(RAM_SLOTS)])
        for layer in range(2)
        for r in range(5)
    ]
    locks = [threading.Lock() for _ in range(ckpt.num_layers)]
    failures = []

    def run(plan):
        layer, experts = plan
        with locks[layer]:  # one load per layer at a time, as the pager does; layers in parallel
            svc.load(layer, experts, list(range(RAM_SLOTS)))
            try:
                _assert_slots(ckpt, bufs, layer, experts, range(RAM_SLOTS))
            except AssertionError as e:
                failures.append(e)

    with svc:
        threads = [threading.Thread(target=run, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures


def test_eio_fails_with_file_and_expert_named_and_stays_failed(ckpt, open_store):
    svc, _ = _service(ckpt, open_store(io=FakeFaultyIO(then="eio"), retries=1))
    with svc:
        with pytest.raises(SsdError) as e:
            svc.load(0, [2], [1])
        msg = str(e.value)
        assert "layer 0 expert 2 into RAM slot 1" in msg and "EIO" in msg and "source:" in msg and "\n" not in msg
        assert svc.failed
        with pytest.raises(SsdError, match="layer 0 expert 2"):
            svc.load(1, [0], [0])  # sticky: a failed tier never serves again
        with pytest.raises(SsdError):
            svc.check()


def test_checksum_mismatch_is_retried_then_succeeds(ckpt, paging_path):
    from bigmoe_pager.core.paging_file import PagingFileStore

    store = PagingFileStore(paging_path, ckpt.layout, ckpt.meta(), io=FakeFaultyIO(("corrupt",)))
    svc, bufs = _service(ckpt, store, read_retries=2)
    with svc:
        svc.load(0, [4], [2])
        _assert_slots(ckpt, bufs, 0, [4], [2])
        assert svc.stats()["layers"][0]["retries"] == 1


def test_persistent_checksum_mismatch_fails_and_slot_keeps_no_bad_bytes(ckpt, paging_path, tmp_path):
    from bigmoe_pager.core.paging_file import PagingFileStore

    private = tmp_path / paging_path.name  # a persistent mismatch marks the file damaged: not the shared one
    private.write_bytes(paging_path.read_bytes())
    store = PagingFileStore(private, ckpt.layout, ckpt.meta(), io=FakeFaultyIO(then="corrupt"))
    svc, bufs = _service(ckpt, store, read_retries=2)
    with svc:
        with pytest.raises(SsdError, match=r"fails its crc32 check \(after 3 attempts\)"):
            svc.load(0, [4], [2])
    assert not bufs[0][2].any()  # the bad bytes never reached the slot


def test_late_read_is_reissued_and_its_late_answer_discarded(ckpt, open_store):
    io = FakeFaultyIO(("slow",), delay_s=2.0)  # margins a loaded CI machine keeps
    svc, bufs = _service(ckpt, open_store(io=io), read_timeout_s=0.1, read_retries=2, io_workers=2)
    with svc:
        t0 = time.monotonic()
        svc.load(0, [3], [0])
        assert time.monotonic() - t0 < 1.5  # answered by the retry, not the stuck read
        _assert_slots(ckpt, bufs, 0, [3], [0])
        svc.load(0, [5], [0])  # the slot now holds another expert...
        time.sleep(2.1)  # ...when the stuck first read finally returns
        _assert_slots(ckpt, bufs, 0, [5], [0])
        assert svc.stats()["layers"][0]["retries"] == 1


def test_reads_that_never_answer_fail_in_bounded_time(ckpt, open_store):
    # reads that take 2 s against a 0.05 s timeout: a margin a loaded CI machine keeps (0.4 s did not, once in five)
    io = FakeFaultyIO(then="slow", delay_s=2.0)
    svc, _ = _service(ckpt, open_store(io=io), read_timeout_s=0.05, read_retries=1, io_workers=2)
    with svc:
        t0 = time.monotonic()
        with pytest.raises(SsdError, match="no answer within 0.05 s, 2 attempts"):
            svc.load(1, [1], [1])
        assert time.monotonic() - t0 < 1.5
    time.sleep(2.1)  # let the stuck fake reads finish before the next test


@pytest.mark.parametrize(
    "experts,slots,words",
    [
        ([1], [RAM_SLOTS], "RAM slot 4 outside 0..3"),
        ([6], [0], "expert 6 outside 0..5"),
        ([1, 2], [0, 0], "one RAM slot requested twice"),
    ],
)
def test_bad_requests_are_refused(ckpt, open_store, experts, slots, words):
    svc, _ = _service(ckpt, open_store())
    with svc, pytest.raises(SsdError, match=words):
        svc.load(0, experts, slots)


def test_ram_buffers_must_fit_records(ckpt, open_store):
    with pytest.raises(ValueError, match="records need"):
        SsdService(open_store(), [torch.zeros(2, 4096, dtype=torch.uint8)] * ckpt.num_layers, mailbox=False)
    with pytest.raises(ValueError, match="1 RAM slot buffers for a store of 2"):
        SsdService(open_store(), [torch.zeros(2, ckpt.layout.pitch, dtype=torch.uint8)], mailbox=False)


def test_feeds_the_ram_tier_as_its_ssd_fetch(ckpt, open_store):
    """RamTier.locate() over random steps: every row it returns holds the right expert's bytes."""
    from bigmoe_pager.core.ram_tier import RamTier

    tiers = [RamTier(ckpt.layout, ckpt.num_experts, RAM_SLOTS, "cpu") for _ in range(ckpt.num_layers)]
    svc = SsdService(open_store(), [t.records for t in tiers], mailbox=False, io_workers=3)
    gen = torch.Generator().manual_seed(3)
    with svc:
        for tier_layer, tier in enumerate(tiers):
            tier.attach_ssd(svc.fetcher(tier_layer))
        for step in range(12):
            layer = step % ckpt.num_layers
            experts = torch.randperm(ckpt.num_experts, generator=gen)[:3]
            rows = tiers[layer].locate(experts)
            for e, r in zip(experts.tolist(), rows.tolist()):
                assert torch.equal(tiers[layer].records[r, : ckpt.layout.record_bytes], ckpt.reference(layer, e)), (
                    step,
                    e,
                    r,
                )


def test_settings_and_pager_stats_are_honoured(ckpt, paging_path):
    """from_settings takes workers/timeouts from PagerSettings; retries and read time reach PagerStats' ssd tier."""
    from bigmoe_pager.core.paging_file import PagingFileStore
    from bigmoe_pager.core.stats import PagerStats
    from bigmoe_pager.settings import PagerSettings

    settings = PagerSettings.from_env(
        {"BIGMOE_IO_WORKERS": "3", "BIGMOE_READ_TIMEOUT_S": "2.5", "BIGMOE_READ_RETRIES": "1"}
    )
    stats = PagerStats(ckpt.num_layers)
    store = PagingFileStore(paging_path, ckpt.layout, ckpt.meta(), io=FakeFaultyIO(("corrupt",)))
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
    svc = SsdService.from_settings(
        store, bufs, settings, mailbox=False, sinks=[stats.tier(layer, "ssd") for layer in range(ckpt.num_layers)]
    )
    with svc:
        assert (svc.io_workers, svc.read_timeout_s, svc.read_retries) == (3, 2.5, 1)
        svc.load(1, [0, 1], [0, 1])
    snap = stats.snapshot(1)["ssd"]
    assert snap.retries == 1 and snap.errors == 0 and snap.read_ns > 0
