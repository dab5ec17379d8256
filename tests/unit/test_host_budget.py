"""bench's HostMemoryBudget: engines started on several threads wait while the host memory they would pin does not
fit beside the running engines', and one larger than the whole budget runs alone instead of hanging the call."""

from __future__ import annotations

import threading
import time

import pytest
from bigmoe_bench.host_budget import HostMemoryBudget

GB = 10**9


def run_engines(budget: HostMemoryBudget, needs: list[int], hold_s: float = 0.05) -> tuple[int, list[str]]:
    """Every need on its own thread, each holding its reservation `hold_s`; the most bytes ever held at once, and
    the lines the waiting engines said."""
    peak, said, lock = [0], [], threading.Lock()

    def engine(i: int, need: int) -> None:
        with budget.reserve(need, f"engine{i}", say=said.append):
            with lock:
                peak[0] = max(peak[0], budget.held)
            time.sleep(hold_s)

    threads = [threading.Thread(target=engine, args=(i, n)) for i, n in enumerate(needs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "an engine never got its reservation"
    return peak[0], said


@pytest.mark.parametrize(
    "total,needs,peak_at_most,waits",
    [
        (132 * GB, [36 * GB] * 3, 108 * GB, False),  # run 28's three engines: all at once
        (124 * GB, [36 * GB] * 4 + [22 * GB], 124 * GB, True),  # run 28's five: one waits
        (30 * GB, [36 * GB, 36 * GB], 36 * GB, True),  # each larger than the budget: one at a time
        (10 * GB, [0, 0, 0], 0, False),  # engines that pin nothing never wait
    ],
)
def test_engines_never_hold_more_than_the_budget_together(total, needs, peak_at_most, waits):
    budget = HostMemoryBudget(total)
    peak, said = run_engines(budget, needs)
    assert peak <= peak_at_most
    assert bool(said) == waits
    assert budget.held == 0


def test_a_waiting_engine_says_what_it_needs_and_starts_when_one_ends():
    budget = HostMemoryBudget(50 * GB)
    said: list[str] = []
    entered, leave = threading.Event(), threading.Event()

    def second() -> None:
        with budget.reserve(20 * GB, "second", say=said.append):
            entered.set()
            leave.wait(5)

    with budget.reserve(40 * GB, "first"):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.2)  # 40 + 20 GB would not fit in 50
    assert entered.wait(5) and budget.held == 20 * GB
    leave.set()
    waiter.join(timeout=5)
    assert budget.held == 0
    assert said == ["second waits for host memory: it needs 20.0 GB and the engines running hold 40.0 of 50.0 GB"]


def test_a_failed_engine_gives_its_reservation_back():
    budget = HostMemoryBudget(50 * GB)
    with pytest.raises(RuntimeError):
        with budget.reserve(40 * GB, "crashes"):
            raise RuntimeError("engine died")
    assert budget.held == 0 and budget.fits(50 * GB)
