"""HostCopier: the C thread that serves GPU-published copy lists, here in CPU mode (memcpy + release stores).

The tests play the GPU with `publish` and keep a reference model of every destination byte: after each round,
all slots must equal the model (copied entries hold the record's component bytes, everything else is as it
was) and copied[slot] must hold the entry's goal. The CUDA branch of the same C source runs against a fake
libcuda.so.1 in a subprocess, so its stream, ring and error handling are exercised without a GPU.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest
import torch
from bigmoe_pager.core import host_copier
from bigmoe_pager.core.host_copier import HostCopier, HostCopierError, publish

CPU = torch.device("cpu")
WAIT_S = 5.0  # bound on every wait for the thread; a round takes microseconds

# (offset in the record, bytes copied, dst shape of one slot, dst dtype) per component.
LAYOUTS = {
    "one": [(0, 256, (256,), torch.uint8)],
    # An FP8 expert: w13 and w2 bytes, then two float32 scale blocks at odd offsets, one into a padded slot.
    "fp8": [
        (0, 1024, (32, 32), torch.uint8),
        (1024, 512, (16, 32), torch.uint8),
        (1541, 12, (4,), torch.float32),
        (1553, 20, (5,), torch.float32),
    ],
}
PITCH = {"one": 256, "fp8": 1600}
RECORDS = 9  # rows per layer's records


def wait_for(cond, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"timed out after {WAIT_S} s waiting for {what}"
        time.sleep(0.0002)


def settle(copier: HostCopier) -> None:
    """Wait for two full polls: afterwards the thread has looked at every mailbox as it stands now."""
    start = copier.stats()["passes"]
    wait_for(lambda: copier.stats()["passes"] >= start + 2, "two polls")


class Layer:
    """One layer's tensors and a reference model of what its destination slots should hold."""

    def __init__(self, layout: str, slots: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.layout, self.slots, self.pitch = LAYOUTS[layout], slots, PITCH[layout]
        self.records = torch.randint(0, 256, (RECORDS, self.pitch), dtype=torch.uint8, generator=g)
        self.mailbox = HostCopier.mailbox(slots, CPU)
        self.copied = torch.full((slots + 1,), -7, dtype=torch.int64)  # one word past the slots stays -7
        self.dsts, self.model = [], []
        for _, _, shape, dtype in self.layout:
            nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
            raw = torch.randint(0, 256, (slots, nbytes), dtype=torch.uint8, generator=g)
            self.model.append(raw.clone())
            self.dsts.append(raw.view(dtype).view(slots, *shape))
        self.goals = self.copied.clone()
        self.seq = 0

    def components(self) -> list[tuple[int, int, torch.Tensor]]:
        return [(off, n, dst) for (off, n, _, _), dst in zip(self.layout, self.dsts)]

    def add_to(self, copier: HostCopier) -> None:
        copier.add_layer(self.mailbox, self.records, self.pitch, self.components(), self.copied, self.slots)

    def publish(self, rows, slots, goals, count=None) -> tuple[int, int]:
        """Publish a round and apply it to the model; returns (experts, bytes) it should copy."""
        count = len(rows) if count is None else count
        experts = 0
        for row, slot, goal in list(zip(rows, slots, goals))[:count]:
            if row < 0 or slot < 0:
                continue
            experts += 1
            for (off, n, _, _), model in zip(self.layout, self.model):
                model[slot, :n] = self.records[row, off : off + n]
            self.goals[slot] = goal
        self.seq += 1
        publish(self.mailbox, self.seq, rows, slots, goals, count=count)
        return experts, experts * sum(n for _, n, _, _ in self.layout)

    def landed(self) -> bool:
        return bool(torch.equal(self.copied, self.goals))

    def assert_matches_model(self) -> None:
        assert torch.equal(self.copied, self.goals)
        for k, (dst, model) in enumerate(zip(self.dsts, self.model)):
            got = dst.reshape(self.slots, -1).view(torch.uint8)
            assert torch.equal(got, model), f"component {k}: slots differ from the model"


@pytest.fixture
def copier():
    c = HostCopier(CPU, ring_words=1 << 12)
    yield c
    c.close()


@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_round_lands_in_its_slots_only(copier, layout, slots):
    layer = Layer(layout, slots, seed=slots)
    layer.add_to(copier)
    targets = list(range(slots - 1, -1, -2))  # every other slot, from the last: the rest must stay untouched
    rows = [(3 * i + 1) % RECORDS for i in range(len(targets))]
    experts, nbytes = layer.publish(rows, targets, [100 + s for s in targets])
    wait_for(layer.landed, "the round's completion words")
    layer.assert_matches_model()
    assert layer.copied[slots].item() == -7  # past the slots: never written
    wait_for(lambda: copier.stats()["rounds"] == 1, "the round to be counted")
    s = copier.stats()
    assert (s["experts"], s["bytes"], s["error"], s["layers"]) == (experts, nbytes, 0, 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rounds_on_several_layers_skip_and_prefix(copier, layout):
    layers = [Layer(layout, 4, seed=10), Layer(layout, 6, seed=11)]
    for layer in layers:
        layer.add_to(copier)
    want = {"rounds": 0, "experts": 0, "bytes": 0}

    def play(layer: Layer, rows, slots, goals, count=None) -> None:
        experts, nbytes = layer.publish(rows, slots, goals, count)
        want["rounds"] += 1
        want["experts"] += experts
        want["bytes"] += nbytes
        wait_for(lambda: copier.stats()["rounds"] == want["rounds"], f"round {want['rounds']}")
        layer.assert_matches_model()

    play(layers[0], [0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4])
    play(layers[1], [8, -1, 7], [5, 4, -1], [10, 11, 12])  # -1 in rows or slots: skipped
    late = Layer(layout, 5, seed=12)  # added while the thread runs
    late.add_to(copier)
    play(late, [4, 5], [4, 0], [20, 21])
    # count 2 of 4 listed: the two beyond the prefix are not copied (their slots keep the model's bytes).
    play(layers[1], [1, 2, 3, 4], [0, 1, 2, 3], [30, 31, 32, 33], count=2)
    play(layers[0], [6, 6], [3, 2], [40, 41])
    play(late, [], [], [])  # an empty round is still a round
    settle(copier)
    for layer in [*layers, late]:
        layer.assert_matches_model()
    s = copier.stats()
    assert {k: s[k] for k in want} == want
    assert (s["layers"], s["error"]) == (3, 0)


def test_same_seq_is_not_served_twice(copier):
    layer = Layer("one", 4, seed=3)
    layer.add_to(copier)
    layer.publish([1, 2], [0, 1], [5, 6])
    wait_for(layer.landed, "the first round")
    before = copier.stats()
    # New lists, same seq: the GPU has not published a round, so nothing may be copied.
    publish(layer.mailbox, layer.seq, [7, 8, 7], [2, 3, 0], [9, 9, 9])
    settle(copier)
    layer.assert_matches_model()
    after = copier.stats()
    assert {k: after[k] for k in ("rounds", "experts", "bytes")} == {
        k: before[k] for k in ("rounds", "experts", "bytes")
    }
    layer.publish([7], [2], [50])  # a new seq is served again
    wait_for(layer.landed, "the next round")
    layer.assert_matches_model()


def test_an_idle_copier_naps_and_still_serves_the_next_round(copier):
    """Idle for over a second (no decode under way), the thread polls about once a millisecond rather than every
    20 us (about a fifth of a core); a round published then is still served."""
    layer = Layer("one", 4, seed=5)
    layer.add_to(copier)
    time.sleep(1.2)  # past the 50 ms of busy polling and the first second of 20 us naps
    start, t0 = copier.stats()["passes"], time.monotonic()
    time.sleep(1.0)
    rate = (copier.stats()["passes"] - start) / (time.monotonic() - t0)
    assert rate < 1500, f"{rate:.0f} polls a second while idle"
    layer.publish([2, 3], [1, 0], [8, 9])
    wait_for(layer.landed, "a round after the idle second")
    layer.assert_matches_model()


def test_a_copier_with_no_busy_polling_naps_at_once_and_still_serves_every_round():
    """BIGMOE_HOST_COPIER_HOT_MS=0: right after a round the thread naps (20 us naps: a few thousand polls a second
    at most, where busy polling makes hundreds of thousands), and the next rounds are still served."""
    quiet = HostCopier(CPU, ring_words=64, hot_ms=0)
    try:
        layer = Layer("one", 4, seed=6)
        layer.add_to(quiet)
        for rows in ([1, 2], [3, 0]):
            layer.publish(rows, [0, 1], [7, 8] if rows[0] == 1 else [9, 10])
            wait_for(layer.landed, "a round of a copier that naps")
            layer.assert_matches_model()
        start, t0 = quiet.stats()["passes"], time.monotonic()
        time.sleep(0.3)  # within what would be busy polling (50 ms) only at its start; the rest naps either way
        rate = (quiet.stats()["passes"] - start) / (time.monotonic() - t0)
        assert rate < 60_000, f"{rate:.0f} polls a second"  # 20 us naps: at most 50,000
    finally:
        quiet.close()
    with pytest.raises(ValueError, match="hot_ms"):
        HostCopier(CPU, hot_ms=-1)


def test_ring_must_hold_twice_the_slots():
    with pytest.raises(ValueError, match="ring_words"):
        HostCopier(CPU, ring_words=1)
    copier = HostCopier(CPU, ring_words=16)
    try:
        Layer("one", 8, seed=0).add_to(copier)  # 2 * 8 <= 16
        with pytest.raises(ValueError, match="ring of 16 words is too small for 9 slots"):
            Layer("one", 1, seed=1).add_to(copier)
        assert copier.stats()["layers"] == 1
    finally:
        copier.close()


def _bad_inputs():
    """(name, change to add_layer's keyword arguments) that must each raise ValueError."""
    other = torch.zeros(5, 256, dtype=torch.uint8)
    return {
        "slots 0": lambda a: a.update(slots=0),
        "pitch 0": lambda a: a.update(pitch=0),
        "mailbox int32": lambda a: a.update(mailbox=a["mailbox"].int()),
        "mailbox size": lambda a: a.update(mailbox=torch.zeros(3 + 3 * 4 + 1, dtype=torch.int64)),
        "records int8": lambda a: a.update(records=a["records"].to(torch.int8)),
        "records strided": lambda a: a.update(records=a["records"].t()),
        "records short": lambda a: a.update(records=a["records"].view(-1)[:100]),
        "copied int32": lambda a: a.update(copied=a["copied"].int()),
        "copied short": lambda a: a.update(copied=a["copied"][:3]),
        "copied strided": lambda a: a.update(copied=torch.zeros(10, dtype=torch.int64)[::2]),
        "no components": lambda a: a.update(components=[]),
        "five components": lambda a: a.update(components=a["components"] * 5),
        "past record": lambda a: a.update(components=[(200, 57, other)]),
        "negative offset": lambda a: a.update(components=[(-1, 8, other)]),
        "zero bytes": lambda a: a.update(components=[(0, 0, other)]),
        "few dst slots": lambda a: a.update(components=[(0, 8, other[:3])]),
        "dst slot small": lambda a: a.update(components=[(0, 256, other[:, :128])]),
        "dst strided": lambda a: a.update(components=[(0, 8, other[:, ::2])]),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_bad_inputs_raise_value_error(copier, case):
    layer = Layer("one", 4, seed=0)
    args = dict(
        mailbox=layer.mailbox,
        records=layer.records,
        pitch=layer.pitch,
        components=layer.components(),
        copied=layer.copied,
        slots=4,
    )
    _bad_inputs()[case](args)
    with pytest.raises(ValueError) as e:
        copier.add_layer(**args)
    assert "\n" not in str(e.value)
    assert copier.stats()["layers"] == 0


def test_a_failed_copier_stops_the_server_with_one_line(copier):
    """The vLLM adapter's health check (its export thread SIGTERMs the process on a failure)."""
    from types import SimpleNamespace

    from bigmoe_pager.adapters.vllm.device import failed_part

    process = SimpleNamespace(device=SimpleNamespace(ssd=None), host_copies=SimpleNamespace(copier=copier))
    layer = Layer("one", 4, seed=5)
    layer.add_to(copier)
    assert failed_part(process) is None
    publish(layer.mailbox, 1, [RECORDS], [0], [1])
    wait_for(lambda: copier.stats()["error"] != 0, "the error")
    why = failed_part(process)
    assert "row 9, slot 0 out of range" in why and "stopping the server" in why and "\n" not in why


def test_out_of_range_entry_stops_the_copier(copier):
    layer = Layer("one", 4, seed=5)
    layer.add_to(copier)
    publish(layer.mailbox, 1, [RECORDS], [0], [1])  # row past the records: an error, not a wild read
    wait_for(lambda: copier.stats()["error"] != 0, "the error")
    with pytest.raises(HostCopierError, match=r"row 9, slot 0 out of range") as e:
        copier.check()
    assert "\n" not in str(e.value)
    layer.seq = 1
    layer.publish([0], [0], [2])  # a valid round: the copier stays idle after an error
    settle(copier)
    assert layer.copied[0].item() == -7
    assert copier.stats()["rounds"] == 0


def test_close_is_idempotent_and_stops_the_thread():
    copier = HostCopier(CPU, ring_words=64)
    layer = Layer("fp8", 3, seed=7)
    layer.add_to(copier)
    layer.publish([2], [1], [3])
    wait_for(layer.landed, "the round before close")
    assert copier.stats()["experts"] == 1
    copier.close()
    copier.close()
    with pytest.raises(HostCopierError, match="closed"):
        copier.add_layer(layer.mailbox, layer.records, layer.pitch, layer.components(), layer.copied, 3)
    with pytest.raises(HostCopierError, match="closed"):
        copier.stats()
    publish(layer.mailbox, 2, [4], [0], [8])  # no thread left to serve it
    time.sleep(0.05)
    assert layer.copied[0].item() == -7


def test_dropped_copier_stops_its_thread():
    copier = HostCopier(CPU, ring_words=64)
    layer = Layer("one", 2, seed=8)
    layer.add_to(copier)
    del copier
    gc.collect()
    publish(layer.mailbox, 1, [0], [0], [1])
    time.sleep(0.05)
    assert layer.copied[0].item() == -7


def test_missing_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc-for-test")
    monkeypatch.setenv("BIGMOE_CACHE_DIR", str(tmp_path))
    with pytest.raises(HostCopierError, match="cc-for-test.*not found") as e:
        HostCopier(CPU)
    assert "\n" not in str(e.value)


def test_failed_build_names_compiler_and_first_stderr_line(monkeypatch, tmp_path):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: error: boom' >&2\necho 'second line' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("BIGMOE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(HostCopierError) as e:
        host_copier.library()
    msg = str(e.value)
    assert "\n" not in msg and str(fake) in msg and "fake-cc: error: boom" in msg and "second line" not in msg
    assert list((tmp_path / "cache").iterdir()) == []  # the temp output is gone


def test_build_leaves_one_library_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BIGMOE_CACHE_DIR", str(tmp_path))
    lib = host_copier.library()
    assert host_copier.library() is lib  # loaded once per process
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]


FAKE_DRIVER = r"""
/* A stand-in libcuda.so.1: "device" memory is host memory, an async copy is a memcpy done at once. */
#include <stddef.h>
#include <string.h>
static void *ctx = (void *)0x1c, *stream = (void *)0x5e;
long long copies, fail_at = -1, synced, destroyed, stream_flags = -1, mode_at_create = -1;
static int mode; /* the thread's capture mode: 0 global, the driver's default */
int cuThreadExchangeStreamCaptureMode(int *m) { int old = mode; mode = *m; *m = old; return 0; }
int cuCtxGetCurrent(void **c) { *c = ctx; return 0; }
int cuCtxSetCurrent(void *c) { return c == ctx ? 0 : 201; }
int cuStreamCreate(void **s, unsigned flags) { stream_flags = flags; mode_at_create = mode; *s = stream; return 0; }
int cuStreamSynchronize(void *s) { synced += s == stream; return 0; }
int cuStreamDestroy_v2(void *s) { destroyed += s == stream; return 0; }
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *s) {
    if (s != stream) return 400;
    if (copies++ == fail_at) return 700;
    memcpy((void *)dst, src, n);
    return 0;
}
"""

FAKE_RUN = r"""
import ctypes, json, sys, time
fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the copier's dlopen("libcuda.so.1") finds it loaded
lib = ctypes.CDLL(sys.argv[2])
lib.copier_start.restype = ctypes.c_void_p
lib.copier_start.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
lib.copier_add_layer.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
lib.copier_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.copier_error_call.argtypes = [ctypes.c_void_p]
lib.copier_error_call.restype = ctypes.c_char_p
lib.copier_stop.argtypes = [ctypes.c_void_p]
I64 = ctypes.c_int64
S, PITCH = 2, 16
ring, mailbox, copied = (I64 * 8)(), (I64 * (3 + 3 * S))(), (I64 * S)(-1, -1)
records, dst = (ctypes.c_uint8 * (3 * PITCH))(*range(3 * PITCH)), (ctypes.c_uint8 * (S * 8))()
addr = ctypes.addressof
h = lib.copier_start(1, addr(ring), 8, 0)  # hot_ns 0: nap between polls
desc = (I64 * 11)(addr(mailbox), addr(records), PITCH, 3, addr(copied), S, 1, 4, 8, addr(dst), 8)
assert lib.copier_add_layer(h, desc, 11) == 0
def stats():
    out = (I64 * 6)()
    lib.copier_stats(h, out)
    return list(out)
def play(seq, rows, slots, goals, rounds):
    for i in range(len(rows)):
        mailbox[3 + i], mailbox[3 + S + i], mailbox[3 + 2 * S + i] = rows[i], slots[i], goals[i]
    mailbox[1] = len(rows)
    mailbox[0] = seq
    end = time.monotonic() + 5
    while stats()[0] < rounds and stats()[3] == 0 and time.monotonic() < end:
        time.sleep(0.0002)
play(1, [2, 0], [0, 1], [11, 12], 1)
first = dict(stats=stats(), dst=list(dst), copied=list(copied), ring=list(ring))
fake_get = lambda name: ctypes.c_longlong.in_dll(fake, name).value
ctypes.c_longlong.in_dll(fake, "fail_at").value = fake_get("copies") + 1  # the next entry's second copy fails
play(2, [1, 1], [1, 0], [21, 22], 2)
time.sleep(0.01)
second = dict(stats=stats(), call=lib.copier_error_call(h).decode(), copied=list(copied))
lib.copier_stop(h)
print(json.dumps(dict(first=first, second=second, flags=fake_get("stream_flags"), synced=fake_get("synced"),
                      destroyed=fake_get("destroyed"), mode=fake_get("mode_at_create"))))
"""


def test_cuda_branch_against_a_fake_driver(tmp_path):
    """Runs where a real driver is installed too: the child loads the fake by path first, and the copier's
    dlopen("libcuda.so.1") takes the object already loaded under that soname before it searches the disk."""
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    fake = tmp_path / "libcuda.so.1"
    build = ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(fake), str(tmp_path / "fake.c")]
    subprocess.run(build, check=True)
    lib = host_copier.library()._name
    r = subprocess.run([sys.executable, "-c", FAKE_RUN, str(fake), lib], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    first, second = got["first"], got["second"]
    rounds, experts, nbytes, error, layers, _ = first["stats"]
    assert (rounds, experts, nbytes, error, layers) == (1, 2, 16, 0, 1)
    assert first["dst"] == list(range(36, 44)) + list(range(4, 12))  # row 2 -> slot 0, row 0 -> slot 1
    assert first["copied"] == [11, 12]
    assert first["ring"][:2] == [11, 12]  # goals go through the pinned ring, never a stack word
    assert got["flags"] == 1  # CU_STREAM_NON_BLOCKING
    assert got["mode"] == 2  # relaxed before its first stream call: its calls never void another thread's capture
    # Round 2: entry 0's data copy is done, its completion copy fails: error recorded, nothing more issued.
    assert second["stats"][3] == 700 and second["call"] == "cuMemcpyHtoDAsync_v2"
    assert second["stats"][0] == 1 and second["copied"] == [11, 12]
    assert (got["synced"], got["destroyed"]) == (1, 1)
