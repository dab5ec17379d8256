"""The pinned host-to-device copy test on a real GPU: in this process and in a child process.

Run on the H200: PYTHONPATH=pager:app python -m pytest tests/gpu/test_measure_pcie_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from bigmoe.machine.hardware import Unknown  # noqa: E402
from bigmoe.machine.measure_pcie import COPY_BYTES, measure_h2d, measure_h2d_in_child  # noqa: E402

PLAUSIBLE_GBPS = (1.0, 200.0)
"""Any PCIe Gen3 x4 .. Gen6 x16 link (or NVLink-C2C) copies within this range."""


@pytest.mark.parametrize("measure", [measure_h2d, measure_h2d_in_child], ids=["in-process", "child"])
def test_pinned_copy_rate_is_measured(measure):
    rate = measure(0)
    assert not isinstance(rate, Unknown), rate
    assert PLAUSIBLE_GBPS[0] < rate.gbps <= rate.best_gbps < PLAUSIBLE_GBPS[1]
    assert rate.copy_bytes == COPY_BYTES and rate.repeats >= 3
    assert rate.device_name == torch.cuda.get_device_name(0)
    print(f"\n{measure.__name__}: {rate.gbps} GB/s median, {rate.best_gbps} best ({rate.basis})")


def test_a_gpu_index_beyond_the_machine_is_unknown():
    rate = measure_h2d(torch.cuda.device_count())
    assert isinstance(rate, Unknown) and "none with index" in rate.reason
