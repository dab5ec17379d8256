"""The wheel carries the C files the pager builds at first use (the GPU machines install the wheel, not the tree)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_c_file_of_the_pager_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted((ROOT / "pager").rglob("*.c"))
    assert sources, "the pager has C files (core/host_copier.c, ...)"
    for path in sources:
        package = ".".join(path.parent.relative_to(ROOT / "pager").parts)
        patterns = data.get(package, [])
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.relative_to(ROOT)} is not in the wheel"
