"""The e2e tests start real vLLM processes, which inherit this process's environment:
Triton's interpreter switch (set for the unit tests' kernels) must not reach them."""

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def vllm_sees_no_triton_interpreter():
    saved = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
