"""Every test here needs a CUDA GPU (the H200 through the device tool); without one each module is skipped, visibly."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
