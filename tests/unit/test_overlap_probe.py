"""scripts/gpu_overlap_probe.py's wiring on CPU (eager, in order): each variant runs its part of the prefetch path.

The GPU run times them; here only what each variant moves is checked, through the pager's own counters.
"""

from __future__ import annotations

import json

import gpu_overlap_probe as probe  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
from bigmoe_bench.stall_report import chain_words, finished_within, stall_words
from bigmoe_pager.core.device_layer import DeviceLayerPager
from bigmoe_pager.core.host_copier import publish


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "overlap.json"
    argv = ["--device", "cpu", "--smoke", "--families", "standard", "--recalls", "0,1.0", "--out", str(out)]
    argv += ["--profile-tokens", "2"]
    variants = "none,fork,gather,admit,inline,prefetch,prefetch-p2,prefetch-p2-hi-joinnow,router,router-p2-hi"
    variants += ",onenode,onenode-bare"
    argv += ["--variants", variants]
    assert probe.main(argv) == 0
    return json.loads(out.read_text())


def _row(report, variant, recall):
    return next(r for r in report["runs"] if r["variant"] == variant and r["recall"] == recall)


@pytest.mark.parametrize("variant", ["none", "fork"])
def test_variants_without_proposals_prefetch_nothing(report, variant):
    assert _row(report, variant, None)["prefetched_per_token"] == 0


@pytest.mark.parametrize("recall", [0.0, 1.0])
def test_gathering_alone_prefetches_nothing(report, recall):
    assert _row(report, "gather", recall)["prefetched_per_token"] == 0


@pytest.mark.parametrize("variant", ["admit", "inline", "prefetch", "prefetch-p2"])
def test_right_proposals_are_admitted_and_raise_the_hit_rate(report, variant):
    plain, right = _row(report, "none", None), _row(report, variant, 1.0)
    assert right["prefetched_per_token"] > 0
    assert right["vram_hit"] > plain["vram_hit"]


def test_a_decision_in_line_believes_what_one_on_the_side_stream_does(report):
    side, inline = _row(report, "admit", 1.0), _row(report, "inline", 1.0)
    assert side["vram_hit"] == inline["vram_hit"] and side["prefetched_per_token"] == inline["prefetched_per_token"]


@pytest.mark.parametrize("recall", [0.0, 1.0])
def test_the_one_node_kernel_admits_what_a_decision_beside_the_steps_does(report, recall):
    """onenode: every later layer's round decided by one kernel a token and copied by the host thread."""
    side, one = _row(report, "admit", recall), _row(report, "onenode", recall)
    assert side["vram_hit"] == one["vram_hit"] and side["prefetched_per_token"] == one["prefetched_per_token"]
    assert (one["prefetched_per_token"] > 0) == (recall > 0)


def test_the_bare_one_node_path_prefetches_nothing(report):
    """onenode-bare: the joinless steps and the drain without the kernel: nothing is ever prefetched."""
    assert _row(report, "onenode-bare", 1.0)["prefetched_per_token"] == 0


def test_removed_variants_are_refused():
    for gone in ("instep", "onenode-idle16"):  # removed in session 35 with BIGMOE_PREFETCH_IN_STEP / _IDLE_EVERY
        with pytest.raises(ValueError):
            probe.Variant.parse(gone)


@pytest.mark.parametrize("other", ["prefetch-p2", "prefetch-p2-hi-joinnow"])
def test_bounded_copies_priority_and_join_place_move_what_the_plain_prefetch_moves(report, other):
    full, bounded = _row(report, "prefetch", 1.0), _row(report, other, 1.0)
    for key in ("vram_hit", "pcie_gb_per_token", "prefetched_per_token"):
        assert full[key] == bounded[key]


@pytest.mark.parametrize("variant", ["router", "router-p2-hi"])
def test_the_live_router_is_one_row_with_counters_in_range(report, variant):
    """Its proposals come from a random router, not the trace: one row (no recall), and whatever the gate
    let through, counters that are rates and counts."""
    rows = [r for r in report["runs"] if r["variant"] == variant]
    assert [r["recall"] for r in rows] == [None]
    row = rows[0]
    assert 0 <= row["vram_hit"] <= 1 and row["pcie_gb_per_token"] >= 0 and row["prefetched_per_token"] >= 0


@pytest.mark.parametrize("variant,proposes", [("router", True), ("router-p2", True), ("none", False), ("fork", False)])
def test_the_live_router_proposes_its_top_k_to_each_next_layer_every_token(monkeypatch, variant, proposes):
    calls = []
    real = DeviceLayerPager.prefetch

    def spy(self, predicted_ids, stream=None, chain_flags=None):
        calls.append((self.layer, predicted_ids.tolist()))
        return real(self, predicted_ids, stream, chain_flags)

    monkeypatch.setattr(DeviceLayerPager, "prefetch", spy)
    argv = ["--device", "cpu", "--smoke", "--families", "standard", "--variants", variant]
    assert probe.main(argv) == 0
    if not proposes:
        assert calls == []
        return
    layers, experts, k, tokens = 3, 32, 4, 4 + 8  # the smoke shapes; warm-up and timed tokens
    assert sorted(layer for layer, _ in calls) == sorted(list(range(1, layers)) * tokens)
    assert all(len(set(ids)) == k and all(0 <= e < experts for e in ids) for _, ids in calls)


@pytest.mark.parametrize("name,programs", [("router", 0), ("router-p16-hi", 16), ("prefetch-p4", 4)])
def test_copy_programs_parse_for_the_variants_that_copy(name, programs):
    assert probe.Variant.parse(name).programs == programs


@pytest.mark.parametrize("bad", ["prefetch-x3", "warp", "none-p4", "prefetch-p2-skip", "router-x3", "gather-p2"])
def test_an_unknown_variant_is_one_line_and_exit_2(bad, capsys):
    assert probe.main(["--device", "cpu", "--smoke", "--variants", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_overlap_probe: unknown") and "\n" not in err


@pytest.mark.parametrize(
    "recalls,extra,refused",
    [("0.8", [], True), ("0,1.0", [], True), ("0", [], False), ("0.8", ["--profile-anyway"], False)],
)
def test_a_gpu_run_refuses_to_profile_beside_prefetching_host_rounds(recalls, extra, refused, capsys, monkeypatch):
    """Runs 36-37: after torch.profiler ran in a process, onenode at recall 0.8 crawled (every wait gave up after a
    second); the probe says so in one line instead of hanging. At recall 0 nothing is copied, and it goes on."""
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)  # (past the check: stop at the next one)
    argv = ["--variants", "none,onenode", "--recalls", recalls, "--profile-tokens", "8", *extra]
    assert probe.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert ("--profile-tokens with onenode" in err) == refused
    assert ("no CUDA GPU" in err) == (not refused)


def test_each_variant_is_profiled_and_a_cpu_run_has_no_kernels_to_summarize(report):
    profiled = report["runs"]
    assert profiled and all(r["profile"] == {"error": "the trace holds no GPU kernels"} for r in profiled)


def test_resident_is_reported_once_per_family(report):
    assert [r["variant"] for r in report["runs"]].count("resident") == 1


def test_every_row_has_its_worst_token(report):
    assert all(r["worst_token_ms"] >= r["ms_per_token"] > 0 for r in report["runs"] if r["variant"] != "resident")


def test_a_run_cut_short_keeps_the_rows_it_finished(monkeypatch, tmp_path):
    """Run 36's onenode run at recall 0.8 never ended and the probe was killed: the rows before it must be on disk."""
    out = tmp_path / "overlap.json"
    real = probe.Model.time

    def stalls_on_prefetch(self, trace_dev, predicted, name, order, args):
        if name == "gather":
            raise KeyboardInterrupt  # what `timeout -s INT` delivers to a run stuck in a sync
        return real(self, trace_dev, predicted, name, order, args)

    monkeypatch.setattr(probe.Model, "time", stalls_on_prefetch)
    argv = ["--device", "cpu", "--smoke", "--families", "standard", "--variants", "none,fork,gather", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        probe.main(argv)
    kept = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in kept] == ["resident", "none", "fork"]


def test_a_stalled_run_is_its_last_row_and_exit_3(monkeypatch, tmp_path, capsys):
    """A run whose GPU work does not finish is reported with what was read beside it, and the probe stops there."""
    out = tmp_path / "overlap.json"
    real = probe.Model.time
    seen = {"phase": "warm-up", "words": {"chain": {"forward": 7, "timeouts": 3}}}

    def stalls(self, trace_dev, predicted, name, order, args):
        if name == "gather":
            raise probe.Stalled(seen)
        return real(self, trace_dev, predicted, name, order, args)

    monkeypatch.setattr(probe.Model, "time", stalls)
    argv = [
        "--device",
        "cpu",
        "--smoke",
        "--families",
        "standard",
        "--variants",
        "none,gather,fork",
        "--dump-after",
        "0",
    ]
    assert probe.main(argv + ["--recalls", "0.8", "--out", str(out)]) == 3
    runs = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["resident", "none", "gather"]  # fork never ran
    assert runs[-1] == {"family": "standard", "variant": "gather", "recall": 0.8, "stalled": seen}
    assert capsys.readouterr().err.strip().endswith("gpu_overlap_probe: standard gather at recall 0.8 stalled")


@pytest.mark.parametrize("ready_after,seconds,finished", [(0, 0.05, True), (3, 1.0, True), (10**9, 0.05, False)])
def test_finished_within_polls_until_done_or_the_deadline(ready_after, seconds, finished):
    polls = []

    def done():
        polls.append(1)
        return len(polls) > ready_after

    assert finished_within(done, seconds, nap_s=0.001) is finished


def test_chain_words_name_each_word_and_one_stepped_forward_a_layer():
    from bigmoe_pager.core.prefetch_chain import FORWARD, LATE, OPEN, STEPPED

    flags = list(range(100, 100 + STEPPED)) + [5, 5, 4]
    words = chain_words(flags)
    assert words["forward"] == flags[FORWARD] and words["open"] == flags[OPEN] and words["late"] == flags[LATE]
    assert words["stepped"] == [5, 5, 4]


def test_host_copies_that_never_land_hold_the_rounds_back_after_the_limit(monkeypatch, tmp_path):
    """A host copier that serves no mailbox stands in for run 38's profiled process, where the copy engines' work
    stopped landing beside the kernels (on the CPU it cannot be produced otherwise). The forwards go on: the steps
    copy what they need themselves, each drain holds its late slots, and from LATE_LIMIT late drains on the rounds
    publish nothing, so no drain is late again though no copy ever lands."""
    from bigmoe_pager.core.prefetch_chain import LATE_LIMIT

    monkeypatch.setattr(probe, "serve_pager", lambda copier, pager, box: None)
    out = tmp_path / "late.json"
    argv = ["--device", "cpu", "--smoke", "--families", "standard", "--variants", "onenode", "--recalls", "1.0"]
    assert probe.main(argv + ["--out", str(out)]) == 0
    row = _row(json.loads(out.read_text()), "onenode", 1.0)
    assert row["late_drains"] == LATE_LIMIT  # (without the hold-back: 6 of the 12 forwards' drains, session 48)


@pytest.fixture
def host_rounds():
    """A smoke model's onenode rounds on the CPU (the interpreter), the host copier's thread serving their mailboxes."""
    args = probe._parse(["--device", "cpu", "--smoke"])
    args.layers, args.experts, args.top_k, args.hidden, args.inter, args.slots = 3, 32, 4, 128, 64, 12
    layout = probe.ExpertLayout.for_moe(args.hidden, args.inter, probe.torch.float8_e4m3fn, block=probe.BLOCK)
    model = probe.Model(args, layout, probe.torch.device("cpu"))
    model.restart([list(range(args.experts))] * args.layers, 0)
    predicted = probe.torch.zeros((4, args.layers, args.top_k), dtype=probe.torch.int64)
    rounds = probe.HostRounds(model, predicted, probe.Variant.parse("onenode"))
    yield rounds
    rounds.close()


def _served(rounds, experts: int) -> bool:
    return finished_within(lambda: rounds.copier.stats()["experts"] >= experts, 5.0)


def test_the_stall_report_names_a_copy_the_host_was_never_handed(host_rounds):
    """What run 37's report reads beside a stuck run: a slot whose target is past its copied word is under way, and
    the mailbox shows whether the host copier was handed it."""
    state = host_rounds.pagers[1].vram.kernel_state()
    state["target"][5] = int(state["copied"][5]) + 3
    report = stall_words(host_rounds, probe.torch.device("cpu"))
    layer = report["layers"][1]
    assert layer["under_way"] == 1 and layer["first"] == [[5, 0, 3, 0]]
    assert layer["box_seq_count"] == [0, 0] and report["host_copier"]["experts"] == 0
    assert all(other["under_way"] == 0 for i, other in enumerate(report["layers"]) if i != 1)
    assert set(report["chain"]) >= {"forward", "timeouts", "published", "stepped"}


def test_the_stall_report_sees_a_handed_copy_land(host_rounds):
    """Once the list is in the layer's mailbox, the real thread copies it and writes the goal: nothing is under way."""
    state = host_rounds.pagers[1].vram.kernel_state()
    state["target"][5] = 3
    publish(host_rounds.boxes[1], 7, rows=[2], slots=[5], goals=[3])
    assert _served(host_rounds, 1)
    layer = stall_words(host_rounds, probe.torch.device("cpu"))["layers"][1]
    assert layer["under_way"] == 0 and layer["box_seq_count"] == [7, 1]
