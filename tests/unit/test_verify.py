"""`bigmoe verify` against a local Hub (tests/hubserver.py): a downloaded checkpoint is hashed again
(sha256 for LFS files, git blob id for small ones, from the Hub's metadata) and its safetensors headers
checked; a damaged file is named on one line, removed, and `bigmoe pull` fetches it again."""

from __future__ import annotations

from pathlib import Path

import pytest
from bigmoe.cli.pull import pull
from bigmoe.cli.verify import verify_command
from bigmoe.model import fetch
from bigmoe.model.shard_check import shard_problem
from click.testing import CliRunner

from tests.unit.test_fetch import BIG, PRESET, REPO, cache, hub, served, start_hub  # noqa: F401 (fixtures)


def run(command, *args: str):
    return CliRunner().invoke(command, list(args), catch_exceptions=False)


@pytest.fixture
def pulled(hub, cache) -> Path:
    result = run(pull, PRESET, "--cache-dir", str(cache))
    assert result.exit_code == 0, result.stderr
    return Path(result.stdout.splitlines()[-1].removeprefix("ready "))


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:  # through the snapshot link, into the blob
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_whole_download_verifies(pulled, cache):
    result = run(verify_command, PRESET, "--cache-dir", str(cache))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("ok: ") and "match the Hub's listing" in result.stdout


@pytest.mark.parametrize("name, words", [(BIG, "sha256"), ("config.json", "git blob id")])
def test_flipped_bytes_are_caught_named_and_refetched(pulled, cache, name, words):
    size = (pulled / name).stat().st_size
    flip(pulled / name, size // 2)
    result = run(verify_command, PRESET, "--cache-dir", str(cache))
    assert result.exit_code == fetch.EXIT_NOT_READY
    assert result.stdout.splitlines() == [line for line in result.stdout.splitlines() if line.startswith("bad: ")]
    assert len(result.stdout.splitlines()) == 1 and name in result.stdout and words in result.stdout
    assert result.stderr.count("\n") == 1 and f"bigmoe pull {PRESET}" in result.stderr
    assert not (pulled / name).exists(), "the bad file is removed so pull fetches it again"
    assert run(pull, PRESET, "--cache-dir", str(cache)).exit_code == 0
    assert run(verify_command, PRESET, "--cache-dir", str(cache)).exit_code == 0


def test_without_the_hub_the_hashes_recorded_at_download_are_used(pulled, cache, monkeypatch):
    flip(pulled / BIG, 1 << 20)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    result = run(verify_command, PRESET, "--cache-dir", str(cache), "--keep")
    assert result.exit_code == fetch.EXIT_NOT_READY and "sha256" in result.stdout and BIG in result.stdout
    assert "rerun without --keep" in result.stderr and (pulled / BIG).exists()


def test_not_downloaded_says_how_to_fetch(hub, cache):
    result = run(verify_command, PRESET, "--cache-dir", str(cache))
    assert result.exit_code != 0 and result.stderr.count("\n") == 1 and f"bigmoe pull {PRESET}" in result.stderr


def cut(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: cut(p, p.stat().st_size - 100), "truncated"),
        (lambda p: cut(p, 4), "too short"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 10), "10 bytes after the last tensor"),
        (lambda p: flip(p, 12), "header"),
    ],
)
def test_shard_headers_catch_cut_or_damaged_files(served, tmp_path, damage, words):
    shard = tmp_path / BIG
    shard.write_bytes((served / BIG).read_bytes())
    assert shard_problem(shard) is None
    damage(shard)
    why = shard_problem(shard)
    assert why is not None and why.startswith(str(shard)) and words in why and "\n" not in why
