"""Build one of the pager's C files into a shared library at first use, and load it with ctypes.

The pager's native threads (host_copier.c, ssd_reader.c) serve GPU-published mailboxes without the GIL. They need
no CUDA headers or libraries at build time (the driver is dlopen()ed), only a C compiler: $CC, else `cc`. Each
library is cached under cache_dir() by a digest of its source and the compiler, so an edited file or another
compiler builds anew and two versions never collide.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path


class NativeBuildError(RuntimeError):
    """A C file of the pager could not be compiled (no compiler, or it failed)."""


def cache_dir() -> Path:
    """Where compiled libraries go: $BIGMOE_CACHE_DIR, else $XDG_CACHE_HOME/bigmoe, else ~/.cache/bigmoe."""
    if os.environ.get("BIGMOE_CACHE_DIR"):
        return Path(os.environ["BIGMOE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bigmoe"


def library(source: Path) -> ctypes.CDLL:
    """The library built from `source` for the current $CC and cache dir (built on first use, loaded once a
    process); NativeBuildError, naming the file, when it cannot be built."""
    return _load(str(source), os.environ.get("CC") or "cc", str(cache_dir()))


@functools.lru_cache(maxsize=None)
def _load(source: str, compiler: str, directory: str) -> ctypes.CDLL:
    # Keyed by (source, compiler, directory) so a changed $CC or cache dir builds anew; a failure raises, and
    # lru_cache does not keep exceptions, so the next call tries again.
    path = Path(source)
    argv = shlex.split(compiler)
    exe = shutil.which(argv[0]) if argv else None
    if exe is None:
        raise NativeBuildError(f"{path.name}: C compiler {compiler!r} not found; install one (gcc or clang) or set CC")
    digest = hashlib.sha256(path.read_bytes() + b"\0" + exe.encode() + b"\0" + compiler.encode()).hexdigest()[:16]
    out = Path(directory) / f"{path.stem}-{digest}.so"
    if not out.exists():
        _build(argv, exe, path, out)
    return ctypes.CDLL(str(out))


def _build(argv: list[str], exe: str, source: Path, out: Path) -> None:
    """Compile into a temp name beside `out`, then rename: a half-written library is never loaded, and two
    processes building at once each rename a whole one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [exe, *argv[1:], "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp, str(source), "-ldl"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise NativeBuildError(f"{source.name}: cannot run C compiler {exe} ({e})") from None
        if r.returncode != 0:
            first = next((line.strip() for line in r.stderr.splitlines() if line.strip()), "no message")
            raise NativeBuildError(f"{source.name}: {exe} failed to build it (exit {r.returncode}): {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
