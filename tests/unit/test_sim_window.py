"""scripts/sim_window.py: the timeline model of prefetch rounds made D layers ahead, on hand-made decisions (the clock's
rules) and on a trace (the pager's decisions)."""

from __future__ import annotations

import pytest
import sim_window  # scripts/ is on pytest's pythonpath (pyproject)
from bigmoe_bench import traces
from sim_window import Decisions, Timing, decide, timeline

TIMING = Timing(compute_us=100.0, step_us=10.0, demand_us=50.0, copy_us=40.0, side_us=5.0)


def made(demand, prefetched=None, used=None) -> Decisions:
    tokens, layers = len(demand), len(demand[0])
    empty = [[[] for _ in range(layers)] for _ in range(tokens)]
    return Decisions(demand, prefetched or empty, used or [[list(x) for x in row] for row in empty])


def test_without_prefetch_a_token_is_its_layers_steps_computes_and_misses():
    got = timeline(made([[1, 0, 2], [0, 1, 0]]), 1, TIMING, prefetch=False)
    # 6 layers of (10 + 100) us, 4 misses of 50 us, over 2 tokens; nothing queues on the link
    assert got == {"tpot_ms": round((6 * 110 + 4 * 50) / 2 / 1000, 3), "prefetch_wait_us_per_token": 0.0}


@pytest.mark.parametrize("distance,wait_us", [(1, 95.0), (2, 0.0)])
def test_a_round_made_further_ahead_lands_before_its_step(distance, wait_us):
    """Layer 3 uses 5 prefetched experts: 200 us of copies. Made after step 2 (ends at 240 us; distance 1) they land
    at 440 us, 95 us after step 3 could start (345 us); made after step 1 (distance 2) they land at 325 us."""
    prefetched = [[[], [], [], [1, 2, 3, 4, 5]]]
    used = [[[], [], [], [1, 2, 3, 4, 5]]]
    got = timeline(made([[0, 0, 0, 0]], prefetched, used), distance, TIMING, prefetch=True)
    assert got["prefetch_wait_us_per_token"] == pytest.approx(wait_us)
    assert got["tpot_ms"] == pytest.approx((4 * 115 + wait_us) / 1000, abs=1e-3)


def test_a_step_s_misses_queue_behind_the_prefetch_copies_issued_before_them():
    """Layer 1's round (4 unused copies, 160 us) is on the link when layer 1's step copies its miss."""
    prefetched = [[[], [7, 8, 9, 10], []]]
    plain = timeline(made([[0, 1, 0]]), 1, TIMING, prefetch=True)
    queued = timeline(made([[0, 1, 0]], prefetched), 1, TIMING, prefetch=True)
    # the round starts at step 0's end (10 us) and holds the link to 170 us; step 1 decides at 125 us
    assert queued["tpot_ms"] - plain["tpot_ms"] == pytest.approx((170 - 125) / 1000, abs=1e-3)


def test_the_pager_s_decisions_use_only_what_they_prefetched_and_a_right_proposal_saves_misses():
    trace = traces.named_trace("standard", 60, 4, 256, 8)
    plain = decide(trace, None, 256, 32, "lru")
    right = decide(trace, traces.predictions(trace, 1.0, None, 256), 256, 32, "lru")
    assert all(not p for row in plain.prefetched for p in row)
    for t in range(60):
        for layer in range(4):
            assert set(right.used[t][layer]) <= set(right.prefetched[t][layer]) <= set(trace[t, layer].tolist())
    assert sum(map(sum, right.demand)) < sum(map(sum, plain.demand))


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert sim_window.main(["--distances", "0"]) == 2
    assert sim_window.main(["--recalls", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("sim_window: ") for line in err)


def test_the_recorded_family_plays_at_its_own_experts_with_the_same_share_as_slots():
    rows = sim_window.run(["recorded"], [0.8], [1, 2], 20, 10, 40, 102, "lru", {"t": TIMING})
    assert {(r["experts"], r["vram"], r["layers"]) for r in rows} == {(64, 26, 8)}
    assert [r["recall"] for r in rows] == [None, 0.8, 0.8]


def test_a_recorded_trace_too_short_for_the_tokens_asked_is_one_line_and_exit_2(capsys):
    assert sim_window.main(["--families", "recorded", "--tokens", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sim_window: the recorded trace holds")


def test_a_changed_timing_replays_the_same_decisions_on_its_own_clock():
    """Without the side branch's cost, every prefetch row is side_us a layer cheaper (no waits, no misses moved:
    the decisions are the same); rows without prefetch do not pay it either way."""
    free = sim_window.parse_timing("free:side_us=0")[1]
    rows = sim_window.run(["standard"], [0.0], [1], 30, 10, 4, 64, "lru", {"m": Timing(), "free": free})
    by = {(r["timing"], r["recall"]): r for r in rows}
    assert by[("m", None)]["tpot_ms"] == by[("free", None)]["tpot_ms"]
    assert by[("m", 0.0)]["tpot_ms"] - by[("free", 0.0)]["tpot_ms"] == pytest.approx(
        4 * Timing().side_us / 1000, abs=1e-3
    )
    assert by[("m", 0.0)]["misses_per_token"] == by[("free", 0.0)]["misses_per_token"]


@pytest.mark.parametrize(
    "text", ["noside", "measured:side_us=0", "x:sideus=0", "x:side_us=fast", "x:side_us=-1", ":side_us=0"]
)
def test_a_bad_timing_is_one_line_and_exit_2(capsys, text):
    assert sim_window.main(["--timing", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sim_window: --timing")


def test_a_timing_changes_only_the_keys_it_names():
    name, timing = sim_window.parse_timing("fast:step_us=4,demand_us=57.3")
    assert name == "fast" and timing == Timing(step_us=4.0, demand_us=57.3)


EIGHT_UNUSED = [[[], [1, 2, 3, 4, 5, 6, 7, 8]]]  # layer 0's round: 8 copies (320 us) no step uses


@pytest.mark.parametrize("drain,tpot_us", [(0.0, 230.0), (1.0, 330.0)])
def test_a_draining_token_end_waits_for_the_link(drain, tpot_us):
    """The round starts at step 0's end (10 us) and holds the link to 330 us; the two layers are done at 230 us."""
    timing = sim_window.replace(TIMING, drain=drain)
    got = timeline(made([[0, 0]], EIGHT_UNUSED), 1, timing, prefetch=True)
    assert got["tpot_ms"] == pytest.approx(tpot_us / 1000, abs=1e-3)


@pytest.mark.parametrize("slow,tpot_us", [(0.0, 230.0), (0.5, 330.0), (1.0, 430.0)])
def test_compute_beside_a_copy_stretches_by_the_busy_slow_share(slow, tpot_us):
    """Both layers' 100 us of compute run while the round's copies hold the link (to 330 us)."""
    timing = sim_window.replace(TIMING, busy_slow=slow)
    got = timeline(made([[0, 0]], EIGHT_UNUSED), 1, timing, prefetch=True)
    assert got["tpot_ms"] == pytest.approx(tpot_us / 1000, abs=1e-3)


def test_pacing_drops_the_copies_not_begun_when_their_step_starts():
    """Layer 1's round of 4 unused copies (issued at 10 us, landing at 50, 90, 130, 170) holds the link past step 1's
    start (115 us); paced, the fourth (not begun by then) is dropped, so the step's miss waits for the third only
    (130 us, not 170 us): 5 us behind no round at all instead of 45."""
    prefetched = [[[], [7, 8, 9, 10], []]]
    paced = sim_window.replace(TIMING, pace=1.0)
    plain = timeline(made([[0, 1, 0]]), 1, paced, prefetch=True)
    queued = timeline(made([[0, 1, 0]], prefetched), 1, TIMING, prefetch=True)
    dropped = timeline(made([[0, 1, 0]], prefetched), 1, paced, prefetch=True)
    assert queued["tpot_ms"] - plain["tpot_ms"] == pytest.approx(45 / 1000, abs=1e-3)
    assert dropped["tpot_ms"] - plain["tpot_ms"] == pytest.approx(5 / 1000, abs=1e-3)


def test_pacing_moves_a_later_round_up_the_queue_and_a_dropped_used_copy_becomes_a_miss():
    """Distance 2, compute 50 us: step 0 (ends 10 us) makes layer 1's round (4 unused copies) and layer 2's (expert
    11, used), landing at 210 us; layer 2 would start at 130 us. Paced, layer 1's two copies not begun at its start
    (65 us) are dropped and 11 lands at 130 us: no wait, against 80 us unpaced. A dropped copy the step uses is
    copied by the step, as a miss."""
    timing = sim_window.replace(TIMING, compute_us=50.0)
    prefetched = [[[], [7, 8, 9, 10], [11]]]
    used = [[[], [], [11]]]
    unpaced = timeline(made([[0, 0, 0]], prefetched, used), 2, timing, prefetch=True)
    paced = timeline(made([[0, 0, 0]], prefetched, used), 2, sim_window.replace(timing, pace=1.0), prefetch=True)
    assert unpaced["prefetch_wait_us_per_token"] == pytest.approx(80.0)
    assert paced["prefetch_wait_us_per_token"] == pytest.approx(0.0)
    begun = [[[], [9], []]]  # one copy for layer 1, begun at 10 us and landed at 50: kept, nothing waits
    kept = timeline(made([[0, 0, 0]], begun, begun), 1, sim_window.replace(timing, pace=1.0), prefetch=True)
    assert kept == timeline(made([[0, 0, 0]], begun, begun), 1, timing, prefetch=True)
    behind = [[[], [7, 8, 9], []]]  # layer 1 uses 9, the third copy: begins at 90 us, after step 1's start (65 us)
    used9 = [[[], [9], []]]
    miss = timeline(made([[0, 0, 0]], behind, used9), 1, sim_window.replace(timing, pace=1.0), prefetch=True)
    assert miss["prefetch_wait_us_per_token"] == pytest.approx(0.0)  # not waited for: dropped, copied as a miss
    # step 1 decides at 75 us; its miss waits for copy 8 (lands at 90 us) and takes 50 us: layer 1 ends at 140 + 55,
    # layer 2 at 195 + 10 + 55
    assert miss["tpot_ms"] == pytest.approx(0.260, abs=1e-6)
