"""child: a measurement run in a short-lived child process (`python -m <module> ARGS`), whose last stdout line is a
JSON object: the result's fields, or {"unknown": reason}. The caller keeps nothing the measurement needed (a CUDA
context, torch, a compiled decoder). Never raises: anything that goes wrong is an Unknown naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bigmoe.machine.hardware import Unknown


def run(module: str, args: list[str], what: str, timeout_s: float, python: str | None = None) -> dict | Unknown:
    """The fields the child printed, or Unknown (what: the measurement's name, for the reasons)."""
    app_dir = str(Path(__file__).resolve().parents[2])  # app/, above bigmoe/
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (app_dir, os.environ.get("PYTHONPATH", "")) if p))
    try:
        done = subprocess.run(
            [python or sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Unknown(f"{what} took over {timeout_s:g} s and was stopped")
    except OSError as e:
        return Unknown(f"{what} could not start ({e.strerror or e})")
    return parse(done.returncode, done.stdout, done.stderr, what)


def parse(returncode: int, stdout: str, stderr: str, what: str) -> dict | Unknown:
    """The child's last stdout line as its fields, or Unknown naming what went wrong."""
    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return Unknown(f"{what} exited with code {returncode} ({tail[:200]})")
    try:
        data = json.loads(lines[-1])
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError as e:
        return Unknown(f"{what} printed {lines[-1][:80]!r}, not a result ({e})")
    if "unknown" in data:
        return Unknown(str(data["unknown"]))
    return data


def rate(fields: dict | Unknown, cls: type, what: str):
    """The child's fields as a `cls` (a dataclass with a `gbps`), or Unknown naming what is wrong with them."""
    if isinstance(fields, Unknown):
        return fields
    try:
        result = cls(**fields)
    except TypeError as e:
        return Unknown(f"{what} printed {str(fields)[:80]!r}, not a result ({e})")
    if not (isinstance(result.gbps, float) and result.gbps > 0):
        return Unknown(f"{what} reported {result.gbps!r} GB/s")
    return result


def report(result: object) -> None:
    """Print a child's result as its last stdout line (a dataclass's fields, or an Unknown's reason)."""
    from dataclasses import asdict

    print(json.dumps({"unknown": result.reason} if isinstance(result, Unknown) else asdict(result)), flush=True)
