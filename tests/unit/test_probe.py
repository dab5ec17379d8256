"""probe: on fixture trees (a fake /proc and /sys per machine, copied to a temporary
directory so the O_DIRECT check writes there), on this machine, and degrading to
Unknown(reason) when a file is missing or garbage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from bigmoe.cli.plan import probe as probe_command
from bigmoe.machine import probe_disk
from bigmoe.machine.hardware import Gpu, Hardware, HardwareError, Unknown
from bigmoe.machine.probe import probe, probe_gpus
from bigmoe.machine.probe_disk import check_o_direct
from click.testing import CliRunner

MACHINES = Path(__file__).resolve().parents[1] / "fixtures" / "machines"
HARDWARE = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
KIB = 1024


def copy_tree(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(MACHINES / name, root)
    return root


# ---- whole machines -----------------------------------------------------------------------

MACHINE_CASES = [
    pytest.param(
        "wsl2-4090",
        dict(
            wsl2=True,
            ram_total_bytes=65843512 * KIB,
            ram_available_bytes=61231104 * KIB,
            cpu_cores=2,
            cpu_amx=False,
            memlock_bytes=64 << 20,
        ),
        {
            "/home/me/models": dict(
                device="sdc", kind="virtual", filesystem="ext4", mount_point="/", windows_drive=False, o_direct=True
            ),
            "/mnt/c/models": dict(filesystem="9p", mount_point="/mnt/c", windows_drive=True, o_direct=False),
        },
        id="wsl2-4090",
    ),
    pytest.param(
        "desktop-3060",
        dict(
            wsl2=False,
            ram_total_bytes=32780504 * KIB,
            ram_available_bytes=29360128 * KIB,
            cpu_cores=4,
            cpu_amx=False,
            memlock_bytes=8 << 20,
        ),
        {
            "/home/me/.cache/bigmoe/paging": dict(
                device="nvme0n1", kind="nvme", filesystem="ext4", mount_point="/", o_direct=True
            ),
            "/data/hf": dict(
                device="sda", kind="sata", filesystem="ext4", mount_point="/data", windows_drive=False, o_direct=True
            ),
        },
        id="desktop-3060",
    ),
    pytest.param(
        "h200-server",
        dict(
            wsl2=False,
            ram_total_bytes=131891232 * KIB,
            ram_available_bytes=125829120 * KIB,
            cpu_cores=8,
            cpu_amx=True,
            memlock_bytes=None,
        ),
        {"/srv/models": dict(device="dm-0", kind="nvme", filesystem="xfs", mount_point="/srv", o_direct=True)},
        id="h200-lvm-over-nvme",
    ),
    pytest.param(
        "hdd-only",
        dict(
            wsl2=False,
            ram_total_bytes=65843512 * KIB,
            ram_available_bytes=60000000 * KIB,
            cpu_cores=1,
            cpu_amx=False,
            memlock_bytes=8 << 20,
        ),
        {"/home/me/models": dict(device="sda", kind="hdd", filesystem="ext4", mount_point="/", o_direct=True)},
        id="hdd-only",
    ),
]


@pytest.mark.parametrize("name, expected, disks", MACHINE_CASES)
def test_probe_reads_the_machine_from_its_tree(name, expected, disks, tmp_path):
    root = copy_tree(name, tmp_path)
    hw = probe(root, [Path(p) for p in disks])
    for field, value in expected.items():
        assert getattr(hw, field) == value, field
    assert isinstance(hw.gpus, Unknown) and "only the live machine" in hw.gpus.reason
    for disk, (path, want) in zip(hw.disks, disks.items()):
        assert disk.path == path
        for field, value in want.items():
            assert getattr(disk, field) == value, (path, field, disk)
        assert isinstance(disk.free_bytes, int) and disk.free_bytes > 0
    leftovers = [p for p in root.rglob(".bigmoe-odirect-*")]
    assert leftovers == [], "the O_DIRECT test file must be removed"


def test_windows_drive_has_an_unknown_kind_with_a_reason(tmp_path):
    hw = probe(copy_tree("wsl2-4090", tmp_path), [Path("/mnt/c/models")])
    disk = hw.disks[0]
    assert isinstance(disk.kind, Unknown) and "not a block device" in disk.kind.reason
    assert "O_DIRECT" in disk.o_direct_basis


def test_wsl2_variables_alone_mark_wsl2(tmp_path):
    root = copy_tree("desktop-3060", tmp_path)
    hw = probe(root, [], env={"WSL_DISTRO_NAME": "Ubuntu"})
    assert hw.wsl2 is True and "WSL_DISTRO_NAME" in hw.wsl2_basis


# ---- degrading ----------------------------------------------------------------------------

BROKEN_FILES = [
    pytest.param("proc/meminfo", None, ["ram_total_bytes", "ram_available_bytes"], id="meminfo-missing"),
    pytest.param(
        "proc/meminfo", "MemTotal:  1024 kB\nMemAvailable: lots\n", ["ram_available_bytes"], id="meminfo-garbage"
    ),
    pytest.param("proc/cpuinfo", None, ["cpu_cores", "cpu_amx"], id="cpuinfo-missing"),
    pytest.param("proc/cpuinfo", "\x00\x01 nothing\n", ["cpu_cores", "cpu_amx"], id="cpuinfo-garbage"),
    pytest.param(
        "proc/self/limits", "Max locked memory   many   many   bytes\n", ["memlock_bytes"], id="limits-garbage"
    ),
    pytest.param("proc/self/limits", None, ["memlock_bytes"], id="limits-missing"),
    pytest.param(
        "proc/mounts", None, ["disk.mount_point", "disk.filesystem", "disk.kind", "disk.device"], id="mounts-missing"
    ),
    pytest.param(
        "proc/mounts",
        "not a mounts file\n",
        ["disk.mount_point", "disk.filesystem", "disk.kind", "disk.device"],
        id="mounts-garbage",
    ),
    pytest.param("sys/block/sda/queue/rotational", "banana\n", ["disk.kind"], id="rotational-garbage"),
    pytest.param("sys/block/sda/queue/rotational", None, ["disk.kind"], id="rotational-missing"),
]


@pytest.mark.parametrize("path, content, broken", BROKEN_FILES)
def test_each_probe_degrades_alone(path, content, broken, tmp_path):
    root = copy_tree("desktop-3060", tmp_path)
    target = root / path
    if content is None:
        target.unlink()
    else:
        target.write_text(content)
    hw = probe(root, [Path("/data/hf")])
    fields = [
        "ram_total_bytes",
        "ram_available_bytes",
        "cpu_cores",
        "cpu_amx",
        "memlock_bytes",
        "wsl2",
        "disk.mount_point",
        "disk.filesystem",
        "disk.kind",
        "disk.device",
    ]
    for field in fields:
        value = getattr(hw.disks[0], field[5:]) if field.startswith("disk.") else getattr(hw, field)
        if field in broken:
            assert isinstance(value, Unknown), field
            assert str(value).startswith("unknown, because ") and len(value.reason) > 10
        else:
            assert not isinstance(value, Unknown), (field, value)


def test_an_empty_tree_gives_unknowns_and_never_raises(tmp_path):
    hw = probe(tmp_path, [Path("/models")])
    for field in ("gpus", "ram_total_bytes", "ram_available_bytes", "cpu_cores", "cpu_amx", "wsl2", "memlock_bytes"):
        assert isinstance(getattr(hw, field), Unknown), field
    disk = hw.disks[0]
    assert isinstance(disk.kind, Unknown) and isinstance(disk.mount_point, Unknown)
    assert disk.o_direct is True  # the directory itself is real, so the read test runs there
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_the_garbage_tree_degrades_everywhere(tmp_path):
    hw = probe(copy_tree("garbage", tmp_path), [Path("/data")])
    assert "MemTotal" in hw.ram_total_bytes.reason and "MemAvailable" in hw.ram_available_bytes.reason
    assert isinstance(hw.cpu_cores, Unknown) and isinstance(hw.cpu_amx, Unknown)
    assert "banana" in hw.memlock_bytes.reason
    assert hw.disks[0].device == "sdz"
    assert "rotational" in hw.disks[0].kind.reason


# ---- GPUs through NVML --------------------------------------------------------------------


class NvmlError(Exception):
    """Stands in for pynvml's NVMLError subclasses."""


class FakeNvml:
    """A stand-in for the pynvml module: NVML cannot run here (no GPU, no driver), so the
    GPU probe's handling of its answers is tested against this fake."""

    def __init__(self, *, fail_init=False, no_pcie=False, count=1):
        self.fail_init, self.no_pcie, self.count, self.shut = fail_init, no_pcie, count, False

    def nvmlInit(self):
        if self.fail_init:
            raise NvmlError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=24 << 30, free=22 << 30, used=2 << 30)

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return (8, 9)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        if self.no_pcie:
            raise NvmlError("Not Supported")
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        if self.no_pcie:
            raise NvmlError("Not Supported")
        return 16


def test_gpu_probe_reads_nvml():
    nvml = FakeNvml(count=2)
    gpus = probe_gpus(nvml, live=False, root=Path("/"))
    assert len(gpus) == 2 and nvml.shut
    assert gpus[1] == Gpu(1, "NVIDIA GeForce RTX 4090", 24 << 30, 22 << 30, "8.9", 4, 16)


def test_gpu_fields_nvml_cannot_answer_are_unknown():
    gpu = probe_gpus(FakeNvml(no_pcie=True), live=False, root=Path("/"))[0]
    assert isinstance(gpu.pcie_gen, Unknown) and "Not Supported" in gpu.pcie_gen.reason
    assert gpu.vram_total_bytes == 24 << 30


def test_nvml_that_does_not_start_gives_unknown_gpus():
    gpus = probe_gpus(FakeNvml(fail_init=True), live=False, root=Path("/"))
    assert isinstance(gpus, Unknown) and "Driver Not Loaded" in gpus.reason


def test_real_pynvml_here_degrades_or_reports_real_gpus():
    gpus = probe_gpus(None, live=True, root=Path("/"))
    if isinstance(gpus, Unknown):
        assert "NVML" in gpus.reason
    else:
        assert all(isinstance(g.vram_total_bytes, int) and g.vram_total_bytes > 0 for g in gpus)


def test_live_probe_runs_and_round_trips(tmp_path):
    hw = probe(Path("/"), [tmp_path])
    assert isinstance(hw.ram_total_bytes, int) and hw.ram_total_bytes > 0
    assert hw.disks[0].o_direct is True
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


# ---- O_DIRECT -----------------------------------------------------------------------------


def test_o_direct_really_reads(tmp_path):
    ok, basis = check_o_direct(tmp_path)
    assert ok is True and "O_DIRECT" in basis
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_refusing_o_direct_is_reported(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):  # fake: a filesystem without O_DIRECT (this one has it)
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(probe_disk.os, "open", refusing_open)
    ok, basis = check_o_direct(tmp_path)
    assert ok is False and "Invalid argument" in basis


def test_an_unwritable_directory_without_files_is_unknown():
    ok, basis = check_o_direct(Path("/proc/self"))
    assert isinstance(ok, Unknown) and "cannot write" in ok.reason


# ---- the JSON form ------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(HARDWARE.glob("*.json")), ids=lambda p: p.stem)
def test_hardware_fixtures_round_trip(path):
    data = json.loads(path.read_text())
    hw = Hardware.from_dict(data)
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda d: d.update(ram_total_bytes="64G"), "hardware.ram_total_bytes"),
        (lambda d: d.update(cpu_amx=1), "hardware.cpu_amx"),
        (lambda d: d["gpus"][0].update(pcie_gen=True), "hardware.gpus[0].pcie_gen"),
        (lambda d: d["disks"][0].pop("kind"), "hardware.disks[0].kind"),
        (lambda d: d.update(colour="red"), "unknown keys"),
        (lambda d: d.update(wsl2={"unknown": 5}), "hardware.wsl2"),
    ],
)
def test_malformed_hardware_names_the_field(change, where):
    data = json.loads((HARDWARE / "rtx4090-wsl2.json").read_text())
    change(data)
    with pytest.raises(HardwareError, match=where.replace("[", r"\[").replace("]", r"\]")):
        Hardware.from_dict(data)


def test_probe_command_on_a_tree(tmp_path):
    root = copy_tree("h200-server", tmp_path)
    result = CliRunner().invoke(probe_command, ["--root", str(root), "--path", "/srv/models", "--json"])
    assert result.exit_code == 0, result.output
    hw = Hardware.from_dict(json.loads(result.stdout))
    assert hw.disks[0].kind == "nvme" and hw.memlock_bytes is None
    text = CliRunner().invoke(probe_command, ["--root", str(root), "--path", "/srv/models"])
    assert text.exit_code == 0 and "kind nvme (dm-0 sits on nvme1n1p1)" in text.stdout


def test_an_unwritable_directory_is_judged_by_a_file_already_there(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(os.urandom(3 * 4096))

    def no_write(*args, **kwargs):  # fake: a read-only directory (tests run as root, who may write anywhere)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(probe_disk.tempfile, "mkstemp", no_write)
    ok, basis = check_o_direct(tmp_path)
    assert ok is True and "model.safetensors" in basis
