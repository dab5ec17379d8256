"""probe_disk: what stores one path: device kind (sysfs), filesystem (/proc/mounts),
free space, and whether O_DIRECT reads really work there (a real aligned read).

Paths are as the machine under `root` sees them; a fixture root maps "/x" to root/x.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bigmoe.machine.hardware import Disk, Unknown
from bigmoe.paths import nearest_dir

WINDOWS_FILESYSTEMS = ("9p", "drvfs", "v9fs")
"""Filesystems WSL uses to show Windows drives (/mnt/c) to Linux."""
VIRTUAL_VENDORS = ("qemu", "vmware", "msft", "vbox", "virtual disk", "google persistentdisk", "amazon elastic")
"""Words in sysfs vendor/model that mark a disk emulated by a hypervisor."""
DIRECT_BLOCK = 4096
"""Bytes: offset, length and buffer alignment of the O_DIRECT test read (covers 512 B and 4 KiB sectors)."""


@dataclass(frozen=True)
class Mount:
    """One line of /proc/mounts."""

    source: str
    """What is mounted, e.g. /dev/nvme0n1p2, C:\\, overlay."""
    point: str
    """Where it is mounted."""
    fstype: str
    """Filesystem type."""
    options: str
    """Mount options, comma-separated."""


def read_mounts(root: Path) -> list[Mount] | Unknown:
    try:
        text = (root / "proc/mounts").read_text(errors="replace")
    except OSError as e:
        return Unknown(f"cannot read {root / 'proc/mounts'}: {e.strerror or e}")
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1].startswith("/"):
            mounts.append(Mount(*(_unescape(p) for p in parts[:4])))
    return mounts or Unknown(f"{root / 'proc/mounts'} lists no mounts")


def probe_disk(root: Path, path: Path, mounts: list[Mount] | Unknown, live: bool) -> Disk:
    """Describe the storage of `path` (absolute, as seen inside root); never raises."""
    seen = Path(os.path.realpath(path)) if live else Path("/") / path
    local = nearest_dir(root / seen.relative_to("/"), stop_at=root)  # a paging dir may not exist yet
    mount = _mount_of(str(seen), mounts)
    fs: str | Unknown = mount if isinstance(mount, Unknown) else mount.fstype
    windows: bool | Unknown = mount if isinstance(mount, Unknown) else _is_windows_drive(mount)
    device, kind, basis = _device_kind(root, mount, local, live)
    direct, direct_basis = (
        check_o_direct(local)
        if windows is not True
        else (False, "a Windows drive through WSL (9p/drvfs) has no O_DIRECT")
    )
    return Disk(
        path=str(path),
        device=device,
        kind=kind,
        kind_basis=basis,
        mount_point=mount if isinstance(mount, Unknown) else mount.point,
        filesystem=fs,
        windows_drive=windows,
        free_bytes=_free_bytes(local),
        o_direct=direct,
        o_direct_basis=direct_basis,
    )


def _mount_of(path: str, mounts: list[Mount] | Unknown) -> Mount | Unknown:
    if isinstance(mounts, Unknown):
        return mounts
    best = None
    for m in mounts:
        point = m.point.rstrip("/") or "/"
        if point == "/" or path == point or path.startswith(point + "/"):
            if best is None or len(point) >= len(best.point.rstrip("/") or "/"):
                best = m  # later lines mounted over earlier ones at the same point win
    return best if best is not None else Unknown(f"no mount in /proc/mounts holds {path}")


def _is_windows_drive(mount: Mount) -> bool:
    return mount.fstype in WINDOWS_FILESYSTEMS or "aname=drvfs" in mount.options


def _free_bytes(local: Path) -> int | Unknown:
    try:
        stat = os.statvfs(local)
    except OSError as e:
        return Unknown(f"statvfs({local}) failed: {e.strerror or e}")
    return stat.f_bavail * stat.f_frsize


# ---- device kind --------------------------------------------------------------------------


def _device_kind(
    root: Path, mount: Mount | Unknown, local: Path, live: bool
) -> tuple[str | Unknown, str | Unknown, str]:
    """(whole-disk device name, kind, basis)."""
    if isinstance(mount, Unknown):
        return mount, mount, "no mount found for the path"
    name = _block_name(root, mount, local, live)
    if isinstance(name, Unknown):
        return name, name, name.reason
    disk = _whole_disk(root, name)
    kind, basis = _kind_of(root, disk, depth=0)
    return disk, kind, basis


def _block_name(root: Path, mount: Mount, local: Path, live: bool) -> str | Unknown:
    source = mount.source
    if source.startswith("/dev/mapper/"):
        return _dm_by_name(root, source.removeprefix("/dev/mapper/"))
    if source.startswith("/dev/") and source != "/dev/root":
        return Path(os.path.realpath(source) if live else source).name
    if live:  # /dev/root and friends: ask the kernel which device holds the file
        try:
            dev = os.stat(local).st_dev
            link = root / f"sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
            if link.exists():
                return Path(os.path.realpath(link)).name
        except OSError:
            pass
    return Unknown(f"{mount.fstype} mount from {source!r} is not a block device bigmoe can see")


def _dm_by_name(root: Path, mapped: str) -> str | Unknown:
    for entry in sorted((root / "sys/block").glob("dm-*")):
        try:
            if (entry / "dm/name").read_text().strip() == mapped:
                return entry.name
        except OSError:
            continue
    return Unknown(f"no /sys/block/dm-*/dm/name is {mapped!r}")


def _whole_disk(root: Path, name: str) -> str:
    """The disk a partition belongs to (nvme0n1p2 -> nvme0n1); other names unchanged."""
    if (root / "sys/block" / name).exists():
        return name
    for disk in sorted((root / "sys/block").glob("*")):
        if (disk / name).is_dir():
            return disk.name
    match = re.fullmatch(r"(nvme\d+n\d+|mmcblk\d+)p\d+|((?:s|v|xv|h)d[a-z]+)\d+", name)
    return (match[1] or match[2]) if match else name


def _kind_of(root: Path, disk: str, depth: int) -> tuple[str | Unknown, str]:
    block = root / "sys/block" / disk
    if disk.startswith("nvme"):
        return "nvme", f"{disk} is an NVMe namespace"
    if re.match(r"x?vd[a-z]", disk):
        return "virtual", f"{disk} is a paravirtual (virtio/Xen) disk"
    slaves = sorted(p.name for p in (block / "slaves").glob("*")) if (block / "slaves").is_dir() else []
    if slaves and depth < 4:  # device-mapper / md: judge the disks underneath
        kinds = {_kind_of(root, _whole_disk(root, s), depth + 1)[0] for s in slaves}
        if len(kinds) == 1 and not isinstance(next(iter(kinds)), Unknown):
            return next(iter(kinds)), f"{disk} sits on {', '.join(slaves)}"
        return Unknown(f"{disk} sits on {', '.join(slaves)} of mixed or unknown kinds"), "mixed slaves"
    if disk.startswith(("loop", "zram", "ram")):
        return Unknown(f"{disk} is not a physical disk (loop or RAM device)"), "loop/RAM device"
    identity = " ".join(_sysfs(block / "device" / f) for f in ("vendor", "model")).lower()
    if any(word in identity for word in VIRTUAL_VENDORS):
        return "virtual", f"{disk} reports a hypervisor's disk ({identity.strip()!r})"
    rotational = _sysfs(block / "queue/rotational")
    if rotational == "1":
        return "hdd", f"{disk}: queue/rotational is 1"
    if rotational == "0":
        return "sata", f"{disk}: queue/rotational is 0 and it is not NVMe"
    why = "missing" if rotational == "" else f"{rotational[:20]!r}, not 0 or 1"
    return Unknown(f"/sys/block/{disk}/queue/rotational is {why}"), "sysfs unreadable"


def _sysfs(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


# ---- O_DIRECT -----------------------------------------------------------------------------


def check_o_direct(directory: Path) -> tuple[bool | Unknown, str]:
    """Write a small file in `directory` (or use one already there), read one aligned block
    back with O_DIRECT and compare. Never raises."""
    if not hasattr(os, "O_DIRECT"):
        return Unknown("this OS has no O_DIRECT"), "not Linux"
    if not directory.is_dir():
        directory = directory.parent
    pattern = bytes(range(256)) * (2 * DIRECT_BLOCK // 256)
    try:
        fd, name = tempfile.mkstemp(prefix=".bigmoe-odirect-", dir=directory)
    except OSError as e:
        sample = _readable_sample(directory)
        if sample is None:
            return Unknown(
                f"cannot write a test file in {directory} ({e.strerror or e}) and none there is big enough to read"
            ), "no test file"
        return _direct_read(sample, expected=None)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pattern)
            f.flush()
            os.fsync(f.fileno())
        return _direct_read(Path(name), expected=pattern[DIRECT_BLOCK:])
    except OSError as e:
        return Unknown(f"writing the test file {name} failed ({e.strerror or e})"), "test file not written"
    finally:
        Path(name).unlink(missing_ok=True)


def _direct_read(path: Path, expected: bytes | None) -> tuple[bool | Unknown, str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return False, f"open({path.name}, O_DIRECT) failed: {e.strerror or e}"
    buffer = mmap.mmap(-1, DIRECT_BLOCK)  # anonymous maps are page-aligned, as O_DIRECT needs
    try:
        got = os.preadv(fd, [buffer], DIRECT_BLOCK)
        data = bytes(buffer)
    except OSError as e:
        return False, f"an aligned O_DIRECT read of {path.name} failed: {e.strerror or e}"
    finally:
        os.close(fd)
        buffer.close()
    if got != DIRECT_BLOCK:
        return False, f"an aligned O_DIRECT read of {path.name} returned {got} of {DIRECT_BLOCK} bytes"
    if expected is not None and data != expected:
        return False, f"an O_DIRECT read of {path.name} returned other bytes than were written"
    return True, f"read {DIRECT_BLOCK} B at offset {DIRECT_BLOCK} of {path.name} with O_DIRECT"


def _readable_sample(directory: Path) -> Path | None:
    try:
        for entry in sorted(directory.iterdir())[:64]:
            # a symlink may lead to another filesystem, so only plain files of this directory count
            if (
                not entry.is_symlink()
                and entry.is_file()
                and entry.stat().st_size >= 2 * DIRECT_BLOCK
                and os.access(entry, os.R_OK)
            ):
                return entry
    except OSError:
        return None
    return None
