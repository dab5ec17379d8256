"""probe: what this machine has (GPUs, RAM, CPU, WSL2, pinned-memory limit, disks).

Every probe degrades to `Unknown(reason)` instead of raising. `root` lets tests run the
file-based probes on a fixture tree (a fake /proc and /sys); GPUs come from NVML, which
only describes the live machine, so a fixture root needs a stand-in `nvml` module.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import resource
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from bigmoe.machine.hardware import Gpu, Hardware, Unknown
from bigmoe.machine.probe_disk import probe_disk, read_mounts
from bigmoe.paths import nearest_dir

WSL_ENV_VARS = ("WSL_DISTRO_NAME", "WSL_INTEROP")
"""Variables WSL sets in every Linux process it starts."""


def probe(
    root: Path = Path("/"),
    paths: Sequence[Path] = (),
    *,
    nvml: ModuleType | None = None,
    env: Mapping[str, str] | None = None,
    measure: bool = False,
    remeasure: bool = False,
) -> Hardware:
    """Probe the machine under `root`; `paths` are the model and paging directories to judge.
    `env` defaults to os.environ on the live root and to {} on a fixture root. `measure` adds
    link speeds (links.with_links: cached per machine, measured when not cached or when
    `remeasure`); only the live machine can be measured."""
    root = Path(root)
    live = root.resolve() == Path("/")
    env = (os.environ if live else {}) if env is None else env
    wsl2, wsl2_basis = probe_wsl2(root, live, env)
    total, available = probe_ram(root, live)
    cores, amx = probe_cpu(root)
    mounts = read_mounts(root)
    hw = Hardware(
        gpus=probe_gpus(nvml, live, root),
        ram_total_bytes=total,
        ram_available_bytes=available,
        ram_stated=False,
        cpu_cores=cores,
        cpu_amx=amx,
        wsl2=wsl2,
        wsl2_basis=wsl2_basis,
        memlock_bytes=probe_memlock(root, live),
        disks=tuple(probe_disk(root, Path(p), mounts, live) for p in paths),
    )
    if not (measure or remeasure):
        return hw
    if not live:
        return _not_measured(hw, f"link speeds are measured only on the live machine, not the tree at {root}")
    from bigmoe.machine.links import with_links

    return with_links(hw, {str(p): nearest_dir(Path(os.path.realpath(p))) for p in paths}, remeasure=remeasure)


def _not_measured(hw: Hardware, why: str) -> Hardware:
    unknown = Unknown(why)
    gpus = hw.gpus if isinstance(hw.gpus, Unknown) else tuple(dataclasses.replace(g, h2d_gbps=unknown) for g in hw.gpus)
    disks = tuple(dataclasses.replace(d, read_gbps=unknown) for d in hw.disks)
    return dataclasses.replace(hw, gpus=gpus, disks=disks, cpu_expand_gbps=unknown)


# ---- GPUs ---------------------------------------------------------------------------------


def probe_gpus(nvml: ModuleType | None, live: bool, root: Path) -> tuple[Gpu, ...] | Unknown:
    if nvml is None:
        if not live:
            return Unknown(f"NVML describes only the live machine, not the tree at {root}")
        try:
            import pynvml as nvml
        except ImportError:
            return Unknown("nvidia-ml-py (import pynvml) is not installed")
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_* (no driver, no library, ...) or a broken binding
        return Unknown(f"NVML did not start ({_text(e) or type(e).__name__}): no NVIDIA driver here")
    try:
        count = nvml.nvmlDeviceGetCount()
        return tuple(_one_gpu(nvml, i) for i in range(int(count)))
    except Exception as e:
        return Unknown(f"NVML could not list GPUs ({_text(e) or type(e).__name__})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass  # shutting NVML down cannot change what was found


def _one_gpu(nvml: ModuleType, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _ask(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), "memory info")
    return Gpu(
        index=index,
        name=_ask(lambda: _text(nvml.nvmlDeviceGetName(handle)), "name"),
        vram_total_bytes=memory if isinstance(memory, Unknown) else int(memory.total),
        vram_free_bytes=memory if isinstance(memory, Unknown) else int(memory.free),
        compute_capability=_ask(
            lambda: "%d.%d" % tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)), "compute capability"
        ),
        pcie_gen=_ask(lambda: int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)), "max PCIe generation"),
        pcie_width=_ask(lambda: int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)), "max PCIe width"),
    )


def _ask(query: Callable[[], Any], what: str) -> Any:
    try:
        return query()
    except Exception as e:  # NVML answers NotSupported on some boards and under WSL2
        return Unknown(f"NVML gave no {what} ({_text(e) or type(e).__name__})")


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# ---- RAM and CPU --------------------------------------------------------------------------


def probe_ram(root: Path, live: bool) -> tuple[int | Unknown, int | Unknown]:
    """(total, available) bytes: psutil on the live machine, /proc/meminfo under a fixture root."""
    if live:
        try:
            import psutil

            memory = psutil.virtual_memory()
            return int(memory.total), int(memory.available)
        except Exception as e:
            return (Unknown(f"psutil could not read memory ({e})"),) * 2
    text = _read(root / "proc/meminfo")
    if isinstance(text, Unknown):
        return text, text
    fields = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+):\s+(\d+)\s+kB", line.strip())
        if match:
            fields[match[1]] = int(match[2]) * 1024
    return tuple(  # type: ignore[return-value]
        fields[key] if key in fields else Unknown(f"/proc/meminfo has no readable {key} line")
        for key in ("MemTotal", "MemAvailable")
    )


def probe_cpu(root: Path) -> tuple[int | Unknown, bool | Unknown]:
    """(logical CPUs, AMX present) from /proc/cpuinfo."""
    text = _read(root / "proc/cpuinfo")
    if isinstance(text, Unknown):
        return text, text
    processors = len(re.findall(r"^processor\s*:", text, re.M))
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    cores: int | Unknown = processors or Unknown("/proc/cpuinfo lists no processor lines")
    amx: bool | Unknown = "amx_tile" in flags[1].split() if flags else Unknown("/proc/cpuinfo has no flags line")
    return cores, amx


# ---- WSL2 and limits ----------------------------------------------------------------------


def probe_wsl2(root: Path, live: bool, env: Mapping[str, str]) -> tuple[bool | Unknown, str]:
    """WSL2 when the kernel release or /proc/version names Microsoft, or WSL's variables are set."""
    release = platform.uname().release if live else _read(root / "proc/sys/kernel/osrelease")
    version = _read(root / "proc/version")
    evidence = []
    if isinstance(release, str) and "microsoft" in release.lower():
        evidence.append(f"kernel release {release.strip()!r}")
    if isinstance(version, str) and "microsoft" in version.lower():
        evidence.append("/proc/version names Microsoft")
    evidence += [f"${name} is set" for name in WSL_ENV_VARS if env.get(name)]
    if evidence:
        return True, "; ".join(evidence)
    if isinstance(release, Unknown) and isinstance(version, Unknown):
        return Unknown(
            f"neither the kernel release nor /proc/version could be read ({version.reason})"
        ), "nothing readable"
    return False, "kernel release and /proc/version do not name Microsoft; no WSL_* variables"


def probe_memlock(root: Path, live: bool) -> int | None | Unknown:
    """Soft RLIMIT_MEMLOCK in bytes (None = unlimited): getrlimit live, /proc/self/limits in a tree."""
    if live:
        try:
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        except (OSError, ValueError) as e:
            return Unknown(f"getrlimit(RLIMIT_MEMLOCK) failed ({e})")
        return None if soft == resource.RLIM_INFINITY else int(soft)
    text = _read(root / "proc/self/limits")
    if isinstance(text, Unknown):
        return text
    match = re.search(r"^Max locked memory\s+(\S+)", text, re.M)
    if match is None:
        return Unknown("/proc/self/limits has no 'Max locked memory' line")
    if match[1] == "unlimited":
        return None
    if not match[1].isdigit():
        return Unknown(f"/proc/self/limits gives {match[1]!r} for locked memory")
    return int(match[1])


def _read(path: Path) -> str | Unknown:
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        return Unknown(f"cannot read {path}: {e.strerror or e}")
