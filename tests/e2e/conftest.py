"""The e2e tests start real vLLM processes, which inherit this process's environment:
Triton's interpreter switch (set for the unit tests' kernels) must not reach them.

CI runs the suite on two pytest-xdist workers (`--dist loadgroup`). Tests that share an expensive
fixture value (greedy tokens of an unpaged engine) are put in one xdist group here, so that value is
computed once, on one worker; every other test is scheduled on its own."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SHARED_VALUE_GROUPS = {
    # test function -> the xdist group of one of its cases; tests not named here are each their own unit
    "test_paged_tokens_equal_resident_tokens": lambda item: f"resident-tokens-{item.callspec.params['shape']}",
    "test_paging_file_serves_the_same_tokens_and_refuses_another_model": lambda item: "resident-tokens-settings",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into the node ids
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.parent != HERE:
            continue
        group = SHARED_VALUE_GROUPS.get(getattr(item, "originalname", ""))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.fixture(scope="module", autouse=True)
def vllm_sees_no_triton_interpreter():
    saved = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
