"""BIGMOE_GIL_SWITCH_US: a benchmark knob that sets the vLLM process's GIL switch interval when the pager installs."""

from __future__ import annotations

import logging
import sys

import pytest
from bigmoe_pager.adapters.vllm.process import set_gil_switch
from bigmoe_pager.settings import PagerSettings, SettingsError


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.mark.parametrize("us", [200, 1000, 20000])
def test_a_stated_interval_is_the_process_s_with_one_line(interval, caplog, us):
    settings = PagerSettings.from_env({"BIGMOE_GIL_SWITCH_US": str(us)})
    with caplog.at_level(logging.WARNING, logger="vllm.bigmoe_pager"):
        set_gil_switch(settings)
    assert sys.getswitchinterval() == pytest.approx(us / 1e6)
    assert [r.getMessage() for r in caplog.records] == [f"bigmoe: GIL switch interval {us} us (BIGMOE_GIL_SWITCH_US)"]


def test_unset_or_zero_leaves_python_s_own(interval, caplog):
    for settings in (PagerSettings(), PagerSettings.from_env({"BIGMOE_GIL_SWITCH_US": "0"})):
        set_gil_switch(settings)
        assert sys.getswitchinterval() == interval
    assert caplog.records == []


def test_a_bad_value_is_one_line():
    with pytest.raises(SettingsError, match=r"BIGMOE_GIL_SWITCH_US='-5' is not valid; expected a non-negative"):
        PagerSettings.from_env({"BIGMOE_GIL_SWITCH_US": "-5"})
