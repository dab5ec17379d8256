"""Read planning for O_DIRECT gathers: sorted, deduplicated, coalesced reads that still yield the exact rows."""

from __future__ import annotations

import numpy as np
import pytest
from bigmoe_bench.ngram_synthetic import expected_rows, write_table
from bigmoe_pager.ngram import NgramTable, TableSpec
from bigmoe_pager.ngram.byte_gather import cut_rows
from bigmoe_pager.ngram.read_plan import SMALL_ROWS, plan_reads

ROW = 160
ROWS, PARTS = 9001, 3  # shards of 3001 rows (480,160 bytes), the last 2999
SHARD_ROWS = 3001
SPEC = TableSpec(rows=ROWS, row_elems=ROW, dtype="F8_E4M3", parts=PARTS)


def id_sets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    boundary = np.array([SHARD_ROWS - 1, SHARD_ROWS, 2 * SHARD_ROWS - 1, 2 * SHARD_ROWS, 0, ROWS - 1])
    return {
        "random": rng.integers(0, ROWS, 500),
        "duplicates": np.repeat(rng.integers(0, ROWS, 40), 5),
        "same-block": np.array([100, 101, 102, 103, 125, 126]),  # rows 100..103 share one 512 B block
        "straddling": np.array([3, 28, 51, 76]),  # rows that cross a 512 B or 4 KiB block boundary
        "shard-boundaries": np.concatenate([boundary, boundary[::-1]]),
        "dense-run": np.arange(1000, 4500),  # 560 KB contiguous, across a shard: split by max_read
        "unsorted-near": rng.permutation(np.arange(2000, 2400, 3)),
        "one": np.array([ROWS - 1]),
    }


IDS = id_sets()
PLANS = {
    "512-nomerge": dict(align=512, merge_gap=0, small_rows=0),
    "512-merge8k": dict(align=512, merge_gap=8192, small_rows=0),
    "4k-merge64k": dict(align=4096, merge_gap=65536, max_read=64 << 10, small_rows=0),
    "4k-tiny-max": dict(align=4096, merge_gap=4096, max_read=8192, small_rows=0),
    "512-default": dict(align=512, merge_gap=4096),  # sets of <= 64 rows take the one-read-per-row path
}


def fake_files(n_files: int, size: int) -> list[np.ndarray]:
    """In-memory stand-ins for files (a fake: only plan arithmetic is under test here, no device)."""
    rng = np.random.default_rng(n_files)
    return [rng.integers(0, 256, size, np.uint8) for _ in range(n_files)]


def execute(plan, files: list[np.ndarray]) -> np.ndarray:
    """Do the plan's reads as a device would: whole aligned reads, short at the end of a file."""
    scratch = np.zeros(plan.scratch_bytes, np.uint8)
    for f, start, length, need, slot in zip(plan.file, plan.start, plan.length, plan.need, plan.slot):
        got = files[f][start : start + length]
        assert got.size >= need  # the plan never needs bytes past the end of a file
        scratch[slot : slot + got.size] = got
    return scratch


@pytest.mark.parametrize("plan_kw", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_plan_yields_exact_rows_with_aligned_sorted_reads(ids, plan_kw):
    size = 400_000 + 13  # not a multiple of any alignment: the last read of a file comes back short
    files = fake_files(3, size)
    file_ids = (ids % 3).astype(np.int64)
    offsets = (ids * 37) % (size - ROW)  # arbitrary byte offsets, some near the end of a file
    plan = plan_reads(file_ids, offsets, ROW, **plan_kw)
    out = np.empty((ids.size, ROW), np.uint8)
    cut_rows(execute(plan, files), plan.row_at, ROW, out)
    want = np.stack([files[f][o : o + ROW] for f, o in zip(file_ids, offsets)])
    np.testing.assert_array_equal(out, want)
    align, max_read = plan_kw["align"], plan_kw.get("max_read", 256 << 10)
    assert (plan.start % align == 0).all() and (plan.length % align == 0).all()
    assert (plan.length <= max(max_read, 2 * align + ROW)).all() and (plan.need <= plan.length).all()
    if ids.size <= plan_kw.get("small_rows", SMALL_ROWS):
        assert plan.reads == ids.size  # one read per row, in the caller's order
        return
    same_file = plan.file[1:] == plan.file[:-1]
    # sorted; reads overlap by at most the one block a max_read cut can fall inside
    assert (plan.start[1:][same_file] >= (plan.start + plan.length - align)[:-1][same_file]).all()
    assert plan.reads <= np.unique(np.stack([file_ids, offsets]), axis=1).shape[1]


@pytest.mark.parametrize("align", [512, 4096])
def test_rows_in_one_block_and_repeated_rows_are_one_read(align):
    offsets = np.array([1024, 1184, 1024, 1344, 1184])  # three rows inside bytes 1024..1504, two repeated
    plan = plan_reads(np.zeros(5, np.int64), offsets, ROW, align=align, merge_gap=0, small_rows=0)
    assert plan.reads == 1 and plan.start[0] == 1024 // align * align and plan.need[0] == 1504 - plan.start[0]


def test_no_rows_plan_no_reads():
    plan = plan_reads(np.zeros(0, np.int64), np.zeros(0, np.int64), ROW, align=512)
    assert (plan.reads, plan.scratch_bytes, plan.row_at.size) == (0, 0, 0)


def test_merge_gap_decides_whether_near_rows_share_a_read():
    offsets = np.array([0, 8192 + 512])  # aligned spans 0..512 and 8704..9216: a gap of 8192 bytes
    assert plan_reads(np.zeros(2, np.int64), offsets, ROW, align=512, merge_gap=8191, small_rows=0).reads == 2
    assert plan_reads(np.zeros(2, np.int64), offsets, ROW, align=512, merge_gap=8192, small_rows=0).reads == 1
    assert plan_reads(np.zeros(2, np.int64), offsets, ROW, align=512, merge_gap=8192).reads == 2  # small set
    other_files = plan_reads(np.array([0, 1]), np.array([0, 160]), ROW, align=512, merge_gap=1 << 20, small_rows=0)
    assert other_files.reads == 2  # never merged across files


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(align=1000), "power of two"),
        (dict(align=512, merge_gap=-1), "merge_gap"),
        (dict(align=4096, max_read=512), "max_read"),
    ],
)
def test_bad_plan_arguments_are_refused(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        plan_reads(np.zeros(1, np.int64), np.zeros(1, np.int64), ROW, **kw)


def test_cut_rows_refuses_an_offset_past_the_buffer():
    buf = np.arange(1000, dtype=np.uint64).astype(np.uint8)
    out = np.empty((2, ROW), np.uint8)
    cut_rows(buf, np.array([0, 1000 - ROW]), ROW, out)
    np.testing.assert_array_equal(out[1], buf[-ROW:])
    with pytest.raises(IndexError):
        cut_rows(buf, np.array([1000 - ROW + 1]), ROW, out[:1])


# ---- the same through the O_DIRECT reader on real files ------------------------------------


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    # packed shards behind a 13-byte decoy: rows lie at odd byte offsets and cross blocks and shard ends
    return write_table(
        tmp_path_factory.mktemp("plan"), rows=ROWS, row_elems=ROW, parts=PARTS, shards_per_file=2, decoy_bytes=13
    )


@pytest.mark.parametrize(
    "reader_kw",
    [dict(align=512, merge_gap=0), dict(align=4096, merge_gap=65536), dict(merge_gap=8192)],
    ids=["512-nomerge", "4k-merge64k", "probed-align"],
)
@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
def test_direct_gather_is_exact_for_every_read_plan(shard_set, ids, reader_kw):
    with NgramTable.open(shard_set, spec=SPEC, direct=True, **reader_kw) as t:
        assert t.reader.align in (512, 4096)
        np.testing.assert_array_equal(t.gather(ids), expected_rows(ids, ROW))
        stats = t.stats()
    assert stats["rows_read"] == np.unique(ids).size and 1 <= stats["reads"] <= stats["rows_read"]


def test_direct_gather_of_a_dense_run_uses_few_reads(shard_set):
    ids = IDS["dense-run"]
    with NgramTable.open(shard_set, spec=SPEC, direct=True, merge_gap=0) as t:
        np.testing.assert_array_equal(t.gather(ids.reshape(-1, 7)), expected_rows(ids, ROW).reshape(-1, 7, ROW))
        assert t.stats()["reads"] <= 4  # 560 KB over 2 files in reads of at most 256 KiB
