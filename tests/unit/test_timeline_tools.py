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


def bench_rows(paged_tokens: list[int]) -> dict:
    gaps = {"beside_side": {"median_us": 0.416}, "alone": {"median_us": 0.097}}
    return {
        "configs": [
            {"name": "resident", "family": "standard", "tpot_ms": 3.5, "tokens": [1, 2, 3]},
            {"name": "offload17", "family": "standard", "tpot_ms": 14.0, "tokens": [1, 2, 3]},
            {
                "name": "bigmoe-102@r0",
                "family": "standard",
                "tpot_ms": 5.0,
                "tokens": paged_tokens,
                "decode_hit_rate": {"vram": 0.93},
                "pcie_gb_per_token": 0.07,
                "decode_profile": {"chain_gaps": gaps},
                "step_kernels": {
                    "joinless": {"registers": 80, "local_bytes": 8},
                    "plain": {"registers": 72, "local_bytes": 0},
                },
            },
            {"name": "bigmoe-102", "family": "topic-shift", "tpot_ms": 7.0, "tokens": [4]},  # no reference there
        ]
    }


@pytest.mark.parametrize(("paged_tokens", "verdict"), [([1, 2, 3], "tokens same"), ([1, 2, 4], "TOKENS DIFFER")])
def test_bench_table_gives_each_row_its_ratios_identity_and_gaps(tmp_path, paged_tokens, verdict):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_rows(paged_tokens)))
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_table.py"), str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    paged = next(line for line in done.stdout.splitlines() if line.startswith("bigmoe-102@r0"))
    assert "1.43x res" in paged and "2.80x off" in paged and "vram 0.93" in paged and "pcie 0.07 GB" in paged
    assert verdict in paged and "gaps beside 0.416 alone 0.097 us" in paged
    assert "steps joinless 80r 8B, plain 72r 0B" in paged
    other = next(line for line in done.stdout.splitlines() if "topic-shift" in line)
    assert "x res" not in other and "tokens" not in other  # nothing to compare it with in its family


@pytest.mark.parametrize("content", ["not json", json.dumps({"rows": []}), json.dumps({"configs": [{"x": 1}]})])
def test_bench_table_refuses_what_is_not_a_bench_run(tmp_path, content):
    path = tmp_path / "bench.json"
    path.write_text(content)
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_table.py"), str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.startswith("bench_table: ") and len(done.stderr.strip().splitlines()) == 1


def forward_trace(tokens: int, layers: int, gap_first_half: float, gap_second_half: float) -> dict:
    """Each token: per layer a GEMM then the fused step, then the lm_head once; launch gaps by where the layer is."""
    events, t = [], 0.0
    for _ in range(tokens):
        for layer in range(layers):
            gap = gap_first_half if layer < layers // 2 else gap_second_half
            for name in ("gemm", "_step_kernel"):
                events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": 3.0, "args": {"stream": 7}})
                t += 3.0 + gap
        events.append({"ph": "X", "cat": "kernel", "name": "lm_head", "ts": t, "dur": 3.0, "args": {"stream": 7}})
        t += 3.0 + 40.0  # the host's turn between tokens: not a launch gap
    return {"traceEvents": events}


@pytest.mark.parametrize("first,second", [(0.1, 0.1), (0.1, 0.4)])
def test_the_gap_spread_tells_a_uniform_widening_from_one_in_part_of_the_forward(tmp_path: Path, first, second):
    import trace_gap_spread

    path = tmp_path / "t.json"
    path.write_text(json.dumps(forward_trace(4, 10, first, second)))
    assert trace_gap_spread.main([f"x={path}", "--out", str(tmp_path / "out.json")]) == 0
    got = json.loads((tmp_path / "out.json").read_text())["x"]
    by_tenth = got["median_gap_us_by_tenth"]
    # a tenth opens with the gap after the step before it, so each half's inner tenths are its own alone
    assert by_tenth[1:5] == pytest.approx([first] * 4) and by_tenth[6:] == pytest.approx([second] * 4)
    assert got["steps"] == 40 and got["pairs"][0]["count"] >= 36


def test_the_gap_spread_refuses_an_unreadable_trace_in_one_line(tmp_path: Path, capsys):
    import trace_gap_spread

    (tmp_path / "bad.json").write_text("{not json")
    assert trace_gap_spread.main([f"x={tmp_path / 'bad.json'}", "--out", str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "o.json").exists()


def test_the_gap_spread_reads_every_profiled_row_of_a_bench_run(tmp_path: Path):
    import trace_gap_spread

    trace = tmp_path / "decode-1-0.json"
    trace.write_text(json.dumps(forward_trace(4, 10, 0.4, 0.4)))
    rows = [{"name": "bigmoe", "family": "standard", "decode_profile": {"trace": str(trace)}}, {"name": "resident"}]
    (tmp_path / "bench.json").write_text(json.dumps({"configs": rows}))
    assert trace_gap_spread.main(["--bench", str(tmp_path / "bench.json"), "--out", str(tmp_path / "o.json")]) == 0
    got = json.loads((tmp_path / "o.json").read_text())
    assert list(got) == ["bigmoe/standard"] and got["bigmoe/standard"]["median_gap_us"] == pytest.approx(0.4)
