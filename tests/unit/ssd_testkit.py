"""Shared pieces of the SSD-tier tests: tiny synthetic checkpoints and fakes for faults.

The fakes stand in for faults a real disk cannot be made to produce on demand
(EIO, short reads, a filesystem refusing O_DIRECT, a disk filling mid-write);
each is named Fake* and wraps the real system calls otherwise.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe_bench import synth_experts
from bigmoe_pager.core import ssd_mailbox
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.odirect import SystemFileIO, odirect_works
from bigmoe_pager.core.paging_file import PagingFileMeta, PagingFileStore, write_paging_file

ROOT = Path(__file__).resolve().parents[2]

NEEDS_INTERPRETER = pytest.mark.skipif(
    not ssd_mailbox.interpreting(),
    reason="needs TRITON_INTERPRET=1 (tests/unit/conftest.py sets it) to run kernels on CPU",
)
"""Mark for tests that run the mailbox's Triton kernels on CPU tensors."""

SHAPES = {
    "fp8": dict(hidden=256, intermediate=128, fp8=True),
    "bf16": dict(hidden=128, intermediate=64, fp8=False),
}
"""Checkpoint kinds; FP8 weights by turns Student-t (the codec codes them) and random bytes (stored raw)."""


@dataclass
class Checkpoint:
    """A synthetic expert checkpoint on disk and how to check reads from it."""

    root: Path
    """Directory holding the shards."""
    layout: ExpertLayout
    """Record layout of its experts."""
    num_layers: int
    """MoE layers in it."""
    num_experts: int
    """Experts per layer."""
    first_layer: int
    """Model layer number of MoE layer 0."""

    def reference(self, layer: int, expert: int) -> torch.Tensor:
        """The record bytes (up to record_bytes) a correct read of MoE layer `layer` returns."""
        rec = synth_experts.reference_record(self.root, self.layout, self.first_layer + layer, expert)
        return rec[: self.layout.record_bytes]

    def meta(self, **change: object) -> PagingFileMeta:
        base = dict(
            model_id="test/tiny",
            revision="abc123",
            layout_signature=self.layout.signature(),
            num_layers=self.num_layers,
            num_experts=self.num_experts,
        )
        return PagingFileMeta(**{**base, **change})

    def store(self, **kw: object) -> CheckpointStore:
        return CheckpointStore(self.root, self.layout, **kw)

    def paging_file(self, path: Path, **kw: object) -> PagingFileStore:
        with self.store() as src:
            write_paging_file(path, self.meta(), src)
        return PagingFileStore(path, self.layout, self.meta(), **kw)

    def compressed_meta(self) -> PagingFileMeta:
        from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION

        return self.meta(codec=CODEC_NAME, codec_version=CODEC_VERSION)

    def compressed_paging_file(self, path: Path) -> Path:
        """A paging file of codec records (the pager's own encoder and pitch), written once at path."""
        from bigmoe_pager.core.paging_build import EncodedStore, compressed_pitch

        if not path.exists():
            with self.store() as src:
                write_paging_file(
                    path, self.compressed_meta(), EncodedStore(src, 1), pitch=compressed_pitch(self.layout)
                )
        return path

    def decoded_store(self, path: Path, **kw: object):
        """The raw-record store the pager reads a compressed paging file through (codec's DecodedStore, C decoder)."""
        from bigmoe_pager.codec.record_decoder import DecodedStore, record_decoder
        from bigmoe_pager.core.paging_build import compressed_pitch

        inner = PagingFileStore(path, self.layout, self.compressed_meta(), pitch=compressed_pitch(self.layout), **kw)
        return DecodedStore(inner, record_decoder(self.layout))


def make_checkpoint(
    root: Path, kind: str = "fp8", num_layers: int = 2, num_experts: int = 6, first_layer: int = 1, shards: int = 2
) -> Checkpoint:
    shape = SHAPES[kind]
    synth_experts.write_checkpoint(
        root,
        shape["hidden"],
        shape["intermediate"],
        num_layers,
        num_experts,
        fp8=shape["fp8"],
        shards=shards,
        first_layer=first_layer,
        law="mixed",
    )
    layout = synth_experts.make_layout(shape["hidden"], shape["intermediate"], shape["fp8"])
    return Checkpoint(root, layout, num_layers, num_experts, first_layer)


def make_direct_checkpoint(root: Path, kind: str = "fp8", **kw) -> Checkpoint:
    """make_checkpoint for a test whose SSD tier reads with O_DIRECT: skips it, saying why, where `root`'s file
    system refuses O_DIRECT (tmpfs does), so a GPU machine's odd temp directory reads as that, not as a failure."""
    ok, why = odirect_works(root)
    if not ok:
        pytest.skip(f"O_DIRECT does not work in the test temp directory: {why}")
    return make_checkpoint(root, kind, **kw)


class FakeFaultyIO(SystemFileIO):
    """Fake file I/O: the real calls, except that preadv calls follow a script of injected faults.

    Script items, consumed one per preadv call (then "ok" forever, or `then` if given):
    "ok", "eio", "short" (a real read reported as 8 bytes long), "einval",
    "slow" (sleeps `delay_s` first), "corrupt" (flips one byte after a real read).
    """

    def __init__(self, script: tuple[str, ...] = (), then: str = "ok", delay_s: float = 0.0, refuse_open: bool = False):
        self.script = list(script)
        self.then = then
        self.delay_s = delay_s
        self.refuse_open = refuse_open
        self.calls = 0
        self._lock = threading.Lock()

    def open(self, path: str, flags: int) -> int:
        if self.refuse_open:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return super().open(path, flags)

    def preadv(self, fd: int, buf: np.ndarray, offset: int) -> int:
        with self._lock:
            self.calls += 1
            action = self.script.pop(0) if self.script else self.then
        if action == "eio":
            raise OSError(errno.EIO, "Input/output error")
        if action == "einval":
            raise OSError(errno.EINVAL, "Invalid argument")
        if action == "slow":
            time.sleep(self.delay_s)
        got = super().preadv(fd, buf, offset)
        if action == "short":
            return min(got, 8)
        if action == "corrupt":
            buf[0] ^= 0xFF
        return got


class FakeFullDiskFile:
    """Fake writable file: passes writes to a real file until `capacity` bytes, then fails with ENOSPC."""

    def __init__(self, path: Path, capacity: int):
        self._f = open(path, "wb")
        self.capacity = capacity
        self.written = 0

    def write(self, data: bytes) -> int:
        if self.written + len(data) > self.capacity:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += len(data)
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def loaded_layers(
    ckpt, sizes, device: str, stats, read_ahead: bool, policy: str = "lru", read_ahead_layers: int = 1
) -> list:
    """One DeviceLayerPager per checkpoint layer, its RAM records filled as the engine's loader fills them."""
    from bigmoe_pager.core.device_layer import DeviceLayerPager

    pagers = []
    for layer in range(ckpt.num_layers):
        p = DeviceLayerPager(
            ckpt.layout,
            sizes,
            device,
            layer=layer,
            stats=stats,
            read_ahead=read_ahead,
            read_ahead_layers=read_ahead_layers,
            policy=policy,
        )
        for e in range(sizes.experts):
            row = p.ram_slot_for_load(e)
            if row is not None:
                p.ram.records[row, : ckpt.layout.record_bytes] = ckpt.reference(layer, e)
                for c in ckpt.layout.components:
                    p.mark_loaded(e, c.name)
        pagers.append(p)
    return pagers


def mount_small_tmpfs(where: Path, size: str = "1m") -> str:
    """Mount a tmpfs of `size` at where (needs root); returns "" or why it could not."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def unmount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=True)


def _publish(box, entry: int, layer: int, expert: int, slot: int, seq: int) -> None:
    """Write one mailbox entry as the GPU's kernels do: the payload, then its seq."""
    at = ssd_mailbox.REQ + ssd_mailbox.WORDS_PER_REQUEST * entry
    box[at + 1 : at + 4] = (layer, expert, slot)
    box[at] = seq  # after the payload: the host reads the seq word first


def _answered(svc, entry: int, seq: int, what: str) -> None:
    """Wait up to 30 s for the entry's done word to hold seq."""
    box, done = svc.box.numpy(), ssd_mailbox.done_base(svc.entries) + entry
    deadline = time.monotonic() + 30
    while box[done] != seq and time.monotonic() < deadline:
        time.sleep(0.001)
    assert box[done] == seq, f"{what} was not answered within 30 s"


def _done(svc, entries: list[int]) -> int:
    """How many of these entries' reads are answered."""
    box, done = svc.box.numpy(), ssd_mailbox.done_base(svc.entries)
    return sum(int(box[done + entry] != 0) for entry in entries)


def reads_ahead_done_at_request(svc, layer: int, ahead: list[tuple[int, int]], request: tuple[int, int]) -> int:
    """Publish reads ahead of (expert, RAM slot) pairs, then one blocking request, straight into svc's mailbox (the
    words the GPU's post and request kernels write); wait up to 30 s for the request's answer and return how many of
    the reads ahead were answered by then."""
    box = svc.box.numpy()
    entries = [svc.post_base[layer] + slot for _, slot in ahead]
    for seq, (entry, (expert, slot)) in enumerate(zip(entries, ahead), start=10):
        _publish(box, entry, layer, expert, slot, seq)
    _publish(box, 0, layer, *request, seq=99)
    _answered(svc, 0, 99, "the request")
    return _done(svc, entries)


def hurried_read_ahead(svc, ahead: list[tuple[int, int, int]]) -> int:
    """Publish reads ahead of (layer, expert, RAM slot) triples straight into svc's mailbox, then write the last
    one's hurry word (as the request kernel does for a read its step waits for); wait up to 30 s for that read and
    return how many of the others were answered by then."""
    box = svc.box.numpy()
    entries = [svc.post_base[layer] + slot for layer, _, slot in ahead]
    for seq, (entry, triple) in enumerate(zip(entries, ahead), start=10):
        _publish(box, entry, *triple, seq)
    last = 10 + len(ahead) - 1
    box[ssd_mailbox.hurry_base(svc.entries) + entries[-1]] = last
    _answered(svc, entries[-1], last, "the hurried read")
    return _done(svc, entries[:-1])
