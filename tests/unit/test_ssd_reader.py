"""The native SSD reader (core/ssd_reader.c): C threads answer the mailbox, with the Python service's rules.

Real files throughout: faults are a shard cut short and a paging-file record corrupted on disk after the service
started (the faults a fake file layer injects go to the Python threads, which test_ssd_service covers).
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import psutil
import pytest
import torch
from bigmoe_pager.core import ssd_mailbox as mb
from bigmoe_pager.core.paging_file import damaged_marker
from bigmoe_pager.core.ssd_service import SsdError, SsdService
from bigmoe_pager.settings import PagerSettings
from ssd_testkit import SHAPES, FakeFaultyIO, hurried_read_ahead, make_checkpoint, reads_ahead_done_at_request

pytestmark = pytest.mark.timeout(120)

RAM_SLOTS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=2, num_experts=6)


@pytest.fixture(params=["checkpoint", "paging-file"])
def store_kind(request):
    return request.param


def _store(ckpt, kind, tmp_path, **kw):
    if kind == "checkpoint":
        return ckpt.store(**kw)
    return ckpt.paging_file(tmp_path / "experts.bigmoe", **kw)


def _service(store, ckpt, **kw):
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
    kw.setdefault("read_timeout_s", 5.0)
    kw.setdefault("max_requests", 8)
    kw.setdefault("reader", "native")
    return SsdService(store, bufs, mailbox=True, **kw), bufs


def _assert_slot(ckpt, bufs, layer, expert, slot):
    got = bufs[layer][slot, : ckpt.layout.record_bytes]
    assert torch.equal(got, ckpt.reference(layer, expert)), (layer, expert, slot)


def test_loads_fill_slots_with_each_store_and_are_counted(ckpt, store_kind, tmp_path):
    """Every expert of both layers, read by the C threads through the mailbox's host entries, is byte for byte the
    checkpoint's record; reads and bytes reach the service's counters and the sinks' read time."""
    sinks = [_Sink() for _ in range(ckpt.num_layers)]
    svc, bufs = _service(_store(ckpt, store_kind, tmp_path), ckpt, io_workers=3, sinks=sinks)
    with svc:
        assert svc.native and svc.reader_note == ""
        for layer in range(ckpt.num_layers):
            for first in range(0, ckpt.num_experts, RAM_SLOTS):
                experts = list(range(first, min(first + RAM_SLOTS, ckpt.num_experts)))
                svc.load(layer, experts, list(range(len(experts))))
                for slot, expert in enumerate(experts):
                    _assert_slot(ckpt, bufs, layer, expert, slot)
        layers = svc.stats()["layers"]
    assert [c["reads"] for c in layers] == [ckpt.num_experts] * ckpt.num_layers
    assert all(c["bytes"] >= ckpt.num_experts * ckpt.layout.record_bytes * 0.5 for c in layers)
    assert all(c["errors"] == 0 and c["retries"] == 0 for c in layers)
    assert all(s.values.get("read_ns", 0) > 0 for s in sinks)


def test_reads_finish_while_python_holds_the_gil(ckpt, tmp_path):
    """The point of the native reader: requests published before this thread holds the GIL for a whole second
    (a call through ctypes.PyDLL keeps it) are read and answered meanwhile; Python threads could not have run."""
    svc, bufs = _service(ckpt.store(), ckpt, io_workers=2)
    hold_gil = ctypes.PyDLL(None).usleep
    with svc:
        box = svc.box.numpy()
        for i, (expert, slot) in enumerate(((2, 0), (5, 1), (0, 2))):
            at = mb.REQ + mb.WORDS_PER_REQUEST * i
            box[at + 1 : at + 4] = (1, expert, slot)
            box[at] = 1
        hold_gil(1_000_000)  # microseconds, with the GIL held
        done = box[mb.done_base(svc.entries) : mb.done_base(svc.entries) + 3].copy()  # before anything lets go
        assert done.tolist() == [1, 1, 1]
        for expert, slot in ((2, 0), (5, 1), (0, 2)):
            _assert_slot(ckpt, bufs, 1, expert, slot)


def test_a_newer_request_for_a_slot_wins_over_a_posted_read(ckpt, tmp_path):
    """A posted read and a blocking request for one RAM slot, published together: the request's record is what
    the slot holds, and the request is answered."""
    store = ckpt.store()
    bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
    svc = SsdService(store, bufs, mailbox=True, max_requests=8, read_ahead=True, io_workers=2, reader="native")
    with svc:
        box = svc.box.numpy()
        posted = mb.REQ + mb.WORDS_PER_REQUEST * (svc.post_base[0] + 3)
        blocking = mb.REQ + mb.WORDS_PER_REQUEST * 0
        box[posted + 1 : posted + 4] = (0, 1, 3)
        box[blocking + 1 : blocking + 4] = (0, 4, 3)
        box[posted] = 7
        box[blocking] = 9
        deadline = time.monotonic() + 30
        while box[mb.done_base(svc.entries)] != 9 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a late posted read would land now if superseding failed
        svc.check()
        _assert_slot(ckpt, bufs, 0, 4, 3)


def test_a_shard_cut_short_fails_the_tier_with_file_and_offset(ckpt, tmp_path):
    """A shard truncated after the service started: the read comes back short (after the file-level retries),
    the GPU is told (HOST_ERROR), and check() names the expert, the file and the offset; the slot keeps no
    partial bytes, and the tier stays failed."""
    root = tmp_path / "ckpt"
    own = make_checkpoint(root, "fp8", num_layers=2, num_experts=6)
    svc, bufs = _service(own.store(retries=1), own, read_retries=1)
    shards = sorted(root.glob("*.safetensors"))
    with svc:
        svc.load(0, [0], [0])
        for shard in shards:
            os.truncate(shard, 4096)
        with pytest.raises(SsdError, match=r"layer 1 expert 5 into RAM slot 2 failed: short read.*safetensors@\d+"):
            svc.load(1, [5], [2])
        assert int(svc.box[mb.HOST_ERROR]) != 0 and svc.failed
        assert not bufs[1][2].any()
        with pytest.raises(SsdError):
            svc.load(0, [1], [1])
        assert svc.stats()["layers"][1]["errors"] == 1


def test_a_record_corrupt_on_disk_is_retried_then_marks_the_paging_file_damaged(ckpt, tmp_path):
    store = ckpt.paging_file(tmp_path / "experts.bigmoe")
    offset, length, _ = store.entry(0, 4)
    svc, bufs = _service(store, ckpt, read_retries=2)
    with svc:
        with open(store.path, "r+b") as f:
            f.seek(offset + length // 2)
            byte = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(
            SsdError,
            match=r"marked damaged and the next start rebuilds it: record \(0, 4\).* check \(after 3 attempts\)",
        ):
            svc.load(0, [4], [2])
        assert svc.stats()["layers"][0]["retries"] == 2
    assert not bufs[0][2].any()
    assert damaged_marker(store.path).exists()


def test_a_bad_request_fails_with_one_line(ckpt, tmp_path):
    svc, _ = _service(ckpt.store(), ckpt)
    with svc, pytest.raises(SsdError, match=r"expert 99 into RAM slot 0 failed: bad request.*source: the mailbox"):
        svc.load(0, [99], [0])


def test_python_threads_serve_where_the_native_reader_cannot(ckpt, tmp_path, monkeypatch):
    """BIGMOE_SSD_READER=native without a C compiler or with a store reading through its own file layer, or the
    default (python): the Python threads answer the same mailbox, and reader_note says why."""
    cases = {
        "C compiler": (
            dict(),
            {"BIGMOE_SSD_READER": "native", "CC": "/nonexistent/cc-for-test", "BIGMOE_CACHE_DIR": str(tmp_path / "c")},
        ),
        "its own file I/O": (dict(io=FakeFaultyIO()), {"BIGMOE_SSD_READER": "native"}),
        "BIGMOE_SSD_READER=python": (dict(), {}),
    }
    for note, (store_kw, env) in cases.items():
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            settings = PagerSettings.from_env()
            bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
            svc = SsdService.from_settings(ckpt.store(**store_kw), bufs, settings, mailbox=True, max_requests=8)
            with svc:
                assert not svc.native and note in svc.reader_note, (note, svc.reader_note)
                svc.load(1, [3], [1])
                _assert_slot(ckpt, bufs, 1, 3, 1)


def test_close_leaves_no_thread_behind(ckpt, tmp_path):
    me = psutil.Process()
    warm, _ = _service(ckpt.store(), ckpt, io_workers=1)  # threads torch makes at its first work stay: make them now
    warm.load(0, [1], [0])
    warm.close()
    before = {t.id for t in me.threads()}
    svc, _ = _service(ckpt.store(), ckpt, io_workers=4)
    assert len({t.id for t in me.threads()} - before) >= 5  # the poller and four workers
    svc.load(0, [1, 2], [0, 1])
    svc.close()
    assert not {t.id for t in me.threads()} - before  # (threads of earlier tests may have ended meanwhile)


class _Sink:
    def __init__(self):
        self.values: dict[str, int] = {}

    def add_host(self, **values: int) -> None:
        for k, v in values.items():
            self.values[k] = self.values.get(k, 0) + int(v)


def test_counters_arrive_once(ckpt, tmp_path):
    """collect() adds only what is new: called twice, the totals do not double."""
    svc, _ = _service(ckpt.store(), ckpt)
    with svc:
        svc.load(0, [0, 1, 2], [0, 1, 2])
        svc.collect()
        svc.collect()
        assert svc.stats()["layers"][0]["reads"] == 3
        assert np.sum([c["reads"] for c in svc.stats()["layers"]]) == 3


FAKE_PREAD = r"""
/* A stand-in for a misbehaving disk, LD_PRELOADed into a child: pread() on O_DIRECT descriptors (the native
 * reader's; Python's reads use preadv) follows a script set through fake_pread_set(script, then): a comma list
 * used one entry a call (eio: fail with EIO; slowN: sleep N ms, then read), then `then` for every later call. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static char script[256], then[32];
static long calls;
void fake_pread_set(const char *s, const char *t) {
    snprintf(script, sizeof script, "%s", s);
    snprintf(then, sizeof then, "%s", t);
    __atomic_store_n(&calls, 0, __ATOMIC_SEQ_CST);
}
static void step(long i, char *out) {
    const char *p = script;
    for (long k = 0; k < i && p && *p; k++) { p = strchr(p, ','); if (p) p++; }
    if (!p || !*p) { snprintf(out, 32, "%s", then); return; }
    size_t n = strcspn(p, ",");
    snprintf(out, 32, "%.*s", (int)n, p);
}
static ssize_t act(int fd, void *buf, size_t n, off_t off) {
    static ssize_t (*real)(int, void *, size_t, off_t);
    if (!real) real = (ssize_t (*)(int, void *, size_t, off_t))dlsym(RTLD_NEXT, "pread");
    if (!(fcntl(fd, F_GETFL) & O_DIRECT)) return real(fd, buf, n, off);
    char what[32];
    step(__atomic_fetch_add(&calls, 1, __ATOMIC_SEQ_CST), what);
    if (!strcmp(what, "eio")) { errno = EIO; return -1; }
    if (!strncmp(what, "slow", 4)) { struct timespec t = {0, 0}; long ms = atol(what + 4);
        t.tv_sec = ms / 1000; t.tv_nsec = (ms % 1000) * 1000000L; nanosleep(&t, NULL); }
    return real(fd, buf, n, off);
}
ssize_t pread(int fd, void *buf, size_t n, off_t off) { return act(fd, buf, n, off); }
ssize_t pread64(int fd, void *buf, size_t n, off_t off) { return act(fd, buf, n, off); }
"""

FAULT_RUN = r"""
import ctypes, json, sys, torch
from bigmoe_bench import synth_experts
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.ssd_service import SsdError, SsdService
root, hidden, inter, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layout = synth_experts.make_layout(hidden, inter, True)
fake = ctypes.CDLL(None)
fake.fake_pread_set.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
out = {}
for name, script, then, kw in json.loads(sys.argv[5]):
    store = CheckpointStore(root, layout, retries=1)
    bufs = [torch.zeros(2, layout.pitch, dtype=torch.uint8) for _ in range(store.num_layers)]
    svc = SsdService(store, bufs, mailbox=True, max_requests=4, io_workers=4, reader="native", **kw)
    fake.fake_pread_set(script.encode(), then.encode())
    row = {"native": svc.native}
    try:
        svc.load(1, [3], [1])
        ref = synth_experts.reference_record(root, layout, first + 1, 3)[: layout.record_bytes]
        row["right_bytes"] = bool(torch.equal(bufs[1][1, : layout.record_bytes], ref))
    except SsdError as e:
        row["error"] = str(e)
        row["slot_untouched"] = not bool(bufs[1][1].any())
    fake.fake_pread_set(b"", b"ok")
    row["stats"] = svc.stats()["layers"][1]
    svc.close()
    store.close()
    out[name] = row
print(json.dumps(out))
"""


def run_over_fake_disk(tmp_path, ckpt, script: str, *args: str) -> str:
    """Run `script` in a child with FAKE_PREAD LD_PRELOADed (argv: the checkpoint's root, its hidden and
    intermediate sizes, then args); its stdout, after asserting it exited 0."""
    import subprocess
    import sys

    (tmp_path / "fake.c").write_text(FAKE_PREAD)
    shim = tmp_path / "fake_pread.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "fake.c"), "-ldl"], check=True)
    shape = (SHAPES["fp8"]["hidden"], SHAPES["fp8"]["intermediate"])
    env = {**os.environ, "LD_PRELOAD": str(shim), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [sys.executable, "-c", script, str(ckpt.root), *map(str, shape), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_disk_faults_in_the_native_threads(ckpt, tmp_path):
    """EIO and reads that never come back, injected under the C threads' pread (a fake disk LD_PRELOADed into a
    child): one EIO is retried at file level; EIO every time fails the read with its errno, the slot untouched; a
    read not answered within read_timeout_s is issued again on another worker and the late answer discarded; a
    read never answered in time fails as such."""
    import json

    cases = [
        ("eio-once", "eio", "ok", {}),
        ("eio-always", "", "eio", {}),
        ("late-once", "slow1500", "ok", {"read_timeout_s": 0.2, "read_retries": 1}),
        ("late-always", "", "slow1500", {"read_timeout_s": 0.2, "read_retries": 1}),
    ]
    out = run_over_fake_disk(tmp_path, ckpt, FAULT_RUN, str(ckpt.first_layer), json.dumps(cases))
    got = json.loads(out.splitlines()[-1])
    assert all(row["native"] for row in got.values())
    assert got["eio-once"]["right_bytes"] and got["eio-once"]["stats"]["errors"] == 0
    assert "read error (EIO: Input/output error)" in got["eio-always"]["error"]
    assert got["eio-always"]["slot_untouched"] and got["eio-always"]["stats"]["errors"] == 1
    assert got["late-once"]["right_bytes"] and got["late-once"]["stats"]["retries"] == 1
    assert "no answer in time (after 2 attempts)" in got["late-always"]["error"]
    assert got["late-always"]["slot_untouched"]


def test_counters_and_failure_outlive_close(ckpt, tmp_path):
    """stats() and check() after close still see what the threads did: nothing is lost or counted twice."""
    svc, _ = _service(ckpt.store(), ckpt)
    svc.load(1, [0, 1], [0, 1])
    with pytest.raises(SsdError, match="bad request"):
        svc.load(1, [42], [0])
    svc.close()
    layers = svc.stats()["layers"]
    assert layers[1]["reads"] == 2 and layers[1]["errors"] == 1
    assert svc.stats()["layers"][1]["reads"] == 2
    with pytest.raises(SsdError, match="bad request"):
        svc.check()


STOP_RUN = r"""
import sys, torch
from bigmoe_bench import synth_experts
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.ssd_service import SsdService
root, hidden, inter, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
layout = synth_experts.make_layout(hidden, inter, True)
with CheckpointStore(root, layout, model_layers=[first]) as store:  # one layer: its slot count sits past the chunk's
    # first 8 bytes, where a freed chunk keeps its free-list pointer
    for cycle in range(int(sys.argv[4])):
        bufs = [torch.zeros(4, layout.pitch, dtype=torch.uint8) for _ in range(store.num_layers)]
        svc = SsdService(store, bufs, mailbox=True, max_requests=4, reader="native")
        assert svc.native, svc.reader_note
        svc.load(cycle % store.num_layers, [cycle % store.num_experts], [cycle % 4])
        svc.close()
print("stopped", sys.argv[4])
"""


def test_stopping_frees_nothing_it_still_reads(ckpt):
    """Start, read and stop the C threads again and again in a child whose freed memory glibc fills with 0x5a bytes
    (MALLOC_PERTURB_, the per-thread cache off so that every free is filled): session 36's reader destroyed its slot
    locks by a count read from memory it had just freed, a crash at close one run in three."""
    import subprocess
    import sys

    shape = (SHAPES["fp8"]["hidden"], SHAPES["fp8"]["intermediate"])
    env = {
        **os.environ,
        "MALLOC_PERTURB_": "90",
        "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    argv = [sys.executable, "-c", STOP_RUN, str(ckpt.root), *map(str, shape), "12", str(ckpt.first_layer)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split() == ["stopped", "12"]


SLOW_NATIVE_SERVICE = r"""
import ctypes, sys, torch
from bigmoe_bench import synth_experts
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.ssd_service import SsdService
from ssd_testkit import hurried_read_ahead, reads_ahead_done_at_request
root, hidden, inter = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layout = synth_experts.make_layout(hidden, inter, True)
store = CheckpointStore(root, layout)
bufs = [torch.zeros(4, layout.pitch, dtype=torch.uint8) for _ in range(store.num_layers)]
svc = SsdService(store, bufs, mailbox=True, max_requests=8, read_ahead=True, io_workers=1, reader="native")
fake = ctypes.CDLL(None)
fake.fake_pread_set.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
fake.fake_pread_set(b"", b"slow50")  # every read of the C threads takes 50 ms
"""
"""A child's start: the native reader, one worker, over the fake disk; `svc` is the service."""

AHEAD_THEN_REQUEST = (
    SLOW_NATIVE_SERVICE
    + r"""
with svc:
    print("native" if svc.native else svc.reader_note)
    print(reads_ahead_done_at_request(svc, 1, [(0, 0), (1, 1), (2, 2)], (3, 3)))
"""
)


@pytest.mark.parametrize("reader", ["python", "native"])
def test_a_steps_request_is_read_before_reads_ahead_not_yet_started(ckpt, tmp_path, reader):
    """One worker, a disk taking 50 ms a read, three reads ahead published before a step's request: the request
    waits for the read in flight at most, not for the reads ahead queued behind it (a wrong read ahead must not
    delay a read the GPU waits on; run 56). The native reader's slow disk is a fake pread LD_PRELOADed into a
    child, the Python threads' a fake file layer."""
    if reader == "python":
        io = FakeFaultyIO(then="slow", delay_s=0.05)
        bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
        svc = SsdService(ckpt.store(io=io), bufs, mailbox=True, max_requests=8, read_ahead=True, io_workers=1)
        with svc:
            done = reads_ahead_done_at_request(svc, 1, [(0, 0), (1, 1), (2, 2)], (3, 3))
            svc.check()
        _assert_slot(ckpt, bufs, 1, 3, 3)
    else:
        note, done = run_over_fake_disk(tmp_path, ckpt, AHEAD_THEN_REQUEST).split("\n")[-3:-1]
        assert note == "native", note
        done = int(done)
    assert done <= 1


HURRY_AHEAD = (
    SLOW_NATIVE_SERVICE
    + r"""
ahead = [tuple(map(int, t.split(","))) for t in sys.argv[4:]]
with svc:
    print("native" if svc.native else svc.reader_note)
    print(hurried_read_ahead(svc, ahead))
    svc.check()
    print(sum(layer["hurried"] for layer in svc.stats()["layers"]))
"""
)

# reads ahead of both layers, published in this order; the last is the one a step waits for
AHEAD = [(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 4, 0), (1, 5, 1)]


@pytest.mark.parametrize("reader", ["python", "native"])
def test_a_read_ahead_a_step_waits_for_goes_before_the_reads_ahead_queued_first(ckpt, tmp_path, reader):
    """One worker, a disk taking 50 ms a read, six reads ahead queued: the one whose hurry word the step's request
    kernel wrote is read after the read in flight at most, not after the five queued before it, lands byte for
    byte, and is counted as hurried once."""
    if reader == "python":
        io = FakeFaultyIO(then="slow", delay_s=0.05)
        bufs = [torch.zeros(RAM_SLOTS, ckpt.layout.pitch, dtype=torch.uint8) for _ in range(ckpt.num_layers)]
        svc = SsdService(ckpt.store(io=io), bufs, mailbox=True, max_requests=8, read_ahead=True, io_workers=1)
        with svc:
            done = hurried_read_ahead(svc, AHEAD)
            svc.check()
            hurried = sum(layer["hurried"] for layer in svc.stats()["layers"])
        _assert_slot(ckpt, bufs, *AHEAD[-1])
    else:
        args = [",".join(map(str, t)) for t in AHEAD]
        note, done, hurried = run_over_fake_disk(tmp_path, ckpt, HURRY_AHEAD, *args).split("\n")[-4:-1]
        assert note == "native", note
        done, hurried = int(done), int(hurried)
    assert done <= 1
    assert hurried == 1
