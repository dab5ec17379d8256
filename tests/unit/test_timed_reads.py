"""BIGMOE_IO_WORKERS, BIGMOE_READ_TIMEOUT_S and BIGMOE_READ_RETRIES reach the host-driven SSD tier.

A late read is issued again and the first answer wins, a read that never answers in time fails the step
in one line, at most io_workers reads run at once, and file-level retries after EIO follow the setting.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from bigmoe_pager.adapters.vllm.process import PagerProcess
from bigmoe_pager.adapters.vllm.ssd_source import LayerSource, SsdStores
from bigmoe_pager.core.host_pager import HostPager, PagerError, TierSizes
from bigmoe_pager.core.odirect import ReadError
from bigmoe_pager.core.timed_reads import ReadTimeout, TimedReads
from bigmoe_pager.settings import PagerSettings
from ssd_testkit import FakeFaultyIO, make_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "ckpt", "bf16", num_layers=2, num_experts=4, first_layer=1, shards=1)


def process(**env: str) -> PagerProcess:
    return PagerProcess(PagerSettings.from_env({"BIGMOE_PAGER": "1", **env}), on_device=False)


class Counting:
    """A RecordSource that sleeps `delay_s` per read and records how many reads ran at once."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.running = self.most = 0
        self._lock = threading.Lock()

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay_s)
            self.inner.read_record(expert, dst)
        finally:
            with self._lock:
                self.running -= 1


def test_a_late_read_is_issued_again_and_the_late_answer_never_lands(ckpt):
    store = ckpt.store(io=FakeFaultyIO(("slow",), delay_s=2.5))  # the first attempt's first read stalls 2.5 s
    reads = TimedReads(io_workers=2, read_timeout_s=0.2, read_retries=2)
    dst = torch.zeros(ckpt.layout.pitch, dtype=torch.uint8)
    start = time.monotonic()
    reads.read(LayerSource(store, 0, ckpt.layout), 2, dst)
    assert time.monotonic() - start < 2.0  # answered by the retry (a margin a loaded CI machine keeps)
    assert torch.equal(dst[: ckpt.layout.record_bytes], ckpt.reference(0, 2))
    dst.fill_(7)
    time.sleep(2.5)  # the late attempt has finished by now, into its own buffer
    assert bool((dst == 7).all())
    reads.close()


def test_a_read_that_never_answers_in_time_fails_the_step_in_one_line(ckpt):
    """BIGMOE_READ_TIMEOUT_S=0.2 and BIGMOE_READ_RETRIES=1 from the environment: two late attempts, then an error."""
    proc = process(BIGMOE_READ_TIMEOUT_S="0.2", BIGMOE_READ_RETRIES="1")
    source = Counting(LayerSource(ckpt.store(), 0, ckpt.layout), delay_s=3.0)
    pager = HostPager(ckpt.layout, TierSizes(experts=4, vram=2, ram=2), proc.host_reads(source), warm_order=[0, 1])
    for e in (0, 1):
        for name in ckpt.layout._by_name:
            pager.mark_loaded(e, name)
    start = time.monotonic()
    with pytest.raises(PagerError, match=r"no answer within 0\.2 s, 2 attempts") as e:
        pager.prepare(torch.tensor([[3]]), lambda slot, views: None)
    assert 0.35 < time.monotonic() - start < 2.5  # two 0.2 s attempts, not the 3 s reads
    assert isinstance(e.value.__cause__, ReadTimeout) and "\n" not in str(e.value)
    proc.reads.close()


def test_at_most_io_workers_reads_run_at_once(ckpt):
    proc = process(BIGMOE_IO_WORKERS="2", BIGMOE_READ_TIMEOUT_S="0.05", BIGMOE_READ_RETRIES="5")
    source = Counting(LayerSource(ckpt.store(), 0, ckpt.layout), delay_s=0.2)
    dst = torch.zeros(ckpt.layout.pitch, dtype=torch.uint8)
    proc.host_reads(source).read_record(1, dst)  # attempts pile up behind the two workers; the first answer wins
    assert source.most == 2
    assert torch.equal(dst[: ckpt.layout.record_bytes], ckpt.reference(0, 1))
    proc.reads.close()


@pytest.mark.parametrize("retries,ok", [(3, True), (2, False)])
def test_file_level_retries_follow_the_setting(ckpt, retries, ok):
    io = FakeFaultyIO()
    source = SsdStores(read_retries=retries).checkpoint_source(ckpt.root, ckpt.layout, 1, io=io)
    io.script = ["eio"] * 3  # the next three reads fail with EIO
    dst = torch.zeros(ckpt.layout.pitch, dtype=torch.uint8)
    if ok:
        source.read_record(0, dst)
        assert torch.equal(dst[: ckpt.layout.record_bytes], ckpt.reference(0, 0))
    else:
        with pytest.raises(ReadError, match="after 2 retries"):
            source.read_record(0, dst)
