"""Dequantization and the prefetcher on CPU tensors (the CUDA path runs in tests/gpu/test_ngram_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_bench.ngram_synthetic import expected_rows, write_table
from bigmoe_pager.ngram import NgramRangeError, NgramTable
from bigmoe_pager.ngram.dequant import dequantize_rows
from bigmoe_pager.ngram.prefetch import RowPrefetcher

ROWS = 3001


def e4m3_reference(byte: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (fn) bytes decoded from the bit layout, written out plainly: 1 sign, 4 exponent (bias 7), 3 mantissa."""
    b = byte.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * value)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    paths = write_table(tmp_path_factory.mktemp("t"), rows=ROWS, row_elems=160, parts=3, scale=0.25)
    with NgramTable.open(paths) as t:
        yield t


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_the_bit_layout_times_scale(out_dtype):
    raw = np.arange(256, dtype=np.uint8).reshape(2, 128)
    got = dequantize_rows(torch.from_numpy(raw), "F8_E4M3", 0.25, out_dtype).float().numpy()
    want = torch.tensor(e4m3_reference(raw) * 0.25, dtype=torch.float32).to(out_dtype).float().numpy()
    np.testing.assert_array_equal(got, want)  # NaN where both are NaN


def test_dequantize_without_scale_is_the_plain_cast():
    raw = torch.tensor([[0x38, 0xB8]], dtype=torch.uint8)  # +1.0, -1.0
    assert dequantize_rows(raw, "F8_E4M3", None, torch.float32).tolist() == [[1.0, -1.0]]


def test_prefetch_start_finish_equals_gather(table):
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, ROWS, (48, 16)))
    pf = RowPrefetcher(table, max_ids=1024, device="cpu")
    try:
        for _ in range(2):  # the staging buffer is reused step after step
            out = torch.empty(48, 16 * 160, dtype=torch.uint8)
            pf.start(ids)
            pf.finish(out)
            np.testing.assert_array_equal(out.numpy().reshape(-1, 160), expected_rows(ids.numpy().reshape(-1), 160))
        np.testing.assert_array_equal(pf.lookup(ids).numpy(), out.numpy().reshape(48, 16, 160))
    finally:
        pf.close()


def test_prefetch_surfaces_a_failed_gather_at_finish(table):
    pf = RowPrefetcher(table, max_ids=64, device="cpu")
    try:
        pf.start(torch.tensor([1, ROWS + 5]))
        with pytest.raises(NgramRangeError):
            pf.finish(torch.empty(2, 160, dtype=torch.uint8))
        with pytest.raises(ValueError, match="exceeds its staging buffer"):
            pf.start(torch.zeros(65, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="without start"):
            pf.finish(torch.empty(1, 160, dtype=torch.uint8))
    finally:
        pf.close()
