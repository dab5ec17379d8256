"""Measured link speeds: the O_DIRECT read rate of a real disk here, the pinned-copy test
degrading without CUDA, the per-machine cache (links.json), and the plan naming which numbers
were measured and which assumed. The GPU side of the copy test is tests/gpu/test_measure_pcie_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from bigmoe.cli.plan import probe as probe_command
from bigmoe.machine.hardware import Hardware, Unknown
from bigmoe.machine.links import Link, read_cache, with_links, write_cache
from bigmoe.machine.measure_disk import MAX_BYTES, MIN_BYTES, DiskRead, measure_read_rate
from bigmoe.machine.measure_expand import ExpandRate, measure_expand_in_child, parse_fields
from bigmoe.machine.measure_pcie import CopyRate, measure_h2d, measure_h2d_in_child, parse_child_output
from bigmoe.machine.probe import probe
from bigmoe.model import presets
from bigmoe.plan.planner import Overrides, plan
from click.testing import CliRunner

HARDWARE = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
MIB = 1 << 20


def machine(name: str) -> Hardware:
    return Hardware.from_dict(json.loads((HARDWARE / f"{name}.json").read_text()))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A BIGMOE_HOME of this test's own, so links.json never touches the user's cache."""
    path = tmp_path / "home"
    monkeypatch.setenv("BIGMOE_HOME", str(path))
    return path


# ---- the disk read test (real O_DIRECT reads on this machine's disk) ------------------------------


@pytest.mark.parametrize("existing_mib", [0, 48], ids=["temporary-file", "file-already-there"])
def test_disk_read_rate_is_measured_from_a_real_file(tmp_path, existing_mib):
    if existing_mib:
        (tmp_path / "shard.safetensors").write_bytes(os.urandom(existing_mib * MIB))
    start = time.monotonic()
    rate = measure_read_rate(tmp_path)
    assert isinstance(rate, DiskRead), rate
    assert MIN_BYTES <= rate.bytes_read <= MAX_BYTES and rate.gbps > 0
    assert rate.gbps == pytest.approx(rate.bytes_read / rate.seconds / 1e9, rel=0.01)
    assert ("shard.safetensors" in rate.source) == bool(existing_mib)
    assert time.monotonic() - start < 30  # bounded: ~1 s of reads plus writing a 64 MiB file
    assert sorted(p.name for p in tmp_path.iterdir()) == (["shard.safetensors"] if existing_mib else [])


def test_disk_read_stops_at_its_time_limit(tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(64 * MIB))
    rate = measure_read_rate(tmp_path, max_seconds=0.0)
    assert isinstance(rate, Unknown) and "too few" in rate.reason


@pytest.mark.parametrize(
    "where, reason",
    [
        (Path("/proc/self"), "cannot be written"),
        (None, "less than the 32 MiB"),
    ],
)
def test_disk_read_degrades_to_unknown(tmp_path, where, reason):
    if where is None:  # a file too small to judge a disk by, read directly
        from bigmoe.machine.measure_disk import _measure

        small = tmp_path / "small.bin"
        small.write_bytes(os.urandom(MIB))
        rate = _measure(small, str(small), MAX_BYTES, 1.0)
    else:
        rate = measure_read_rate(where)
    assert isinstance(rate, Unknown) and reason in rate.reason


# ---- the pinned-copy test without CUDA ----------------------------------------------------------


def test_pinned_copy_test_without_cuda_is_unknown():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; tests/gpu/test_measure_pcie_gpu.py covers it")
    for result in (measure_h2d(0), measure_h2d_in_child(0)):
        assert isinstance(result, Unknown) and "no CUDA GPU" in result.reason


def test_pinned_copy_test_without_torch_is_unknown(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):  # a stand-in for an environment without torch
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    result = measure_h2d(0)
    assert isinstance(result, Unknown) and "torch is not importable" in result.reason


@pytest.mark.parametrize(
    "code, out, err, expected",
    [
        (
            0,
            '{"gbps": 24.5, "best_gbps": 25.0, "copy_bytes": 268435456, "repeats": 5, "device_name": "RTX 4090"}\n',
            "",
            24.5,
        ),
        (0, '{"unknown": "torch sees no CUDA GPU"}\n', "", "torch sees no CUDA GPU"),
        (
            1,
            "",
            "Traceback...\nRuntimeError: CUDA driver too old\n",
            "exited with code 1 (RuntimeError: CUDA driver too old)",
        ),
        (0, "garbage\n", "", "not a result"),
        (
            0,
            '{"gbps": -1.0, "best_gbps": 1.0, "copy_bytes": 1, "repeats": 1, "device_name": "x"}\n',
            "",
            "reported -1.0",
        ),
    ],
)
def test_child_output_is_a_rate_or_a_reason(code, out, err, expected):
    result = parse_child_output(code, out, err)
    if isinstance(expected, float):
        assert isinstance(result, CopyRate) and result.gbps == expected
    else:
        assert isinstance(result, Unknown) and expected in result.reason


# ---- the cache ------------------------------------------------------------------------------------


class FakeMeters:
    """Fakes of the two measurements (this machine has no GPU, and a real disk rate cannot be
    predicted): fixed rates, and a count of how often each was asked."""

    def __init__(
        self,
        gpu=CopyRate(21.5, 22.0, 256 * MIB, 5, "H200"),
        disk=DiskRead(2.75, 256 * MIB, 0.1, "f"),
        expand=ExpandRate(1.25, 100, 3146496, 0.25),
    ):
        self.gpu_result, self.disk_result, self.expand_result, self.calls = gpu, disk, expand, []

    def gpu(self, index):
        self.calls.append(("gpu", index))
        return self.gpu_result

    def disk(self, directory):
        self.calls.append(("disk", directory))
        return self.disk_result

    def expand(self):
        self.calls.append(("expand",))
        return self.expand_result


def measured(hw, tmp_path, meters, **kw):
    dirs = {d.path: tmp_path for d in hw.disks}
    return with_links(
        hw,
        dirs,
        path=tmp_path / "links.json",
        measure_disk=meters.disk,
        measure_gpu=meters.gpu,
        measure_expand=meters.expand,
        **kw,
    )


def test_links_are_measured_once_then_cached(tmp_path):
    meters = FakeMeters()
    first = measured(machine("h200"), tmp_path, meters)
    assert first.gpus[0].h2d_gbps == 21.5 and "median of 5" in first.gpus[0].h2d_basis
    assert all(d.read_gbps == 2.75 for d in first.disks)
    assert meters.calls.count(("gpu", 0)) == 1 and sum(c[0] == "disk" for c in meters.calls) == 1  # both disks are dm-0
    assert first.cpu_expand_gbps == 1.25 and "C decoder on one thread" in first.cpu_expand_basis
    cache, problem = read_cache(tmp_path / "links.json")
    assert problem == "" and set(cache) == {"gpu:0:NVIDIA H200", "disk:dm-0", "cpu:expand"}
    again = measured(machine("h200"), tmp_path, meters)
    assert len(meters.calls) == 3 and again.gpus[0].h2d_gbps == 21.5 and "cached in" in again.disks[0].read_basis
    assert again.cpu_expand_gbps == 1.25 and "cached in" in again.cpu_expand_basis
    measured(machine("h200"), tmp_path, meters, remeasure=True)
    assert len(meters.calls) == 6


@pytest.mark.parametrize(
    "content", ["{not json", '{"format": 99, "links": {}}', '{"format": 1, "links": {"disk:dm-0": {"gbps": "x"}}}']
)
def test_a_broken_cache_is_measured_over_and_replaced(tmp_path, content):
    (tmp_path / "links.json").write_text(content)
    meters = FakeMeters()
    hw = measured(machine("h200"), tmp_path, meters)
    assert len(meters.calls) == 3 and "measured again" in hw.disks[0].read_basis
    assert read_cache(tmp_path / "links.json")[1] == ""


def test_a_failed_measurement_is_unknown_and_not_cached(tmp_path):
    meters = FakeMeters(gpu=Unknown("torch sees no CUDA GPU"), disk=Unknown("open failed"), expand=Unknown("no cc"))
    hw = measured(machine("h200"), tmp_path, meters)
    assert hw.gpus[0].h2d_gbps == Unknown("torch sees no CUDA GPU") and hw.disks[0].read_gbps == Unknown("open failed")
    assert hw.cpu_expand_gbps == Unknown("no cc")
    assert not (tmp_path / "links.json").exists()


def test_a_windows_drive_is_not_measured(tmp_path):
    hw = machine("rtx4090-wsl2")
    hw = dataclasses.replace(
        hw, disks=tuple(dataclasses.replace(d, windows_drive=True, o_direct=False) for d in hw.disks)
    )
    meters = FakeMeters()
    out = measured(hw, tmp_path, meters)
    assert all(isinstance(d.read_gbps, Unknown) and "O_DIRECT does not work" in d.read_gbps.reason for d in out.disks)
    assert not any(c[0] == "disk" for c in meters.calls)


# ---- the expansion test (the pager's C decoder, in a child process, on this machine) -----------------


def test_the_expansion_rate_is_measured_here_in_a_child():
    rate = measure_expand_in_child()
    assert isinstance(rate, ExpandRate), rate
    assert rate.gbps > 0 and rate.records >= 1 and "C decoder on one thread" in rate.basis
    assert rate.gbps == pytest.approx(rate.records * rate.record_bytes / rate.seconds / 1e9, rel=0.01)


def test_without_a_c_compiler_the_rate_is_numpys_and_says_so(monkeypatch, tmp_path):
    """The SSD tier expands with numpy's reference where no C compiler is found: the plan must see that rate."""
    from bigmoe.machine.measure_expand import measure_expand

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BIGMOE_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
    rate = measure_expand(seconds=0.01)
    assert isinstance(rate, ExpandRate) and rate.decoder == "numpy (no C compiler)" and rate.records >= 1
    assert "numpy (no C compiler) decoder on one thread" in rate.basis


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"gbps": 1.3, "records": 9, "record_bytes": 3146496, "seconds": 0.5}, 1.3),
        (Unknown("the expansion test failed (CodecError: bad magic)"), "failed"),
        ({"gbps": 0.0, "records": 0, "record_bytes": 1, "seconds": 0.5}, "reported 0.0"),
        ({"rate": 3}, "not a result"),
    ],
)
def test_the_expansion_child_gives_a_rate_or_a_reason(fields, expected):
    result = parse_fields(fields)
    if isinstance(expected, float):
        assert isinstance(result, ExpandRate) and result.gbps == expected
    else:
        assert isinstance(result, Unknown) and expected in result.reason


def test_cache_round_trips(tmp_path):
    links = {"disk:nvme0n1": Link(3.1, "256 MiB of reads", 1.7e9)}
    write_cache(tmp_path / "links.json", links)
    assert read_cache(tmp_path / "links.json") == (links, "")


# ---- the probe and the plan -----------------------------------------------------------------------


def test_live_probe_measures_the_disk_and_caches_it(tmp_path, home):
    hw = probe(Path("/"), [tmp_path], measure=True)
    disk = hw.disks[0]
    assert isinstance(disk.read_gbps, float) and disk.read_gbps > 0, disk.read_gbps
    assert (home / "links.json").is_file()
    again = probe(Path("/"), [tmp_path], measure=True)
    if isinstance(disk.device, str):  # cached by device
        assert again.disks[0].read_gbps == disk.read_gbps and "cached in" in again.disks[0].read_basis
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    plain = probe(Path("/"), [tmp_path])
    assert isinstance(plain.disks[0].read_gbps, Unknown)


def test_a_fixture_tree_is_not_measured(tmp_path, home):
    hw = probe(tmp_path, [Path("/models")], measure=True)
    assert "only on the live machine" in hw.disks[0].read_gbps.reason
    assert not (home / "links.json").exists()


@pytest.mark.parametrize("with_rates", [True, False], ids=["measured", "assumed"])
def test_plan_says_which_speeds_were_measured(with_rates):
    hw = machine("rtx4090-wsl2")
    if with_rates:
        hw = dataclasses.replace(
            hw,
            gpus=(dataclasses.replace(hw.gpus[0], h2d_gbps=19.0, h2d_basis="median of 5 copies"),),
            disks=tuple(dataclasses.replace(d, read_gbps=1.5, read_basis="256 MiB of reads") for d in hw.disks),
        )
    p = plan(
        hw, presets.load("qwen3.8-flash-next"), Overrides(model_dir="/home/me/models", paging_dir="/home/me/paging")
    )
    if with_rates:
        assert any("19.0 GB/s (measured: median of 5 copies)" in m for m in p.measured)
        assert any("1.50 GB/s (measured on" in m for m in p.measured)
        assert not any("PCIe" in a or "SSD tier" in a for a in p.assumptions)
    else:
        assert p.measured == ()
        assert any("PCIe" in a and "not measured" in a for a in p.assumptions)
        assert any("SSD tier" in a and "not measured" in a for a in p.assumptions)
    assert p.to_dict()["measured"] == list(p.measured)


def test_measured_speeds_change_the_estimate():
    hw = machine("rtx4090-wsl2")
    slow = dataclasses.replace(
        hw, disks=tuple(dataclasses.replace(d, read_gbps=0.05, read_basis="slow") for d in hw.disks)
    )
    ov = Overrides(model_dir="/home/me/models", paging_dir="/home/me/paging")
    preset = presets.load("qwen3.8-flash-next")
    assert plan(slow, preset, ov).estimate.tpot_ms[1] > plan(hw, preset, ov).estimate.tpot_ms[1]


@pytest.mark.parametrize(
    "args, shown", [([], "reads "), (["--remeasure"], "reads "), (["--no-measure"], "not measured")]
)
def test_probe_command_shows_link_speeds(tmp_path, home, args, shown):
    result = CliRunner().invoke(probe_command, ["--path", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    line = next(l for l in result.output.splitlines() if l.strip().startswith("reads"))
    assert shown in line and ("GB/s measured" in line) == ("--no-measure" not in args)


def test_probe_command_refuses_contradictory_flags(tmp_path):
    result = CliRunner().invoke(probe_command, ["--path", str(tmp_path), "--remeasure", "--no-measure"])
    assert result.exit_code != 0 and "contradict" in result.output
