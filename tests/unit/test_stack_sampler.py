"""StackSampler records where the sampled thread is, and tallies the innermost frames at exit."""

from __future__ import annotations

import time

import pytest
from bigmoe_bench.stack_sampler import StackSampler


def busy_in_a_named_function(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


@pytest.mark.parametrize("period_s", [0.05, 0.1])
def test_samples_show_the_function_the_thread_is_in(tmp_path, period_s):
    path = tmp_path / "stacks.txt"
    with StackSampler(path, period_s=period_s) as sampler:
        busy_in_a_named_function(1.0)  # long enough for a few samples on a loaded 2-core machine
    text = path.read_text()
    assert text.count("== t=") >= 3
    assert "busy_in_a_named_function" in text
    assert sum(sampler.tally.values()) == text.count("== t=")
    assert text.rstrip().splitlines()[-1].strip()[0].isdigit()  # the tally closes the file
