"""Where bigmoe keeps its files: models it makes, logs, runfiles (all under one cache root), and how it writes them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """BIGMOE_HOME, else $XDG_CACHE_HOME/bigmoe, else ~/.cache/bigmoe."""
    if os.environ.get("BIGMOE_HOME"):
        return Path(os.environ["BIGMOE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bigmoe"


def _dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_dir() -> Path:
    return _dir("run")


def log_dir() -> Path:
    return _dir("logs")


def models_dir() -> Path:
    return _dir("models")


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
