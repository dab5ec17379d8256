"""Paging file: exact records under concurrency, checksums on every read, and no partial or foreign file ever used."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from bigmoe_pager.core.expert_store import ExpertStore
from bigmoe_pager.core.odirect import ALIGN, aligned_empty
from bigmoe_pager.core.paging_file import (
    ChecksumError,
    DiskFullError,
    PagingFileError,
    PagingFileStore,
    PagingFileWriter,
    write_paging_file,
)
from ssd_testkit import FakeFaultyIO, FakeFullDiskFile, make_checkpoint, mount_small_tmpfs, unmount

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "fp8", num_layers=2, num_experts=5)


@pytest.fixture(scope="module")
def paging_path(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("pf") / "experts.bmpf"
    ckpt.paging_file(path).close()
    return path


def _open(ckpt, path, **kw):
    return PagingFileStore(path, ckpt.layout, ckpt.meta(), **kw)


def test_records_read_back_exactly_from_many_threads(ckpt, paging_path):
    keys = [(l, e) for l in range(ckpt.num_layers) for e in range(ckpt.num_experts)] * 4
    refs = {k: ckpt.reference(*k) for k in set(keys)}

    def read(key):
        buf = aligned_empty(ckpt.layout.pitch)
        n = store.read(*key, buf)
        return n == ckpt.layout.record_bytes and torch.equal(buf[:n], refs[key])

    with _open(ckpt, paging_path) as store, ThreadPoolExecutor(16) as pool:
        assert isinstance(store, ExpertStore) and store.codec == "raw"
        assert all(pool.map(read, keys))


def test_records_are_aligned_for_odirect(ckpt, paging_path):
    with _open(ckpt, paging_path) as store:
        offsets = [store.entry(l, e)[0] for l in range(ckpt.num_layers) for e in range(ckpt.num_experts)]
    assert all(o % ALIGN == 0 for o in offsets)
    assert os.path.getsize(paging_path) % ALIGN == 0


def test_variable_length_codec_records_round_trip(ckpt, tmp_path):
    """Records are opaque bytes: the store returns them and their length, whatever the codec made."""
    meta = ckpt.meta(codec="test-zlib", codec_version=3)
    rng = np.random.default_rng(0)
    records = {
        (l, e): rng.integers(0, 256, int(rng.integers(1, ckpt.layout.pitch)), dtype=np.uint8)
        for l in range(ckpt.num_layers)
        for e in range(ckpt.num_experts)
    }
    with PagingFileWriter(tmp_path / "c.bmpf", meta, ckpt.layout.pitch) as w:
        for (l, e), rec in reversed(list(records.items())):  # any order
            w.add(l, e, rec)
        w.commit()
    with PagingFileStore(tmp_path / "c.bmpf", ckpt.layout, meta) as store:
        assert store.codec == "test-zlib"
        buf = aligned_empty(ckpt.layout.pitch)
        for key, rec in records.items():
            n = store.read(*key, buf)
            assert n == rec.size and np.array_equal(buf[:n].numpy(), rec)


def test_a_compressed_paging_file_is_the_same_built_on_one_process_or_several(tiny_checkpoint, tmp_path):
    """build_paging_file encodes on worker processes for a big model; the file is the same byte for byte, and the
    progress counts every record once, in order."""
    from bigmoe.model.tinymoe.shape import TinyShape
    from bigmoe_pager.core.paging_build import build_paging_file

    model = tiny_checkpoint(
        TinyShape(layers=2, experts=6, top_k=2, hidden=128, moe_intermediate=128), "fp8", seed=5, with_tokenizer=False
    )
    seen = []
    one = build_paging_file(model, tmp_path / "one.bmpf", compress=True, workers=1)
    two = build_paging_file(model, tmp_path / "two.bmpf", True, lambda done, total: seen.append((done, total)), 2)
    assert one.read_bytes() == two.read_bytes()
    assert seen == [(i, 12) for i in range(1, 13)]


def test_an_encoded_store_refuses_reads_out_of_key_order(ckpt):
    from bigmoe_pager.core.paging_build import EncodedStore

    with ckpt.store() as src:
        store = EncodedStore(src, 1)
        buf = aligned_empty(2 * ckpt.layout.pitch)
        assert store.read(0, 0, buf) > 0
        with pytest.raises(ValueError, match="out of turn"):
            store.read(0, 2, buf)
        store.close()


@pytest.mark.parametrize("cut", ["header", "index", "records", "trailer", "last-byte"])
def test_truncated_file_is_refused(ckpt, paging_path, tmp_path, cut):
    data = paging_path.read_bytes()
    keep = {
        "header": 100,
        "index": ALIGN + 10,
        "records": len(data) // 2,
        "trailer": len(data) - ALIGN,
        "last-byte": len(data) - 1,
    }[cut]
    path = tmp_path / "cut.bmpf"
    path.write_bytes(data[:keep])
    with pytest.raises(PagingFileError) as e:
        _open(ckpt, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "field,value",
    [("model_id", "other/model"), ("revision", "def456"), ("codec", "fp8x"), ("codec_version", 9), ("num_experts", 7)],
)
def test_foreign_file_is_refused_naming_what_differs(ckpt, paging_path, field, value):
    want = ckpt.meta(**{field: value})
    with pytest.raises(PagingFileError, match=f"made for {field}=.*this run needs"):
        PagingFileStore(paging_path, ckpt.layout, want)


def test_file_of_another_layout_is_refused(ckpt, paging_path):
    from ssd_testkit import synth_experts

    other = synth_experts.make_layout(512, 128, True)
    with pytest.raises(PagingFileError, match="layout_signature"):
        PagingFileStore(paging_path, other, ckpt.meta(layout_signature=other.signature()))


@pytest.mark.parametrize("content", [b"", b"hello world", bytes(3 * ALIGN)])
def test_non_paging_file_is_refused(ckpt, tmp_path, content):
    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    with pytest.raises(PagingFileError, match="not a bigmoe paging file"):
        _open(ckpt, path)


def test_corrupt_header_is_refused(ckpt, paging_path, tmp_path):
    data = bytearray(paging_path.read_bytes())
    data[ALIGN + 3] ^= 1  # inside the index
    path = tmp_path / "bad.bmpf"
    path.write_bytes(bytes(data))
    with pytest.raises(PagingFileError, match="header is corrupt"):
        _open(ckpt, path)


def test_flipped_record_byte_raises_checksum_error(ckpt, paging_path, tmp_path):
    path = tmp_path / "rot.bmpf"
    path.write_bytes(paging_path.read_bytes())
    with _open(ckpt, path) as store:
        offset = store.entry(1, 2)[0]
    with open(path, "r+b") as f:
        f.seek(offset + 77)
        b = f.read(1)
        f.seek(offset + 77)
        f.write(bytes([b[0] ^ 0x10]))
    with _open(ckpt, path) as store:
        buf = aligned_empty(ckpt.layout.pitch)
        with pytest.raises(ChecksumError, match=r"record \(1, 2\) at offset \d+ fails its crc32"):
            store.read(1, 2, buf)
        assert store.read(1, 1, buf) == ckpt.layout.record_bytes  # the others are fine


@pytest.mark.parametrize("faults, marked", [(("corrupt",), False), ((), True)])
def test_bit_rot_on_read_is_caught_and_a_repeated_failure_marks_the_file(ckpt, paging_path, tmp_path, faults, marked):
    """One bad read may be a glitch on the way (the next read is whole); the same record failing twice
    is the bytes on disk: the file is marked damaged and refused from then on."""
    path = tmp_path / "rot.bmpf"
    path.write_bytes(paging_path.read_bytes())
    io = FakeFaultyIO(faults, then="ok" if faults else "corrupt")
    with _open(ckpt, path, io=io) as store:
        buf = aligned_empty(ckpt.layout.pitch)
        with pytest.raises(ChecksumError, match=rf"paging file {path}.*: record \(0, 0\)"):
            store.read(0, 0, buf)
        if marked:
            with pytest.raises(ChecksumError, match="is marked damaged and the next start rebuilds it: record"):
                store.read(0, 0, buf)
        else:
            assert store.read(0, 0, buf) == ckpt.layout.record_bytes
    if marked:
        with pytest.raises(PagingFileError, match=r"marked damaged \(record \(0, 0\)"):
            _open(ckpt, path)
    else:
        _open(ckpt, path).close()


def test_writer_failure_leaves_nothing_at_the_path(ckpt, tmp_path):
    path = tmp_path / "p.bmpf"
    with pytest.raises(RuntimeError, match="boom"):
        with PagingFileWriter(path, ckpt.meta(), ckpt.layout.pitch) as w:
            w.add(0, 0, bytes(10))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_uncommitted_writer_leaves_nothing(ckpt, tmp_path):
    with PagingFileWriter(tmp_path / "p.bmpf", ckpt.meta(), ckpt.layout.pitch) as w:
        w.add(0, 0, bytes(10))
    assert os.listdir(tmp_path) == []


def test_commit_with_records_missing_is_refused(ckpt, tmp_path):
    with PagingFileWriter(tmp_path / "p.bmpf", ckpt.meta(), ckpt.layout.pitch) as w:
        w.add(0, 0, bytes(10))
        with pytest.raises(PagingFileError, match=r"records never added, first \(0, 1\)"):
            w.commit()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", ["twice", "too-long", "out-of-range"])
def test_bad_records_are_refused(ckpt, tmp_path, bad):
    with PagingFileWriter(tmp_path / "p.bmpf", ckpt.meta(), ckpt.layout.pitch) as w:
        w.add(0, 0, bytes(10))
        with pytest.raises(PagingFileError):
            if bad == "twice":
                w.add(0, 0, bytes(10))
            elif bad == "too-long":
                w.add(0, 1, bytes(ckpt.layout.pitch + 1))
            else:
                w.add(ckpt.num_layers, 0, bytes(10))


def test_full_disk_through_fake_writer_removes_partial_file(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with ckpt.store() as src, pytest.raises(DiskFullError, match="disk full while writing .* free space"):
        write_paging_file(out / "p.bmpf", ckpt.meta(), src, opener=lambda p: FakeFullDiskFile(p, 3 * ckpt.layout.pitch))
    assert os.listdir(out) == []


def test_full_disk_on_a_real_small_tmpfs_removes_partial_file(ckpt, tmp_path):
    where = tmp_path / "small"
    why = mount_small_tmpfs(where, "512k")  # smaller than the ~1.1 MB this paging file needs
    if why:
        pytest.skip(f"cannot mount a small tmpfs here ({why}); the fake-writer test covers ENOSPC")
    try:
        with ckpt.store() as src, pytest.raises(DiskFullError):
            write_paging_file(where / "p.bmpf", ckpt.meta(), src)
        assert os.listdir(where) == []
    finally:
        unmount(where)


def test_crc_is_over_the_record_bytes_only(ckpt, paging_path):
    """The index crc32 is the plain zlib crc of the unpadded record, so other tools can verify records."""
    with _open(ckpt, paging_path) as store:
        _, length, crc = store.entry(0, 3)
    assert length == ckpt.layout.record_bytes
    assert crc == zlib.crc32(ckpt.reference(0, 3).numpy().tobytes())
