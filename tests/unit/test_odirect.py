"""O_DIRECT reads: exact bytes for aligned and unaligned ranges, and one clear error per fault."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from bigmoe_pager.core.odirect import (
    ALIGN,
    DirectFile,
    ODirectError,
    ReadError,
    ReadSplit,
    SystemFileIO,
    aligned_empty,
    odirect_works,
)
from ssd_testkit import FakeFaultyIO

pytestmark = pytest.mark.timeout(30)

FILE_BYTES = 5 * ALIGN + 1234  # not a multiple of the block size: the last block is partial


@pytest.fixture(params=["whole", "split"])
def split(request):
    """Reads as one preadv a span, or cut into one-block pieces read at once (ReadSplit)."""
    if request.param == "whole":
        yield None
        return
    pieces = ReadSplit(ALIGN, threads=4)
    yield pieces
    pieces.close()


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
def test_read_into_returns_exact_bytes(data_file, offset, length, aligned_dst, split):
    path, data = data_file
    dst = aligned_empty(length + 1)[int(not aligned_dst) : int(not aligned_dst) + length]
    with DirectFile(path, split=split) as f:
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
def test_transient_faults_are_retried(data_file, script, split):
    path, data = data_file
    with DirectFile(path, retries=2, io=FakeFaultyIO(script), split=split) as f:
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


class MeetingIO(SystemFileIO):
    """Fake file I/O (the real reads) whose preadv calls must all be in flight at once: each waits at a barrier of
    `parties` before reading, so reads issued one after another break it."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=5)
        self.threads: set[str] = set()

    def preadv(self, fd: int, buf: np.ndarray, offset: int) -> int:
        self.threads.add(threading.current_thread().name)
        self.barrier.wait()
        return super().preadv(fd, buf, offset)


def test_a_split_span_is_read_as_pieces_in_flight_at_once(data_file):
    path, data = data_file
    pieces = ReadSplit(ALIGN, threads=5)
    io = MeetingIO(parties=6)  # the span [0, 5 blocks + 1234) rounded up to 6 blocks: 6 one-block pieces
    try:
        with DirectFile(path, io=io, split=pieces) as f:
            assert np.array_equal(f.read_view(0, FILE_BYTES), data)
    finally:
        pieces.close()
    assert len(io.threads) == 6  # the caller's thread and five helpers


class SlowTailIO(SystemFileIO):
    """Fake file I/O: the read at `bad` fails with EIO; every other read sleeps `delay_s` first, then reads."""

    def __init__(self, bad: int, delay_s: float):
        self.bad, self.delay_s, self.finished = bad, delay_s, 0
        self._lock = threading.Lock()

    def preadv(self, fd: int, buf: np.ndarray, offset: int) -> int:
        if offset == self.bad:
            raise OSError(errno.EIO, "Input/output error")
        time.sleep(self.delay_s)
        got = super().preadv(fd, buf, offset)
        with self._lock:
            self.finished += 1
        return got


def test_a_failed_piece_raises_only_after_every_piece_is_done(data_file):
    """No helper may still write into the caller's buffer once the read has returned or raised."""
    path, _ = data_file
    pieces = ReadSplit(ALIGN, threads=4)
    io = SlowTailIO(bad=0, delay_s=0.3)
    try:
        with DirectFile(path, io=io, retries=0, split=pieces) as f:
            with pytest.raises(ReadError) as e:
                f.read_into(0, aligned_empty(4 * ALIGN))
    finally:
        pieces.close()
    assert io.finished == 3
    assert str(path) in str(e.value) and "offset 0" in str(e.value) and "EIO" in str(e.value)


@pytest.mark.parametrize(
    "nbytes,piece,expected",
    [(3 * ALIGN, ALIGN, 3), (5 * ALIGN + 7, 2 * ALIGN, 2), (ALIGN, 4 * ALIGN, 1), (0, ALIGN, 1), (ALIGN, ALIGN, 1)],
)
def test_cuts_are_aligned_cover_the_span_and_hold_a_piece_each(nbytes, piece, expected):
    cuts = ReadSplit(piece).cuts(nbytes)
    assert len(cuts) == expected
    assert cuts[0][0] == 0 and cuts[-1][1] == nbytes
    assert all(a % ALIGN == 0 and b >= a for a, b in cuts)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(cuts, cuts[1:]))
    assert len(cuts) == 1 or min(b - a for a, b in cuts[:-1]) >= piece


def test_an_empty_aligned_read_needs_no_piece(data_file, split):
    path, _ = data_file
    with DirectFile(path, split=split) as f:
        f.read_into(ALIGN, aligned_empty(0))


def test_many_retries_fail_a_dead_disk_in_seconds(data_file):
    """BIGMOE_READ_RETRIES=14: the waits between file-level retries stop doubling at MAX_BACKOFF_S (0.256 s), so
    the error comes after about 1.8 s of waits (uncapped: 16 s)."""
    path, _ = data_file
    began = time.monotonic()
    with DirectFile(path, retries=14, io=FakeFaultyIO(then="eio")) as f, pytest.raises(ReadError, match="EIO"):
        f.read_into(0, aligned_empty(ALIGN))
    assert time.monotonic() - began < 6
