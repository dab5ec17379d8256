"""Every command-line script under scripts/ starts and explains itself (`--help`) on a machine without a GPU, run as
the device runs them: as files, with pager/, app/, bench/ and scripts/ on the path. Most of them only ever run on
the GPU machine, so an import that a change broke would otherwise first show there, after staging
(gpu_qwen4exp_bench's rows had rotted that way, session 62)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py") if "argparse" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_script_starts_and_prints_its_usage(script: Path):
    path = os.pathsep.join(str(ROOT / d) for d in ("pager", "app", "bench", "scripts"))
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:500]
