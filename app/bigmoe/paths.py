"""Where bigmoe keeps its files: models it makes, logs, server records (one cache root), and how it writes them."""

from __future__ import annotations

import os
from pathlib import Path

from bigmoe_pager.atomic_file import write_atomic  # noqa: F401  (the app's writes go through the pager's one helper)

from bigmoe.errors import BigmoeError


class StateDirError(BigmoeError):
    """bigmoe's own directory (records, logs, models) cannot be made; the message names it and the fix."""


def cache_root() -> Path:
    """BIGMOE_HOME, else $XDG_CACHE_HOME/bigmoe, else ~/.cache/bigmoe."""
    if os.environ.get("BIGMOE_HOME"):
        return Path(os.environ["BIGMOE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bigmoe"


def make_dir(path: Path, error: type[BigmoeError], what: str, fix: str) -> Path:
    """`path` made with its parents, or `error` raised with one line: what it is, why not, and `fix`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"cannot create {what} {path}: {e.strerror or e}; {fix}") from None
    return path


def _dir(*parts: str) -> Path:
    fix = "make it writable or set BIGMOE_HOME to a writable directory"
    return make_dir(cache_root().joinpath(*parts), StateDirError, "bigmoe's directory", fix)


def run_dir() -> Path:
    return _dir("run")


def log_dir() -> Path:
    return _dir("logs")


def models_dir() -> Path:
    return _dir("models")


def paging_file_name(model: str, dtype: str) -> str:
    """A model's paging file in its paging directory (the plan names it so; `bigmoe list` and `rm` find it so)."""
    return f"{model}-{dtype}.pages"


def nearest_dir(path: Path, stop_at: Path | None = None) -> Path:
    """The directory `path` names, else its nearest ancestor that is one (for a directory still to be made, or a
    file's own directory), never climbing above `stop_at`: the place to ask which disk `path` is on."""
    path = Path(path)
    while not path.is_dir() and path != stop_at and path != path.parent:
        path = path.parent
    return path
