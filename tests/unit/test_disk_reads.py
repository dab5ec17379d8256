"""bigmoe_bench.disk_reads.read_records: the benchmarks' timed O_DIRECT reads of expert records on a few threads."""

from __future__ import annotations

import time

import pytest
from bigmoe_bench.disk_reads import read_records
from bigmoe_pager.core.odirect import ReadError
from ssd_testkit import SHAPES, FakeFaultyIO, make_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), sorted(SHAPES)[0])


@pytest.mark.parametrize("workers", [1, 3])
def test_every_key_is_read_once_without_a_deadline(ckpt, workers):
    keys = [(l, e) for l in range(ckpt.num_layers) for e in range(ckpt.num_experts)]
    with ckpt.store() as store:
        assert read_records(store, keys, workers) == len(keys)
        assert store.counters.snapshot()["errors"] == 0


def test_a_past_deadline_reads_nothing(ckpt):
    with ckpt.store() as store:
        assert read_records(store, [(0, 0)] * 8, 2, deadline=time.monotonic() - 1) == 0


def test_a_failed_read_is_raised_on_the_callers_thread(ckpt):
    with ckpt.store(io=FakeFaultyIO(then="eio"), retries=1) as store, pytest.raises(ReadError):
        read_records(store, [(0, 0), (0, 1)], 2)
