"""scripts/gpu_qwen4exp_bench.py's configuration names: @rX replays the family trace with next-layer predictions at
recall X for the checkpoint's own experts, +ahead turns on SSD read-ahead, +ahead4 four layers deep (the GPU run
itself is the lead's)."""

from __future__ import annotations

import json
from pathlib import Path

import gpu_qwen4exp_bench as q4x  # scripts/ is on pytest's pythonpath (pyproject)
import numpy as np
import pytest
from bigmoe_bench import traces
from bigmoe_pager.core.odirect import odirect_works
from bigmoe_pager.settings import PagerSettings
from qwen4exp_tiny import TINY_QWEN4EXP

SHAPES = {"4-layer x 512, top-10": (4, 512, 10), "3-layer x 64, top-8": (3, 64, 8)}


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def numbers(request) -> dict:
    layers, experts, top_k = SHAPES[request.param]
    return {"layers": layers, "experts": experts, "top_k": top_k, "vocab": 1000}


@pytest.fixture
def family_trace(tmp_path: Path, numbers: dict) -> Path:
    path = tmp_path / "topic-shift-trace.npz"
    ids = traces.named_trace("topic-shift", 600, numbers["layers"], numbers["experts"], numbers["top_k"], seed=0)
    traces.save_trace(path, ids)
    return path


@pytest.mark.parametrize(
    "name,recall,ahead",
    [
        ("bigmoe-4090", None, 0),
        ("bigmoe-4090@r0.8", 0.8, 0),
        ("bigmoe-4090@r0.8+ahead", 0.8, 1),
        ("bigmoe-allram@r1", 1.0, 0),
        ("bigmoe-4090-nongram@r0+ahead", 0.0, 1),
        ("bigmoe-4090@r1.0+ahead4", 1.0, 4),
    ],
)
@pytest.mark.parametrize("precision", [None, 0.5], ids=["top-k", "precision-0.5"])
def test_a_name_replays_predictions_at_its_recall_for_the_checkpoints_experts(
    name, recall, ahead, precision, numbers, family_trace
):
    named = {c.name: (c, extra) for c, extra in q4x.configs(family_trace, numbers, 35, 218, 6.4)}
    predicted = (
        {recall: q4x.predicted_trace(family_trace, recall, precision, numbers["experts"])} if recall is not None else {}
    )
    config, _ = q4x.with_suffixes(name, named, predicted)
    assert config.name == name
    assert (config.env.get("BIGMOE_SSD_READ_AHEAD") == "1") is (ahead > 0)  # ahead: layers deep (0: off)
    assert PagerSettings.from_env(config.env).ssd_read_ahead_layers == max(ahead, 1)
    replay = Path(config.env["BIGMOE_ROUTE_REPLAY"])
    truth = traces.load_trace(family_trace, numbers["experts"])
    assert np.array_equal(traces.load_trace(replay, numbers["experts"]), truth)
    predicted = traces.load_predictions(replay, numbers["experts"])
    if recall is None:
        assert replay == family_trace and predicted is None
        return
    assert predicted is not None and predicted.shape[:2] == truth.shape[:2]
    hits = needed = 0
    for t in range(truth.shape[0]):
        for layer in range(truth.shape[1] - 1):
            nxt = set(truth[t, layer + 1].tolist())
            hits += len(nxt & set(predicted[t, layer].tolist()))
            needed += len(nxt)
    assert hits / needed == pytest.approx(recall, abs=0.02)
    proposed = int((predicted[:, :-1] >= 0).sum())
    wanted = recall if precision is None else precision  # top-k proposes k ids a row: precision = recall
    if proposed:
        assert hits / proposed == pytest.approx(wanted, abs=0.03)
    if precision is None:
        assert predicted.shape[2] == numbers["top_k"]


def test_a_second_checkpoint_in_the_same_workdir_gets_its_own_predictions(tmp_path: Path):
    """The predicted trace is remade from the family trace at hand, never kept from an earlier model's run."""
    path = tmp_path / "standard-trace.npz"
    for layers, experts in ((3, 64), (4, 512)):
        traces.save_trace(path, traces.named_trace("standard", 200, layers, experts, 8, seed=0))
        replay = q4x.predicted_trace(path, 0.8, 0.5, experts)
        predicted = traces.load_predictions(replay, experts)
        assert predicted.shape[1] == layers and predicted.max() < experts


@pytest.mark.parametrize("precision", ["0", "1.5", "-0.2"])
def test_a_precision_outside_its_range_is_one_clear_line(precision, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_:
        q4x.main(["--model", str(tmp_path), "--out", str(tmp_path / "o.json"), "--precision", precision])
    assert exit_.value.code == 2
    assert "--precision is the share of a proposal that is right" in capsys.readouterr().err


def test_the_bench_reads_the_checkpoint_and_names_each_rows_trace_before_any_engine(tmp_path: Path, capsys):
    """--budget-s 0: every row is reported as not run, after the bench has read the checkpoint's numbers and written
    the family trace and each @rX row's predictions (what broke before any engine started, session 62)."""
    from bigmoe.model.tinymoe.qwen4exp import make_qwen4exp
    from bigmoe.model.tinymoe.qwen4exp_shape import Qwen4ExpShape

    shape = Qwen4ExpShape(layers=3, **TINY_QWEN4EXP)
    model = make_qwen4exp(tmp_path / "ckpt", shape, "fp8", seed=0, with_tokenizer=False)
    out = tmp_path / "bench.json"
    names = ["bigmoe-4090", "bigmoe-4090@r0.8+ahead"]
    argv = [
        "--model",
        str(model),
        "--out",
        str(out),
        "--configs",
        ",".join(names),
        "--budget-s",
        "0",
        "--disk-s",
        "0.3",
    ]
    code = q4x.main([*argv, "--workdir", str(tmp_path / "work"), "--vram-slots", "4", "--ram-slots", "8"])
    report = json.loads(out.read_text())
    direct, why = odirect_works(model)
    if direct:  # the disk was read as the SSD tier reads it: whole expert records of this checkpoint
        assert report["disk"]["gb_per_s"] > 0 and report["disk"]["reads"] > 0, why
        assert report["disk"]["record_bytes"] == q4x.expert_layout(model).record_bytes >= q4x.expert_bytes(model)
    else:
        assert "O_DIRECT" in report["disk"]["error"], why
    assert code == 1 and [row["name"] for row in report["configs"]] == names
    assert all(row["error"] == "not run: time budget spent" for row in report["configs"])
    assert (report["experts"], report["top_k"], report["precision"]) == (12, 4, "top-k")
    plain, predicted = (Path(row["env"]["BIGMOE_ROUTE_REPLAY"]) for row in report["configs"])
    assert traces.load_predictions(plain, 12) is None
    assert traces.load_predictions(predicted, 12).shape[1:] == (3, 4)
    assert predicted.parent == tmp_path / "work" and report["configs"][1]["env"]["BIGMOE_SSD_READ_AHEAD"] == "1"


def child_result(tpot_ms: float) -> dict:
    """What scripts/vllm_e2e_child.py's bench task writes for one engine (bench_all: one measurement, no trace list)."""
    decode = {
        "vram": {"lookups": 1000, "hits": 770, "bytes_moved": 0, "prefetched": 512, "prefetch_used": 200},
        "ram": {"lookups": 230, "hits": 170, "bytes_moved": 11_500_000_000},
        "ssd": {"lookups": 60, "hits": 60, "bytes_moved": 3_000_000_000},
    }
    measurement = {
        "tokens": [5, 6, 7],
        "ttft_ms": 190.5,
        "tpot_ms": tpot_ms,
        "decode_counters": decode,
        "timed_counters": decode,
        "decode_tokens": 256,
        "pcie_gb_per_token": 0.04492,
        "ssd_gb_per_token": 0.01172,
    }
    return {"measurements": [measurement], "startup_s": 151.0, "turn_wait_s": 0.0, "cudagraph_mode": "PIECEWISE"}


@pytest.mark.parametrize(
    "row,expected",
    [
        (
            {"name": "bigmoe-4090@r0.8", "env": {}, "seconds": 170.2, "result": child_result(20.45)},
            {
                "tpot_ms": 20.45,
                "ttft_ms": 190.5,
                "startup_s": 151.0,
                "cudagraph_mode": "PIECEWISE",
                "tokens": [5, 6, 7],
            },
        ),
        (
            {"name": "offload", "env": {}, "seconds": 3.0, "error": "exit 1: CUDA out of memory"},
            {"error": "exit 1: CUDA out of memory"},
        ),
        (
            {"name": "resident", "env": {}, "error": "not run: time budget spent"},
            {"error": "not run: time budget spent"},
        ),
        (
            {"name": "resident", "env": {}, "seconds": 9.0, "result": {"measurements": []}},
            {"error": "the engine returned no measurement"},
        ),
    ],
    ids=["measured", "failed", "not-run", "no-measurement"],
)
def test_a_report_row_is_the_engines_summary_or_its_error(row, expected):
    got = q4x.report_row(row)
    assert got["name"] == row["name"] and got.get("seconds") == row.get("seconds")
    assert {k: got.get(k) for k in expected} == expected
    assert ("error" in got) is ("error" in expected)
    if "error" not in got:
        assert got["decode_hit_rate"] == {"vram": 0.77, "ram": 0.7391, "ssd": 1.0}
        assert got["prefetch_accuracy_vram"] == round(200 / (200 + 230), 4)


@pytest.mark.parametrize(
    "disk,floor_ms",
    [(None, None), ({"error": "cannot open the checkpoint for O_DIRECT reads"}, None), ({"gb_per_s": 1.5}, 7.813)],
    ids=["not-measured", "unreadable", "1.5-GB/s"],
)
def test_a_row_that_read_from_ssd_is_judged_against_the_disk_floor_of_its_bytes(disk, floor_ms):
    """The floor is the row's SSD GB a decoded token (0.01172) over the disk's measured GB/s; no bandwidth, no floor."""
    row = {"name": "bigmoe-4090@r1.0+ahead4", "env": {}, "seconds": 70.0, "result": child_result(9.5)}
    got = q4x.report_row(row, disk)
    assert got.get("disk_floor_tpot_ms") == floor_ms
    assert got.get("tpot_vs_disk_floor") == (None if floor_ms is None else round(9.5 / floor_ms, 3))
    failed = q4x.report_row({"name": "offload", "env": {}, "error": "exit 1"}, disk)
    assert "disk_floor_tpot_ms" not in failed


@pytest.mark.parametrize("drop", [0.0, 0.2, 0.5])
def test_a_recall_drop_makes_reads_further_ahead_replay_proposals_right_less_often(drop, numbers, family_trace):
    """--ahead-recall-drop X: the @r0.8 trace carries proposals 2 .. AHEAD_DEPTH layers ahead at 0.8 - X per layer
    past the next (never below 0); with 0 it carries none, and reads that far replay the next-layer rows."""
    replay = q4x.predicted_trace(family_trace, 0.8, None, numbers["experts"], drop)
    deeper = traces.load_predictions_ahead(replay, numbers["experts"])
    if not drop:
        assert deeper is None
        return
    truth = traces.load_trace(family_trace, numbers["experts"])
    layers, k = numbers["layers"], numbers["top_k"]
    assert deeper.shape[0] == q4x.AHEAD_DEPTH - 1 == 3
    for d in range(2, min(q4x.AHEAD_DEPTH, layers - 1) + 1):
        rows = deeper[d - 2, :, : layers - d].reshape(-1, deeper.shape[3]).tolist()
        hit = sum(len(set(p) & set(t)) for p, t in zip(rows, truth[:, d:].reshape(-1, k).tolist()))
        assert hit / truth[:, d:].size == pytest.approx(max(0.0, 0.8 - drop * (d - 1)), abs=0.03), d


@pytest.mark.parametrize("drop", ["-0.1", "1.5"])
def test_a_recall_drop_outside_its_range_is_one_clear_line(drop, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_:
        q4x.main(["--model", str(tmp_path), "--out", str(tmp_path / "o.json"), "--ahead-recall-drop", drop])
    assert exit_.value.code == 2
    assert "--ahead-recall-drop is recall lost per layer further ahead" in capsys.readouterr().err
