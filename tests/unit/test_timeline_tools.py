"""The run-20 tools: reading a bench run's kernel timelines again, and the launch-gap probe's parts that run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpu_launch_gap_probe  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def chrome_trace(gap_us: float) -> dict:
    events, t = [], 0.0
    for i in range(6):
        events.append({"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": t, "dur": 2.0, "args": {"stream": 1}})
        t += 2.0 + gap_us
    events.append({"ph": "X", "cat": "kernel", "name": "_wait_kernel", "ts": 0.0, "dur": t, "args": {"stream": 2}})
    return {"traceEvents": events}


def bench_run(tmp_path: Path, with_trace: bool) -> tuple[Path, Path]:
    """A bench JSON as the machine wrote it (traces under /tmp/logs-bench-x/profiles) and its extracted logs dir."""
    logs = tmp_path / "logs-bench-x"
    (logs / "profiles").mkdir(parents=True)
    if with_trace:
        (logs / "profiles" / "decode-1-0.json").write_text(json.dumps(chrome_trace(0.4)))
    rows = [
        {"name": "resident", "family": "standard", "tpot_ms": 3.4},
        {
            "name": "bigmoe-102@r0",
            "family": "standard",
            "tpot_ms": 5.4,
            "decode_profile": {"trace": "/tmp/logs-bench-x/profiles/decode-1-0.json", "tokens": 1},
        },
    ]
    bench = tmp_path / "bench-x.json"
    bench.write_text(json.dumps({"configs": rows}))
    return bench, logs


def run_again(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "timeline_again.py"), *args], capture_output=True, text=True, timeout=120
    )


def test_timeline_again_writes_the_new_fields_of_every_profiled_row(tmp_path):
    bench, logs = bench_run(tmp_path, with_trace=True)
    out = tmp_path / "again.json"
    done = run_again(str(bench), str(logs), "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["bigmoe-102@r0"]  # the resident row had no timeline
    beside = rows[0]["chain_gaps"]["beside_side"]
    assert beside["per_token"] == 5.0
    assert beside["median_us"] == pytest.approx(0.4)


def test_timeline_again_says_which_trace_is_missing(tmp_path):
    bench, logs = bench_run(tmp_path, with_trace=False)
    done = run_again(str(bench), str(logs), "--out", str(tmp_path / "again.json"))
    assert done.returncode == 2
    assert "bigmoe-102@r0 (standard): no trace at" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "again.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is")
def test_the_launch_gap_probe_refuses_without_a_gpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_launch_gap_probe.py"), "--out", str(tmp_path / "gap.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_launch_gap_probe: needs a CUDA GPU and Triton"


@pytest.mark.parametrize("variant", sorted(set(gpu_launch_gap_probe.POLL_MODES)))
@pytest.mark.parametrize(
    ("word", "target", "max_spins"),
    [(3, 3, 1 << 20), (3, 1, 1 << 20), (3, 9, 5), (3, -1, 5)],  # reached, passed, never reached, captured form
)
def test_the_probe_side_kernel_ends_once_its_word_arrives_or_its_spins_run_out(word, target, max_spins, variant):
    flag = torch.tensor([word], dtype=torch.int64)
    host = torch.zeros(1, dtype=torch.int64)
    counter = torch.zeros(2, dtype=torch.int64)
    mode = gpu_launch_gap_probe.POLL_MODES[variant]
    # Triton's interpreter here
    gpu_launch_gap_probe._side_kernel[(1,)](flag, host, counter, target, max_spins, MODE=mode, ON_GPU=False)
    assert int(flag[0]) == word  # the polled word is only read
    polls = max_spins if target > word or target < 0 else 0
    assert int(counter[0]) == (polls if variant == "atomics" else 0)
    assert int(host[0]) == (polls - 1 if variant == "store-sys" and polls else 0)
