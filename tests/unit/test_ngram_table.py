"""NgramTable: exact rows from synthetic shard sets in every reader mode, and one-line errors for bad ones."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from bigmoe_bench.ngram_synthetic import DEFAULT_TABLE, expected_rows, write_table
from bigmoe_pager.ngram import NgramFileError, NgramLayoutError, NgramRangeError, NgramReadError, NgramTable, TableSpec
from safetensors.numpy import save_file

ROWS, ELEMS, PARTS = 5003, 160, 5  # shards of 1001 rows, the last 999: uneven

LAYOUTS = {
    "one-shard-per-file": dict(shards_per_file=1, decoy_bytes=64),
    "packed-unaligned": dict(shards_per_file=3, decoy_bytes=13),  # rows at odd byte offsets
}
MODES = {
    "page-cache": dict(),
    "page-cache+rows": dict(cache_rows=300),
    "direct": dict(direct=True),
    "direct+rows": dict(direct=True, cache_rows=300),
}
SPEC = TableSpec(rows=ROWS, row_elems=ELEMS, dtype="F8_E4M3", parts=PARTS)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def shard_set(request, tmp_path_factory) -> list[Path]:
    return write_table(
        tmp_path_factory.mktemp(request.param), rows=ROWS, row_elems=ELEMS, parts=PARTS, **LAYOUTS[request.param]
    )


@pytest.fixture(params=sorted(MODES))
def table(request, shard_set):
    with NgramTable.open(shard_set, spec=SPEC, **MODES[request.param]) as t:
        yield t


def boundary_ids() -> np.ndarray:
    """First and last row of every shard, plus the table's ends."""
    starts = np.arange(PARTS) * 1001
    return np.unique(np.concatenate([starts, starts - 1, [0, ROWS - 1]]).clip(0, ROWS - 1))


@pytest.mark.parametrize("shape", [(), (16,), (4, 16), (2, 3, 16), (0, 16), (3000,)])
def test_gather_returns_exact_rows_for_any_shape(table, shape):
    ids = np.random.default_rng(sum(shape) + 1).integers(0, ROWS, shape)
    got = table.gather(ids)
    assert got.shape == (*shape, 160) and got.dtype == np.uint8
    np.testing.assert_array_equal(got.reshape(-1, 160), expected_rows(ids.reshape(-1), 160))


def test_gather_crosses_every_shard_boundary_and_repeats(table):
    ids = np.concatenate([boundary_ids(), boundary_ids()[::-1]])  # duplicates, unsorted
    np.testing.assert_array_equal(table.gather(ids.astype(np.int32)), expected_rows(ids, 160))


def test_gather_writes_into_the_given_buffer(table):
    ids = boundary_ids()[:8].reshape(2, 4)
    out = np.zeros((2, 4, 160), np.uint8)
    got = table.gather(ids, out=out)
    assert np.shares_memory(got, out)
    np.testing.assert_array_equal(out.reshape(-1, 160), expected_rows(ids.reshape(-1), 160))


def test_row_cache_serves_repeated_rows(shard_set):
    with NgramTable.open(shard_set, spec=SPEC, direct=True, cache_rows=64) as t:
        ids = np.arange(100, 116)
        first, second = t.gather(ids).copy(), t.gather(ids)
        np.testing.assert_array_equal(first, second)
        stats = t.stats()
    assert stats["cache_hits"] == 16 and stats["rows_read"] == 16 and stats["lookups"] == 32


def test_scale_and_geometry_come_from_the_checkpoint(shard_set):
    with NgramTable.open(shard_set) as t:  # no spec: everything inferred from the headers
        assert (t.rows, t.row_bytes, t.scale, t.shards.dtype) == (ROWS, 160, 0.5, "F8_E4M3")
        assert t.shards.table == DEFAULT_TABLE


def test_spec_from_the_real_config_matches_the_issue_numbers():
    config = {
        "text_config": {"ple_layer_ids": [2], "hidden_size": 2560, "split_ngram_parts": 128},
        "quantization_config": {"quant_method": "fp8"},
    }
    spec = TableSpec.from_config(config)
    assert (spec.rows, spec.row_bytes, spec.parts, spec.heads, spec.shard_rows) == (
        320_001_536,
        160,
        128,
        16,
        2_500_012,
    )
    assert spec.nbytes == 51_200_245_760


# ---- errors -------------------------------------------------------------------------


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


@pytest.mark.parametrize(
    "ids, fragment",
    [
        (np.array([0, ROWS]), f"row id {ROWS} is outside"),
        (np.array([[-1, 3]]), "row id -1 is outside"),
    ],
)
def test_out_of_range_ids_are_refused(table, ids, fragment):
    with pytest.raises(NgramRangeError) as e:
        table.gather(ids)
    assert fragment in one_line(e)


def test_non_integer_ids_are_refused(table):
    with pytest.raises(NgramRangeError) as e:
        table.gather(np.array([1.0, 2.0]))
    assert "integers" in one_line(e)


def write_broken(root: Path, case: str) -> tuple[list[Path], TableSpec | None]:
    """A shard set with one named fault, and the spec to open it with."""
    kw = dict(rows=ROWS, row_elems=ELEMS, parts=PARTS)
    if case == "gap":
        return write_table(root, skip_shards=frozenset({2}), **kw), None
    if case == "gap-vs-config":
        return write_table(root, skip_shards=frozenset({2}), **kw), SPEC
    if case == "wrong-dtype":
        return write_table(root, dtype="BF16", **kw), SPEC
    if case == "wrong-row-size":
        return write_table(root, rows=ROWS, row_elems=128, parts=PARTS), SPEC
    if case == "wrong-row-count":
        return write_table(root, rows=ROWS + 7, row_elems=ELEMS, parts=PARTS), SPEC
    if case == "too-many-shards":
        return write_table(root, rows=ROWS, row_elems=ELEMS, parts=PARTS + 1), SPEC
    if case == "no-table":
        save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}, str(root / "model.safetensors"))
        return [root / "model.safetensors"], None
    paths = write_table(root, **kw)
    if case == "missing-file":
        paths[3].unlink()
    elif case == "truncated-file":
        os.truncate(paths[1], paths[1].stat().st_size - 100)
    elif case == "not-safetensors":
        paths[0].write_bytes(os.urandom(4096))
    elif case == "half-written-header":
        paths[0].write_bytes(paths[0].read_bytes()[:40])
    return paths, SPEC


BROKEN = {
    "gap": (NgramLayoutError, "shard_2.weight is missing"),
    "gap-vs-config": (NgramLayoutError, "shard_2.weight is missing: rows 2002..3002"),
    "wrong-dtype": (NgramLayoutError, "are BF16 but the model config says F8_E4M3"),
    "wrong-row-size": (NgramLayoutError, "rows of 128 elements"),
    "wrong-row-count": (NgramLayoutError, "the model config needs"),
    "too-many-shards": (NgramLayoutError, "exceeds split_ngram_parts=5"),
    "no-table": (NgramLayoutError, "no n-gram table shards"),
    "missing-file": (NgramFileError, "checkpoint file not found"),
    "truncated-file": (NgramFileError, "truncated"),
    "not-safetensors": (NgramFileError, "not safetensors"),
    "half-written-header": (NgramFileError, "not safetensors or truncated"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_bad_shard_sets_fail_at_open_with_one_line(tmp_path, case):
    paths, spec = write_broken(tmp_path, case)
    kind, fragment = BROKEN[case]
    with pytest.raises(kind) as e:
        NgramTable.open(paths, spec=spec)
    assert fragment in one_line(e)


def test_checkpoint_without_the_table_is_refused(tmp_path):
    paths = write_table(tmp_path, rows=10, row_elems=4, parts=1, table="model.embed_tokens")
    with pytest.raises(NgramLayoutError) as e:
        NgramTable.open(paths, table=DEFAULT_TABLE)
    assert "not in the checkpoint" in one_line(e)


def test_two_tables_need_a_name(tmp_path):
    paths = write_table(tmp_path / "a", rows=10, row_elems=4, parts=1, table="a.ngram_embedding")
    paths += write_table(tmp_path / "b", rows=10, row_elems=4, parts=1, table="b.ngram_embedding")
    with pytest.raises(NgramLayoutError) as e:
        NgramTable.open(paths)
    assert "name one" in one_line(e)
    with NgramTable.open(paths, table="b.ngram_embedding") as t:
        assert t.rows == 10


def test_file_truncated_after_open_fails_the_direct_read_then_recovers(tmp_path):
    paths = write_table(tmp_path, rows=ROWS, row_elems=ELEMS, parts=PARTS)
    good = np.arange(1001, ROWS, 2)  # rows of shards 1..4, in the files left whole
    with NgramTable.open(paths, spec=SPEC, direct=True) as t:
        os.truncate(paths[0], 8)  # row 0 goes first, so the failure comes while good reads are in flight
        with pytest.raises(NgramReadError) as e:
            t.gather(np.concatenate([[0], good]))
        assert "short read" in one_line(e) and "after 2 retries" in str(e.value)
        np.testing.assert_array_equal(t.gather(good), expected_rows(good, 160))  # no stale completions
