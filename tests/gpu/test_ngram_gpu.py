"""The n-gram prefetcher on a real GPU: ids down, rows read from the files, rows up, dequantized on the device.

Run on the H200 from the repo root: PYTHONPATH=pager:app python -m pytest tests/gpu/test_ngram_gpu.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bigmoe_bench.ngram_synthetic import expected_rows, write_table
from bigmoe_pager.ngram import NgramRangeError, NgramTable
from bigmoe_pager.ngram.dequant import dequantize_rows
from bigmoe_pager.ngram.prefetch import RowPrefetcher

pytestmark = pytest.mark.gpu
ROWS, HEADS, ROW = 20011, 16, 160


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_table(tmp_path_factory.mktemp("ngram"), rows=ROWS, row_elems=ROW, parts=7, scale=0.375, decoy_bytes=24)


@pytest.fixture(params=["page-cache", "direct+rows"])
def table(request, files):
    with NgramTable.open(
        files, direct=request.param != "page-cache", cache_rows=512 if request.param != "page-cache" else 0
    ) as t:
        yield t


def test_consecutive_steps_get_their_own_rows(table):
    """Each step's finish() copies asynchronously; the next start() must not overwrite rows still in flight."""
    pf = RowPrefetcher(table, max_ids=2048 * HEADS, device="cuda")
    rng = np.random.default_rng(0)
    try:
        outs, ids_all = [], []
        for tokens in (2048, 1, 7, 2048, 1):
            ids = torch.from_numpy(rng.integers(0, ROWS, (tokens, HEADS))).cuda()
            torch.cuda._sleep(2_000_000)  # keep the stream busy so copies really overlap the next step
            out = torch.empty(tokens, HEADS * ROW, dtype=torch.uint8, device="cuda")
            pf.start(ids)
            pf.finish(out)
            outs.append(out)
            ids_all.append(ids)
        torch.cuda.synchronize()
        for out, ids in zip(outs, ids_all):
            np.testing.assert_array_equal(
                out.cpu().numpy().reshape(-1, ROW), expected_rows(ids.cpu().numpy().reshape(-1), ROW)
            )
    finally:
        pf.close()


def test_device_dequant_is_vllms_arithmetic_on_the_device(table):
    """On the GPU, dequantized rows equal vLLM's formula (fp8 -> bf16, times the bf16 scale) run on the GPU,
    and stay within one bf16 rounding of the exact product. CPU and GPU bf16 multiplies may round
    differently (seen on the H200), so the CPU result is not the reference here."""
    ids = np.random.default_rng(1).integers(0, ROWS, (64, HEADS))
    host = torch.from_numpy(table.gather(ids))
    got = dequantize_rows(host.cuda(), "F8_E4M3", table.scale, torch.bfloat16)
    fp8 = host.cuda().view(torch.float8_e4m3fn)
    vllm_formula = fp8.to(torch.bfloat16) * torch.tensor(table.scale, device="cuda").to(torch.bfloat16)
    exact = fp8.double() * float(torch.tensor(table.scale).to(torch.bfloat16))
    nan = torch.isnan(exact)  # random rows hold E4M3's NaN bytes (0x7F, 0xFF)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), vllm_formula[~nan].view(torch.int16))
    assert torch.allclose(got[~nan].double(), exact[~nan], rtol=2**-8, atol=0)


def test_failed_gather_raises_at_finish_on_the_caller(table):
    pf = RowPrefetcher(table, max_ids=64, device="cuda")
    try:
        pf.start(torch.tensor([[0, ROWS]], device="cuda"))
        with pytest.raises(NgramRangeError):
            pf.finish(torch.empty(1, 2 * ROW, dtype=torch.uint8, device="cuda"))
    finally:
        pf.close()
