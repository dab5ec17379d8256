"""O_DIRECT reads: exact bytes for aligned and unaligned ranges, and one clear error per fault."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from bigmoe_pager.core.odirect import ALIGN, DirectFile, ODirectError, ReadError, aligned_empty, odirect_works
from ssd_testkit import FakeFaultyIO

pytestmark = pytest.mark.timeout(30)

FILE_BYTES = 5 * ALIGN + 1234  # not a multiple of the block size: the last block is partial


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, FILE_BYTES, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return path, data


@pytest.mark.parametrize(
    "offset,length",
    [
        (0, ALIGN),
        (ALIGN, 2 * ALIGN),
        (1, 10),
        (ALIGN - 3, 7),
        (100, 3 * ALIGN + 5),
        (FILE_BYTES - 17, 17),
        (0, FILE_BYTES),
    ],
)
@pytest.mark.parametrize("aligned_dst", [True, False])
def test_read_into_returns_exact_bytes(data_file, offset, length, aligned_dst):
    path, data = data_file
    dst = aligned_empty(length + 1)[int(not aligned_dst) : int(not aligned_dst) + length]
    with DirectFile(path) as f:
        f.read_into(offset, dst)
        assert np.array_equal(dst.numpy(), data[offset : offset + length])
        assert f.counters.snapshot()["bytes"] == length


def test_read_view_matches_and_memoryview_destination(data_file):
    path, data = data_file
    with DirectFile(path) as f:
        assert np.array_equal(f.read_view(333, 5000), data[333:5333])
        mv = memoryview(bytearray(64))
        f.read_into(ALIGN + 5, mv)
        assert bytes(mv) == data[ALIGN + 5 : ALIGN + 69].tobytes()


@pytest.mark.parametrize("script", [("eio",), ("short",), ("eio", "short")])
def test_transient_faults_are_retried(data_file, script):
    path, data = data_file
    with DirectFile(path, retries=2, io=FakeFaultyIO(script)) as f:
        out = f.read_view(10, 3 * ALIGN)
        assert np.array_equal(out, data[10 : 10 + 3 * ALIGN])
        assert f.counters.snapshot()["retries"] == len(script)


@pytest.mark.parametrize("fault,words", [("eio", "EIO"), ("short", "short read")])
def test_persistent_fault_raises_read_error_naming_file_offset_length(data_file, fault, words):
    path, _ = data_file
    with DirectFile(path, retries=2, io=FakeFaultyIO(then=fault)) as f:
        with pytest.raises(ReadError) as e:
            f.read_into(ALIGN, aligned_empty(ALIGN))
    msg = str(e.value)
    assert str(path) in msg and f"offset {ALIGN}" in msg and f"{ALIGN} bytes" in msg and words in msg
    assert "\n" not in msg
    assert f.counters.snapshot()["errors"] == 1


def test_range_past_end_of_file_is_a_read_error(data_file):
    path, _ = data_file
    with DirectFile(path) as f, pytest.raises(ReadError, match="truncated"):
        f.read_view(FILE_BYTES - 10, 20)


@pytest.mark.parametrize("where", ["open", "read"])
def test_filesystem_refusing_odirect_gives_clear_error(data_file, where):
    path, _ = data_file
    io = FakeFaultyIO(refuse_open=True) if where == "open" else FakeFaultyIO(then="einval")
    with pytest.raises(ODirectError, match=f"refuses O_DIRECT \\(EINVAL on {where}\\)"):
        with DirectFile(path, io=io) as f:
            f.read_view(0, 10)


def test_probe_reports_real_directory_and_file_work(tmp_path, data_file):
    path, _ = data_file
    ok_dir, why_dir = odirect_works(tmp_path)
    ok_file, why_file = odirect_works(path)
    assert ok_dir and ok_file, (why_dir, why_file)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".bigmoe-odirect-probe")]


@pytest.mark.parametrize(
    "io,words",
    [(FakeFaultyIO(refuse_open=True), "refuses O_DIRECT on open"), (FakeFaultyIO(then="einval"), "aligned read fails")],
)
def test_probe_reports_refusal_with_reason(tmp_path, io, words):
    ok, why = odirect_works(tmp_path, io=io)
    assert not ok and words in why and str(tmp_path) in why


def test_probe_of_missing_path_degrades_to_reason(tmp_path):
    ok, why = odirect_works(tmp_path / "nope.bin")
    assert not ok and "nope.bin" in why


def test_shm_odirect_behaviour_is_reported_either_way():
    """tmpfs refuses O_DIRECT on older kernels and accepts it since 6.6; the probe must say which, not raise."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    ok, why = odirect_works("/dev/shm")
    assert isinstance(ok, bool) and "/dev/shm" in why


def test_an_empty_aligned_read_reads_nothing_and_succeeds(data_file):
    path, _ = data_file
    with DirectFile(path) as f:
        f.read_into(ALIGN, aligned_empty(0))


def test_many_retries_fail_a_dead_disk_in_seconds(data_file):
    """BIGMOE_READ_RETRIES=14: the waits between file-level retries stop doubling at MAX_BACKOFF_S (0.256 s), so
    the error comes after about 1.8 s of waits (uncapped: 16 s)."""
    path, _ = data_file
    began = time.monotonic()
    with DirectFile(path, retries=14, io=FakeFaultyIO(then="eio")) as f, pytest.raises(ReadError, match="EIO"):
        f.read_into(0, aligned_empty(ALIGN))
    assert time.monotonic() - began < 6
