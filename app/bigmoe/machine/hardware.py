"""What the probe found about a machine: plain data in which every probed value is either
known or `Unknown(reason)`. `to_dict`/`from_dict` round-trip it through JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bigmoe.errors import BigmoeError
from bigmoe.units import size_text

DISK_KINDS = ("nvme", "sata", "hdd", "virtual")
"""Device kinds a disk can be: NVMe SSD, other SSD (SATA/SAS/USB), rotating disk, VM disk."""


class HardwareError(BigmoeError):
    """A hardware description (JSON) is malformed; the message is one line."""


@dataclass(frozen=True)
class Unknown:
    """A value the probe could not find out."""

    reason: str
    """Why not, one line (reads after "unknown, because")."""

    def __str__(self) -> str:
        return f"unknown, because {self.reason}"


NOT_MEASURED = Unknown("the probe was not asked to measure it")
"""The value of a link speed nobody measured."""


def known(value: object) -> bool:
    """True unless the value is an Unknown."""
    return not isinstance(value, Unknown)


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU."""

    index: int
    """NVML device index."""
    name: str | Unknown
    """Marketing name, e.g. "NVIDIA GeForce RTX 4090"."""
    vram_total_bytes: int | Unknown
    """Device memory in bytes."""
    vram_free_bytes: int | Unknown
    """Device memory not used by any process at probe time, in bytes."""
    compute_capability: str | Unknown
    """CUDA compute capability "major.minor" (FP8 tensor cores need 8.9 or later)."""
    pcie_gen: int | Unknown
    """Highest PCIe generation the GPU and its slot support (the link idles lower)."""
    pcie_width: int | Unknown
    """Highest PCIe link width (lanes)."""
    stated: bool = False
    """True when given on the command line instead of probed."""
    h2d_gbps: float | Unknown = NOT_MEASURED
    """Measured pinned host-to-device copy rate, GB/s (links.py)."""
    h2d_basis: str = ""
    """How and when h2d_gbps was measured, one line ("" when it was not)."""
    card_bytes: int | None = None
    """A stated GPU's budget is part of this probed card (its total bytes); None: the card is the budget."""


@dataclass(frozen=True)
class Disk:
    """The storage behind one path the plan may read or write (models, paging file)."""

    path: str
    """The path asked about (it need not exist yet)."""
    device: str | Unknown
    """Block device name, e.g. "nvme0n1" (the whole disk, not the partition)."""
    kind: str | Unknown
    """One of DISK_KINDS."""
    kind_basis: str
    """How the kind was decided, one line."""
    mount_point: str | Unknown
    """Mount point the path lives under."""
    filesystem: str | Unknown
    """Filesystem type from /proc/mounts, e.g. "ext4", "9p"."""
    windows_drive: bool | Unknown
    """True for a Windows drive seen through WSL2 (drvfs / 9p, e.g. /mnt/c): slow, no O_DIRECT."""
    free_bytes: int | Unknown
    """Bytes free to an unprivileged writer."""
    o_direct: bool | Unknown
    """Whether an aligned O_DIRECT read of a real file there returned the right bytes."""
    o_direct_basis: str
    """What the O_DIRECT check did or why it failed, one line."""
    stated: bool = False
    """True when given on the command line instead of probed."""
    read_gbps: float | Unknown = NOT_MEASURED
    """Measured read rate of multi-MiB O_DIRECT reads at a few in flight, GB/s (links.py)."""
    read_basis: str = ""
    """How and when read_gbps was measured, one line ("" when it was not)."""


@dataclass(frozen=True)
class Hardware:
    """The machine a plan is made for."""

    gpus: tuple[Gpu, ...] | Unknown
    """NVIDIA GPUs; () when NVML works and sees none."""
    ram_total_bytes: int | Unknown
    """Host memory in bytes."""
    ram_available_bytes: int | Unknown
    """Host memory available to a new process without swapping, in bytes."""
    ram_stated: bool
    """True when the RAM size was given on the command line instead of probed."""
    cpu_cores: int | Unknown
    """Logical CPUs."""
    cpu_amx: bool | Unknown
    """Intel AMX tiles present (the CPU build of vLLM runs FP8 MoE only with them)."""
    wsl2: bool | Unknown
    """Running inside Windows' WSL2 VM (pinned memory and /mnt/c behave differently there)."""
    wsl2_basis: str
    """What the WSL2 answer rests on, one line."""
    memlock_bytes: int | None | Unknown
    """Soft RLIMIT_MEMLOCK (ulimit -l) in bytes; None = unlimited."""
    cpu_expand_gbps: float | Unknown = NOT_MEASURED
    """Raw GB/s one CPU thread expands compressed expert records at (links.py measures it)."""
    cpu_expand_basis: str = ""
    """How and when cpu_expand_gbps was measured, one line ("" when it was not)."""
    disks: tuple[Disk, ...] = field(default_factory=tuple)
    """One entry per probed path."""

    def gpu(self) -> Gpu | None:
        """The GPU bigmoe serves on (the first), or None when there is none or none is known."""
        if isinstance(self.gpus, Unknown) or not self.gpus:
            return None
        return self.gpus[0]

    def disk_for(self, path: str) -> Disk | None:
        """The probed disk whose path is `path` or its nearest probed ancestor."""
        best: Disk | None = None
        best_len = -1
        for disk in self.disks:
            base = disk.path.rstrip("/") or "/"
            inside = base == "/" or path == base or path.startswith(base + "/")
            if inside and len(base) > best_len:
                best, best_len = disk, len(base)
        return best

    def summary(self) -> dict[str, str]:
        """Short strings for a progress line."""
        gpu = self.gpu()
        gpu_text = str(self.gpus) if isinstance(self.gpus, Unknown) else "none"
        if gpu is not None:
            gpu_text = f"{gpu.name}, {size_text(gpu.vram_total_bytes)} VRAM"
        return {
            "gpu": gpu_text,
            "ram": f"{size_text(self.ram_available_bytes)} available of {size_text(self.ram_total_bytes)}",
            "wsl2": str(self.wsl2),
            "disks": "; ".join(f"{d.path}: {d.kind}, {size_text(d.free_bytes)} free" for d in self.disks)
            or "none probed",
        }

    def to_dict(self) -> dict[str, Any]:
        return _encode(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Hardware":
        """Inverse of to_dict; raises HardwareError naming the first bad field."""
        return _decode_dataclass(cls, data, "hardware")


# ---- JSON round trip ----------------------------------------------------------------

_CLASSES = {"Gpu": Gpu, "Disk": Disk}
_SCALARS = {"int": int, "str": str, "bool": bool}


def _encode(value: Any) -> Any:
    if isinstance(value, Unknown):
        return {"unknown": value.reason}
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode_dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown_keys = sorted(set(data) - set(fields))
    if unknown_keys:
        raise HardwareError(f"{where}: unknown keys {unknown_keys}")
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise HardwareError(f"{where}.{name}: missing")
        values[name] = _decode(data[name], str(f.type), f"{where}.{name}")
    return cls(**values)


def _decode(raw: Any, annotation: str, where: str) -> Any:
    options = [a.strip() for a in annotation.split("|")]
    if isinstance(raw, dict) and set(raw) == {"unknown"} and "Unknown" in options:
        if not isinstance(raw["unknown"], str):
            raise HardwareError(f"{where}: the unknown reason must be a string")
        return Unknown(raw["unknown"])
    if raw is None:
        if "None" in options:
            return None
        raise HardwareError(f"{where}: null is not allowed")
    for option in options:
        if option.startswith("tuple[") and isinstance(raw, list):
            cls = _CLASSES[option[len("tuple[") :].split(",")[0]]
            return tuple(_decode_dataclass(cls, item, f"{where}[{i}]") for i, item in enumerate(raw))
        kind = _SCALARS.get(option)
        if kind is not None and type(raw) is kind:
            return raw
        if option == "float" and type(raw) in (int, float):
            return float(raw)
    wanted = " or ".join(o for o in options if o != "Unknown")
    raise HardwareError(f'{where}: expected {wanted} (or {{"unknown": reason}}), got {raw!r}')
