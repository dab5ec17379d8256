"""nearest_dir: where the app asks which disk a path is on, for paths that may not exist yet."""

from __future__ import annotations

from pathlib import Path

import pytest
from bigmoe.paths import nearest_dir


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "model.safetensors").write_bytes(b"x")
    return tmp_path


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("models/tiny", "models/tiny"),  # a directory that exists is its own answer
        ("models/tiny/model.safetensors", "models/tiny"),  # a file answers with its directory
        ("models/tiny/paging/run-1/experts.bin", "models/tiny"),  # a directory still to be made
        ("models/none", "models"),
    ],
)
def test_nearest_dir(tree, path, expected):
    assert nearest_dir(tree / path) == tree / expected


def test_stops_at_the_given_root(tmp_path):
    missing_root = tmp_path / "root-not-made"
    assert nearest_dir(missing_root / "a" / "b", stop_at=missing_root) == missing_root
    assert nearest_dir(missing_root / "a" / "b") == tmp_path


def test_climbs_to_the_filesystem_root():
    assert nearest_dir("/no-such-dir-bigmoe/a/b") == Path("/")
