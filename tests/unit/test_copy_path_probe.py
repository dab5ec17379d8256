"""scripts/gpu_copy_path_probe.py's wiring on CPU (eager, Triton's interpreter): every copy path moves the records'
bytes into the slots, and the host path's rounds are the copier thread's. The GPU run times them."""

from __future__ import annotations

import json

import gpu_copy_path_probe as probe  # scripts/ is on pytest's pythonpath (pyproject)
import pytest

EXPERTS = (1, 3)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy-path") / "copy-path.json"
    argv = ["--device", "cpu", "--smoke", "--experts", ",".join(map(str, EXPERTS)), "--out", str(out)]
    assert probe.main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", probe.BASES)
@pytest.mark.parametrize("n", EXPERTS)
def test_each_path_lands_every_byte(report, path, n):
    row = next(r for r in report["rows"] if r["path"] == f"{path}-{n}")
    assert row["bytes_ok"] is True and "error" not in row


@pytest.mark.parametrize("path", sorted(probe.HOSTS))
def test_the_host_paths_are_served_by_their_copier_threads(report, path):
    served = report["host_copiers"][path]
    assert served["error"] == 0 and served["late"] == 0
    # two published rounds per host row (the check that the thread serves, then the measured call), none skipped
    assert served["rounds"] == 2 * len(EXPERTS) and served["experts"] == 2 * sum(EXPERTS)


def test_the_dense_chain_is_timed_beside_the_copies(report):
    assert any(r["path"] == "dense" and r["us"] > 0 for r in report["rows"])


@pytest.mark.parametrize("eager, timed_as", [(False, "graph replays"), (True, "eager calls")])
def test_the_report_says_how_the_calls_were_timed(eager, timed_as, tmp_path):
    out = tmp_path / "copy-path.json"
    argv = ["--device", "cpu", "--smoke", "--experts", "1", "--paths", "flat", "--out", str(out)]
    assert probe.main(argv + (["--eager"] if eager else [])) == 0
    assert json.loads(out.read_text())["timed_as"] == timed_as


@pytest.mark.parametrize(
    "argv",
    [["--paths", "sm,teleport"], ["--experts", "0"], ["--experts", "one"], ["--busy", "busy,loud"]],
    ids=["path", "zero", "word", "busy"],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(["--device", "cpu", "--smoke", *argv])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines: the one message
    assert "error: --" in last


@pytest.mark.parametrize("path", probe.BASES)
def test_the_byte_check_fails_where_a_path_left_its_bytes_out(path):
    """bytes_ok is what makes each row's figure trustworthy: before the copy it must say no, after it yes."""
    args = probe.parse(["--device", "cpu", "--smoke", "--experts", "3", "--paths", path])
    bench = probe.Bench(args, probe.torch.device("cpu"))
    try:
        bench.clear()
        assert not bench.bytes_ok(path, 3)
        bench.work(path, 3)
        assert bench.bytes_ok(path, 3)
    finally:
        for host in bench.hosts.values():
            host.report()


def test_the_weights_only_host_path_leaves_the_scale_blocks_alone():
    """hostwt-N times the copier as if the scale blocks stayed in VRAM: it must copy the weights and nothing else."""
    args = probe.parse(["--device", "cpu", "--smoke", "--experts", "2", "--paths", "hostwt"])
    bench = probe.Bench(args, probe.torch.device("cpu"))
    try:
        bench.clear()
        bench.work("hostwt", 2)
        assert bench.bytes_ok("hostwt", 2) and not bench.bytes_ok("host", 2)
        scales = [name for name in bench.buffers if not name.endswith("_weight")]
        assert scales and all(not bench.buffers[name].view(probe.torch.uint8).any() for name in scales)
    finally:
        for host in bench.hosts.values():
            host.report()
