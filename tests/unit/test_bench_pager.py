"""The paging benchmark's code path on CPU (tiny shapes): every configuration runs and the JSON has the issue's keys."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench_pager  # scripts/ is on pytest's pythonpath (pyproject)
import pytest

RUN_KEYS = {
    "model",
    "config",
    "vram_frac",
    "ram_frac",
    "ms_per_token",
    "hit_rate",
    "pcie_gb_per_token",
    "floor_ms_per_token",
}


def test_smoke_run_writes_every_configuration(tmp_path):
    out, md = tmp_path / "pager.json", tmp_path / "pager.md"
    rc = bench_pager.main(
        [
            "--device",
            "cpu",
            "--smoke",
            "--tokens",
            "2",
            "--warmup",
            "2",
            "--configs",
            "static,bigmoe,bigmoe-lfu",
            "--out",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and not list(tmp_path.glob("*.tmp"))
    configs = sorted({(r["config"], r["vram_budget"]) for r in report["runs"]})
    assert configs == sorted(
        [("resident", 1.0)] + [(c, f) for c in ("static", "bigmoe", "bigmoe-lfu") for f in (0.125, 0.4)]
    )
    for run in report["runs"]:
        assert RUN_KEYS <= set(run)
        assert run["ms_per_token"] > 0
    big = [r for r in report["runs"] if r["config"] == "bigmoe"]
    assert all(0 < r["hit_rate"]["vram"] < 1 and r["pcie_gb_per_token"] > 0 for r in big)
    assert "| smoke | bigmoe |" in md.read_text()


def test_a_recorded_trace_of_the_wrong_shape_is_refused(tmp_path):
    trace = tmp_path / "t.npz"
    bench_pager.traces.save_trace(trace, bench_pager.traces.standard_trace(5, 3, 32, 3, seed=0))
    with pytest.raises(SystemExit, match="k = 4"):
        bench_pager.main(["--device", "cpu", "--smoke", "--tokens", "2", "--warmup", "2", "--trace", str(trace)])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own int() of loop bounds
def test_fused_and_two_launch_bigmoe_see_the_same_tiers():
    """The benchmark's bigmoe runner with the fused step (interpreted here) and with two launches:
    same counters and slots."""
    import torch

    br, shape, cpu = bench_pager.br, bench_pager.br.SMOKE, torch.device("cpu")
    layout = br.make_layout(shape)
    rams = br.make_ram_tiers(shape, layout, shape.layers, cpu, seed=0)
    trace = torch.from_numpy(bench_pager.traces.standard_trace(7, shape.layers, shape.experts, shape.top_k, seed=1))
    profile = bench_pager.HotProfile.from_trace(trace[:3].numpy(), shape.experts)
    x = torch.randn((1, shape.hidden)).to(torch.bfloat16)
    w = torch.softmax(torch.randn((1, shape.top_k)), dim=-1)
    runners = [br.Bigmoe(rams, layout, cpu, 0.4, profile, shape.top_k, fused=fused) for fused in (True, False)]
    assert [r.name for r in runners] == ["bigmoe", "bigmoe-unfused"]
    for runner in runners:
        bench_pager._time_runner(runner, trace, x, w, warmup=3, tokens=4, device=cpu)
    fused, plain = runners
    assert (fused.stats.read() == plain.stats.read()).all() and fused.stats.snapshot()["vram"].misses > 0
    for a, b in zip(fused.pagers, plain.pagers):
        assert torch.equal(a.vram.slot_expert, b.vram.slot_expert)
        full = a.vram.slot_expert >= 0
        assert all(
            torch.equal(a.buffers[n][full].view(torch.uint8), b.buffers[n][full].view(torch.uint8)) for n in a.buffers
        )


def test_prefetch_runs_report_accuracy_that_grows_with_recall(tmp_path):
    """bigmoe-prefetch on the topic-shift family: recall 1 prefetches most needs, recall 0 none; tokens as without."""
    out = tmp_path / "pager.json"
    rc = bench_pager.main(
        [
            "--device",
            "cpu",
            "--smoke",
            "--tokens",
            "8",
            "--warmup",
            "2",
            "--family",
            "topic-shift",
            "--configs",
            "bigmoe-lfu-fast,bigmoe-prefetch",
            "--recalls",
            "0,1",
            "--precision",
            "1",
            "--prefetch-budget",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    runs = {(r["config"], r["vram_budget"]): r for r in json.loads(out.read_text())["runs"]}
    for frac in (0.125, 0.4):
        none, full = runs[("bigmoe-lfu-fast-prefetch-r0", frac)], runs[("bigmoe-lfu-fast-prefetch-r1", frac)]
        assert none["prefetched_per_token"] == 0 and none["prediction_accuracy"] in (0.0, None)
        assert none["hit_rate"] == runs[("bigmoe-lfu-fast", frac)]["hit_rate"]  # no prediction: the same pager
        assert full["hit_rate"]["vram"] >= none["hit_rate"]["vram"]
        assert full["prefetch_wasted_gb_per_token"] <= full["pcie_gb_per_token"]
    # At 12.5% the smoke shape's slots barely exceed one token's experts: the latest step's stay, little is free.
    full = runs[("bigmoe-lfu-fast-prefetch-r1", 0.4)]
    assert (
        full["prediction_accuracy"] > 0.6
        and full["hit_rate"]["vram"] > runs[("bigmoe-lfu-fast", 0.4)]["hit_rate"]["vram"]
    )


def test_unknown_family_is_refused_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench_pager.main(["--device", "cpu", "--smoke", "--family", "zipfy"])
    assert e.value.code == 2 and "zipfy" in capsys.readouterr().err
