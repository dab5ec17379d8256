"""links: measured link speeds (pinned host-to-device copies per GPU, O_DIRECT reads per disk, and the rate one
CPU thread expands compressed experts at),
cached per machine in `<cache root>/links.json` so a run does not measure again; `bigmoe probe
--remeasure` measures anew.

links.json: {"format": 1, "links": {key: {"gbps": float, "basis": str, "measured_at": unix s}}}
with keys "gpu:<index>:<name>", "disk:<device>" (or "mount:<mount point>" when the device is
unknown) and "cpu:expand". A file that cannot be read or parsed is measured over and replaced, never used.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bigmoe.machine.hardware import Disk, Gpu, Hardware, Unknown
from bigmoe.machine.measure_disk import measure_read_rate
from bigmoe.machine.measure_expand import measure_expand_in_child
from bigmoe.machine.measure_pcie import measure_h2d_in_child
from bigmoe.paths import write_atomic

FORMAT = 1
"""Version of links.json's layout."""

DiskMeasure = Callable[[Path], object]
"""directory -> measure_disk.DiskRead or Unknown."""
GpuMeasure = Callable[[int], object]
"""GPU index -> measure_pcie.CopyRate or Unknown."""
ExpandMeasure = Callable[[], object]
"""() -> measure_expand.ExpandRate or Unknown."""
EXPAND_KEY = "cpu:expand"
"""links.json key of the CPU's expansion rate (a machine has one)."""
MIN_GBPS, MAX_GBPS = 1e-4, 1e4
"""Rates (GB/s) a cached entry may state: 100 KB/s (below any working disk) to 10 TB/s (above any PCIe link, disk
or CPU); one outside is damage."""


@dataclass(frozen=True)
class Link:
    """One cached measurement."""

    gbps: float
    """Measured rate, GB/s."""
    basis: str
    """How it was measured, one line."""
    measured_at: float
    """Unix time of the measurement."""

    def describe(self) -> str:
        return f"{self.basis}; {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.measured_at))}"


def cache_file() -> Path:
    from bigmoe.paths import cache_root

    return cache_root() / "links.json"


def read_cache(path: Path) -> tuple[dict[str, Link], str]:
    """(entries, "" or why the file was not usable); a missing file is an empty cache."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, ""
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return {}, f"{path} was unreadable ({type(e).__name__}), measured again"
    try:
        if data.get("format") != FORMAT:
            return {}, f"{path} has format {data.get('format')!r}, not {FORMAT}; measured again"
        links = {
            str(k): Link(float(v["gbps"]), str(v["basis"]), float(v["measured_at"])) for k, v in data["links"].items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        return {}, f"{path} is malformed ({type(e).__name__}: {e}); measured again"
    return {k: v for k, v in links.items() if plausible(v)}, ""


def plausible(link: Link) -> bool:
    """Whether a cached entry can be a real measurement (a rate from MIN_GBPS to MAX_GBPS, taken before now); one
    that cannot (0, nan, inf, 1e300, a time past the clock's range) is measured again, never used."""
    return MIN_GBPS <= link.gbps <= MAX_GBPS and 0 <= link.measured_at <= time.time() + 86400  # nan fails both


def write_cache(path: Path, links: dict[str, Link]) -> None:
    """Replace the file atomically (a crash leaves the old file or the new one, never half of one)."""
    body = json.dumps(
        {"format": FORMAT, "links": {k: dataclasses.asdict(v) for k, v in sorted(links.items())}}, indent=1
    )
    write_atomic(path, body.encode())


def gpu_key(gpu: Gpu) -> str:
    return f"gpu:{gpu.index}:{gpu.name}"


def disk_key(disk: Disk) -> str | None:
    """The cache key of a disk; None when neither its device nor its mount point is known."""
    if isinstance(disk.device, str):
        return f"disk:{disk.device}"
    if isinstance(disk.mount_point, str):
        return f"mount:{disk.mount_point}"
    return None


def with_links(
    hw: Hardware,
    local_dirs: dict[str, Path],
    *,
    remeasure: bool = False,
    path: Path | None = None,
    measure_disk: DiskMeasure = measure_read_rate,
    measure_gpu: GpuMeasure = measure_h2d_in_child,
    measure_expand: ExpandMeasure = measure_expand_in_child,
) -> Hardware:
    """`hw` with each GPU's h2d_gbps, each disk's read_gbps and the CPU's cpu_expand_gbps from the cache, measured
    (and cached) where the cache has none or `remeasure` is set. `local_dirs` maps a disk's path to
    the directory to measure it in. Never raises for a failed measurement (Unknown(reason))."""
    path = path or cache_file()
    links, stale = ({}, "") if remeasure else read_cache(path)
    fresh: dict[str, Link] = {}

    def lookup(key: str | None, measure: Callable[[], object]) -> tuple[float | Unknown, str]:
        if key is not None and key in links:
            return links[key].gbps, f"{links[key].describe()} (cached in {path})"
        result = measure()
        if isinstance(result, Unknown):
            return result, ""
        link = Link(result.gbps, result.basis + (f"; {stale}" if stale else ""), time.time())
        if key is not None:
            links[key] = fresh[key] = link
        return link.gbps, link.describe()

    gpus = hw.gpus
    if not isinstance(gpus, Unknown):
        gpus = tuple(_gpu(g, lookup, measure_gpu) for g in gpus)
    disks = tuple(_disk(d, local_dirs.get(d.path), lookup, measure_disk) for d in hw.disks)
    expand_gbps, expand_basis = lookup(EXPAND_KEY, measure_expand)
    if fresh:
        try:
            merged, _ = ({}, "") if stale else read_cache(path)
            write_cache(path, {**merged, **links})
        except OSError:
            pass  # a cache that cannot be written only means measuring again next time
    return dataclasses.replace(hw, gpus=gpus, disks=disks, cpu_expand_gbps=expand_gbps, cpu_expand_basis=expand_basis)


def _gpu(gpu: Gpu, lookup, measure_gpu: GpuMeasure) -> Gpu:
    if gpu.stated:
        return gpu
    gbps, basis = lookup(gpu_key(gpu) if isinstance(gpu.name, str) else None, lambda: measure_gpu(gpu.index))
    return dataclasses.replace(gpu, h2d_gbps=gbps, h2d_basis=basis)


def _disk(disk: Disk, local: Path | None, lookup, measure_disk: DiskMeasure) -> Disk:
    if disk.stated:
        return disk
    if local is None:
        return dataclasses.replace(disk, read_gbps=Unknown(f"no directory was given to measure {disk.path} in"))
    if disk.windows_drive is True or disk.o_direct is False:
        return dataclasses.replace(
            disk, read_gbps=Unknown(f"O_DIRECT does not work on {disk.path} ({disk.o_direct_basis})")
        )
    gbps, basis = lookup(disk_key(disk), lambda: measure_disk(local))
    return dataclasses.replace(disk, read_gbps=gbps, read_basis=basis)
