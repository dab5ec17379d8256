"""prepare: the paging file is built when the plan needs one, reused while it matches,
rebuilt when it does not, and a build that dies leaves nothing that looks valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from bigmoe.model.tinymoe.shape import TinyShape
from bigmoe.serve.prepare import paging_file_matches, prepare, stale_partials
from bigmoe_pager.core.paging_names import partial_file, partial_files


@pytest.fixture
def model(tiny_checkpoint):
    return tiny_checkpoint(
        TinyShape(layers=2, experts=4, top_k=2, hidden=128, moe_intermediate=128, vocab=512),
        "fp8",
        seed=2,
        with_tokenizer=False,
    )


def plan_for(path, compress: bool, source: str = "paging file"):
    """The fields of bigmoe.plan.planner.Plan that prepare reads (a stand-in, not the estimator)."""
    return SimpleNamespace(ssd_source=source, paging_file=str(path), compress=compress)


def test_not_needed_without_a_paging_file(model, tmp_path):
    assert prepare(plan_for(tmp_path / "x.pages", False, source="checkpoint"), model) is None
    assert not (tmp_path / "x.pages").exists()


@pytest.mark.parametrize("compress", [False, True])
def test_built_then_reused_then_rebuilt_when_it_no_longer_matches(model, tmp_path, compress):
    path = tmp_path / "m.pages"
    events = []
    assert prepare(plan_for(path, compress), model, lambda e, f: events.append(f["state"])) == path
    assert events[0] == "building" and events[-1] == "built"
    first = path.stat().st_mtime_ns
    events.clear()
    prepare(plan_for(path, compress), model, lambda e, f: events.append(f["state"]))
    assert events == ["reused"] and path.stat().st_mtime_ns == first
    events.clear()
    prepare(plan_for(path, not compress), model, lambda e, f: events.append(f["state"]))
    assert events[-1] == "built" and paging_file_matches(path, model, not compress)
    assert not paging_file_matches(path, model, compress)


def test_a_build_that_dies_leaves_nothing_valid(model, tmp_path):
    path = tmp_path / "m.pages"

    def die(event, fields):
        if fields.get("records_done", 0) >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(plan_for(path, True), model, die)
    assert not path.exists()
    assert not paging_file_matches(path, model, True)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_truncated_file_is_rebuilt(model, tmp_path):
    path = tmp_path / "m.pages"
    prepare(plan_for(path, False), model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert not paging_file_matches(path, model, False)
    events = []
    prepare(plan_for(path, False), model, lambda e, f: events.append(f["state"]))
    assert events[-1] == "built" and paging_file_matches(path, model, False)


def flip_middle_record(path, store_meta):
    """Flip bytes in the middle of one record's bytes (not in padding); returns (layer, expert)."""
    from bigmoe_pager.core.paging_file import PagingFileStore

    layout, meta, pitch = store_meta
    with PagingFileStore(path, layout, meta, pitch=pitch) as store:
        layer, expert = store.num_layers // 2, store.num_experts // 2
        offset, length, _ = store.entry(layer, expert)
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return layer, expert


def meta_of(model, compress):
    from bigmoe.serve.prepare import _codec
    from bigmoe_pager.core.expert_store import CheckpointStore
    from bigmoe_pager.core.paging_build import checkpoint_meta, compressed_pitch, layout_for_checkpoint

    layout = layout_for_checkpoint(model)
    with CheckpointStore(model, layout) as s:
        meta = checkpoint_meta(model, layout, s.num_layers, s.num_experts, *_codec(compress))
    return layout, meta, compressed_pitch(layout) if compress else None


@pytest.mark.parametrize("compress", [False, True])
def test_a_file_with_flipped_bytes_is_rebuilt_not_reused(model, tmp_path, compress):
    path = tmp_path / "m.pages"
    prepare(plan_for(path, compress), model)
    flip_middle_record(path, meta_of(model, compress))
    events = []
    prepare(plan_for(path, compress), model, lambda e, f: events.append(f))
    assert [e["state"] for e in events][:2] == ["rebuilding", "building"] and events[-1]["state"] == "built"
    assert "crc32" in events[0]["reason"]
    assert paging_file_matches(path, model, compress)


def test_a_record_failing_at_run_time_marks_the_file_for_rebuild(model, tmp_path):
    from bigmoe_pager.core.odirect import aligned_empty
    from bigmoe_pager.core.paging_file import ChecksumError, PagingFileError, PagingFileStore, damaged_marker

    path = tmp_path / "m.pages"
    prepare(plan_for(path, False), model)
    layout, meta, pitch = meta_of(model, False)
    good = path.read_bytes()
    layer, expert = flip_middle_record(path, (layout, meta, pitch))
    with PagingFileStore(path, layout, meta) as store:
        for _ in range(2):  # the pagers read a failed record once more before giving up
            with pytest.raises(ChecksumError, match=rf"paging file {path}.*: record \({layer}, {expert}\)") as failed:
                store.read(layer, expert, aligned_empty(layout.pitch))
    assert "next start rebuilds it" in str(failed.value)
    assert damaged_marker(path).exists()
    path.write_bytes(good)  # even if the bytes read back whole now, a file that failed once is not trusted
    with pytest.raises(PagingFileError, match="marked damaged"):
        PagingFileStore(path, layout, meta)
    events = []
    prepare(plan_for(path, False), model, lambda e, f: events.append(f))
    assert events[0]["state"] == "rebuilding" and events[-1]["state"] == "built"
    assert not damaged_marker(path).exists() and paging_file_matches(path, model, False)


def test_above_the_full_check_size_a_sample_is_checked(model, tmp_path):
    from bigmoe.serve.prepare import check_paging_file

    path = tmp_path / "m.pages"
    prepare(plan_for(path, False), model)
    assert check_paging_file(path, model, False, full_check_bytes=0) is None
    flip_middle_record(path, meta_of(model, False))  # 8 records, all in the sample (at least 8)
    assert "crc32" in check_paging_file(path, model, False, full_check_bytes=0)


def test_a_directory_refusing_odirect_is_refused_before_anything_is_written(model, tmp_path, monkeypatch):
    import bigmoe_pager.core.odirect as odirect
    from bigmoe.serve.prepare import PrepareError

    monkeypatch.setattr(odirect, "odirect_works", lambda path, io=None: (False, "open(O_DIRECT) failed: EINVAL"))
    with pytest.raises(PrepareError, match=r"O_DIRECT reads do not work in .*--paging-dir"):
        prepare(plan_for(tmp_path / "pages" / "m.pages", True), model)
    assert list((tmp_path / "pages").iterdir()) == []


def test_a_paging_directory_that_cannot_be_made_names_the_option_that_moves_it(model, tmp_path):
    from bigmoe.serve.prepare import PrepareError

    (tmp_path / "a-file").write_text("")
    with pytest.raises(PrepareError, match=r"cannot create the paging directory .*a-file/pages.*--paging-dir"):
        prepare(plan_for(tmp_path / "a-file" / "pages" / "m.pages", True), model)


KILLED_BUILD = """
import os, signal, sys
from pathlib import Path
from types import SimpleNamespace
from bigmoe.serve.prepare import prepare

def die(event, fields):
    if fields.get("records_done", 0) >= 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a power cut ends a build: no cleanup runs

prepare(SimpleNamespace(ssd_source="paging file", paging_file=sys.argv[1], compress=True), Path(sys.argv[2]), die)
"""


def test_what_a_killed_build_left_is_removed_by_the_next_build(model, tmp_path):
    path = tmp_path / "m.pages"
    child = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(path), str(model)], capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    [left] = stale_partials(path)
    assert left.stat().st_size > 0 and not path.exists()
    events = []
    assert prepare(plan_for(path, True), model, lambda event, fields: events.append(fields)) == path
    assert not left.exists() and paging_file_matches(path, model, True)
    assert {"state": "removed", "path": str(left), "reason": "left by a build that died"} in events
    assert stale_partials(path) == []


def test_a_build_under_way_is_not_stale(tmp_path):
    path = tmp_path / "m.pages"
    mine = partial_file(path, os.getpid())
    mine.write_bytes(b"x")
    assert [(p.path, p.writing) for p in partial_files(path)] == [(mine, True)]
    assert stale_partials(path) == []
