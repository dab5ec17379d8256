"""Every test here needs a CUDA GPU (the H200 through the device tool); without one each module is skipped, visibly."""

import gc
import sys

import pytest
import torch

FAILED_TEST_REFS = ("last_type", "last_value", "last_traceback", "last_exc")
"""Where pytest keeps a failed test's exception (and through its traceback, every local of its frames) until the
next test's call phase begins."""


@pytest.fixture(scope="module", autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(autouse=True)
def nothing_left_of_a_failed_test():
    """A failed test's frames hold its CUDA graphs, host copier and pinned buffers in reference cycles; pytest lets
    go of them only as the next test's call begins, and a garbage collection that then falls inside that test's
    capture destroys a graph mid-capture, which voids the capture ("operation not permitted when stream is
    capturing (function reset)") and leaves torch's generator broken for every later test (run 41: one failure, then
    16 more). They are collected here, before the test captures anything. The collector stays on during captures:
    the pager's own objects must stay safe to collect then (test_capture_safety_gpu.py)."""
    if any(hasattr(sys, name) for name in FAILED_TEST_REFS):
        for name in FAILED_TEST_REFS:
            if hasattr(sys, name):
                delattr(sys, name)
        gc.collect()
    yield
