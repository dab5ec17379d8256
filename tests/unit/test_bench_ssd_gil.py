"""scripts/bench_ssd_gil.py: single-expert SSD reads through the service, idle and beside a GIL-busy thread."""

from __future__ import annotations

import json
import sys

import bench_ssd_gil  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import torch


def test_each_reader_and_interval_is_timed_idle_and_busy_and_python_s_own_comes_back(tmp_path):
    before = sys.getswitchinterval()
    out = tmp_path / "gil.json"
    argv = ["--dir", str(tmp_path), "--gb", "0.01", "--reads", "4", "--switch-us", "2000,100", "--out", str(out)]
    assert bench_ssd_gil.main([*argv, "--readers", "python,native"]) == 0
    assert sys.getswitchinterval() == before
    rows = json.loads(out.read_text())["rows"]
    assert [(r["reader"], r["switch_us"], r["busy_thread"]) for r in rows] == [
        (reader, interval, busy) for reader in ("python", "native") for interval in (2000, 100) for busy in (0, 1)
    ]
    assert all(0 < r["median_ms"] <= r["p90_ms"] and r["reads"] == 4 and r["path"] == "load" for r in rows)
    assert not (tmp_path / "bigmoe-bench-ssd-gil").exists()  # the script removes what it made


def test_a_batch_is_one_request_of_distinct_experts(tmp_path):
    """--batch N: each timed request reads N distinct experts of one layer at once (prefill's shape), by both
    readers."""
    out = tmp_path / "batch.json"
    argv = ["--dir", str(tmp_path), "--gb", "0.01", "--reads", "3", "--switch-us", "5000", "--batch", "5"]
    assert bench_ssd_gil.main([*argv, "--readers", "python,native", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["reader"], r["batch"]) for r in rows] == [("python", 5)] * 2 + [("native", 5)] * 2
    assert all(r["median_ms"] > 0 for r in rows)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--switch-us", "5000,0"], "--switch-us '5000,0': a comma list of positive integers"),
        (["--paths", "load,disk"], "--paths 'load,disk': a comma list of load, mailbox"),
        (["--readers", "rust"], "--readers 'rust': a comma list of python, native"),
        (["--batch", "0"], "--batch 0: between 1 and 256 experts"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        bench_ssd_gil.main(["--dir", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_gpu_s_way_in_is_refused_without_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_ssd_gil.main(["--dir", str(tmp_path), "--paths", "mailbox"])
    assert "--paths mailbox: the GPU's way in needs CUDA" in capsys.readouterr().err


def test_mailbox_reads_are_answered_through_the_request_kernel(tmp_path):
    """The GPU's way in, run by Triton's interpreter here: every request is answered (the service's check after each
    raises on a failed or abandoned read) and timed."""
    from bench_ssd import _open, _prepare
    from bigmoe_bench import synth_experts

    layout = synth_experts.make_layout(256, 128, True)
    ckpt, pf = tmp_path / "ckpt", tmp_path / "experts.bmpf"
    _prepare(ckpt, pf, layout, 256, 128, 2, 8)
    for reader in bench_ssd_gil.READERS:
        with _open("checkpoint", ckpt, pf, layout, 2, 8) as store:
            row = bench_ssd_gil._measure(store, "mailbox", 3, 2, busy=False, device="cpu", reader=reader)
        assert row["path"] == "mailbox" and row["reader"] == reader and row["reads"] == 3 and row["median_ms"] > 0
