"""bigmoe plan --speculative-tokens: vLLM's MTP argument, expert slots for the drafter's MoE layer, and CUDA-graph
batches sized for verification steps ((speculative tokens + 1) x top-k expert ids per sequence)."""

from __future__ import annotations

import json

import pytest
from bigmoe.cli.plan import plan as plan_command
from click.testing import CliRunner

REFERENCE = ("qwen3.8-flash-next", "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--json")


def run_plan(*args: str):
    return CliRunner().invoke(plan_command, list(args))


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def slot_bytes(data: dict) -> int:
    vram = next(t for t in data["memory"] if t["tier"].startswith("VRAM"))
    return next(r["bytes"] for r in vram["rows"] if r["item"] == "expert slots")


@pytest.mark.parametrize("tokens", [0, 1, 2])
def test_the_reference_job_with_mtp(tokens):
    result = run_plan(*REFERENCE, "--speculative-tokens", str(tokens))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    argv, slots, top_k = data["argv"], data["vram_slots"], data["top_k"]
    spec = flag_value(argv, "--speculative-config")
    if tokens == 0:
        assert spec is None
    else:
        assert json.loads(spec) == {"method": "mtp", "num_speculative_tokens": tokens}
        assert f"verification step has {tokens + 1} tokens" in data["reasons"]["argv"]
    capture = int(flag_value(argv, "--max-cudagraph-capture-size"))
    assert capture * top_k <= slots  # vLLM counts verification tokens in the captured batch
    assert (tokens + 1) * top_k <= slots  # one sequence's verification step fits the slots
    layers = data["layers"] + (1 if tokens else 0)  # the MTP drafter's MoE layer is paged too
    assert slot_bytes(data) == slots * layers * data["expert_bytes"]


def test_the_drafters_layer_costs_slots():
    off, on = (json.loads(run_plan(*REFERENCE, "--speculative-tokens", t).stdout) for t in ("0", "2"))
    assert on["vram_slots"] < off["vram_slots"]


@pytest.mark.parametrize(
    "args, text",
    [
        (("--vram-slots", "20", "--speculative-tokens", "2"), "3 tokens x top-10 = 30 expert ids, more than the 20"),
        (("--speculative-tokens", "3"), "4 tokens x top-10 = 40 expert ids"),  # 24 GiB leaves fewer slots than that
    ],
)
def test_a_verification_step_the_slots_cannot_hold_is_refused(args, text):
    result = run_plan(*REFERENCE, *args)
    assert result.exit_code != 0 and text in json.loads(result.stdout)["refusal"]


def test_a_model_without_an_mtp_head_is_refused():
    result = run_plan(
        "qwen3.6-35b-a3b",
        "--gpu",
        "RTX 4090",
        "--ram-gib",
        "64",
        "--disk",
        "nvme",
        "--json",
        "--speculative-tokens",
        "1",
    )
    assert result.exit_code != 0 and "no MTP head" in json.loads(result.stdout)["refusal"]


@pytest.mark.parametrize("value", ["4", "-1"])
def test_out_of_range_is_one_line(value):
    result = run_plan(*REFERENCE, "--speculative-tokens", value)
    assert result.exit_code == 2 and "--speculative-tokens" in result.output
