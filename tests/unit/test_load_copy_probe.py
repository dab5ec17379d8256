"""scripts/gpu_load_copy_probe.py on CPU: every variant copies the checkpoint's expert bytes exactly, and bad input
gets one line and exit 2. The H200 times them (docs/benchmarks.md, run 8)."""

from __future__ import annotations

import json

import gpu_load_copy_probe as probe  # scripts/ is on pytest's pythonpath (pyproject)
import pytest
import torch
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two shards of FP8 experts (two shapes, as w13 halves and w2), plus tensors the probe must leave out."""
    root = tmp_path_factory.mktemp("ckpt")
    gen = torch.Generator().manual_seed(3)

    def fp8(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)

    for shard in range(2):
        tensors = {}
        for e in range(3):
            base = f"model.layers.{shard}.mlp.experts.{e}"
            tensors[f"{base}.gate_proj.weight"] = fp8(64, 128)
            tensors[f"{base}.down_proj.weight"] = fp8(128, 64)
            tensors[f"{base}.down_proj.weight_scale_inv"] = torch.ones(1, 1)
        tensors[f"model.layers.{shard}.self_attn.o_proj.weight"] = fp8(32, 32)
        save_file(tensors, str(root / f"model-0000{shard + 1}-of-00002.safetensors"))
    return root


def test_it_picks_only_expert_weights(checkpoint):
    names = [name for _, name in probe.expert_tensors(checkpoint, 1 << 30)]
    assert len(names) == 12 and all(".experts." in n and n.endswith("weight") for n in names)


@pytest.mark.parametrize("variant", probe.VARIANTS)
@pytest.mark.parametrize("pinned", [True, False])
def test_every_variant_copies_the_exact_bytes(checkpoint, variant, pinned):
    tensors = probe.expert_tensors(checkpoint, 1 << 30)
    records = probe.records_for(tensors, pinned)
    copied, _ = probe.copy_all(tensors, records, variant, seconds=60.0)
    assert copied == 12 * 64 * 128
    for i, src in enumerate(probe._iterate(tensors)):
        assert torch.equal(records[i, : src.numel()], src.view(torch.uint8).reshape(-1))


def test_the_report_has_a_row_per_variant_and_tier_and_two_beside(checkpoint, tmp_path):
    out = tmp_path / "probe.json"
    assert probe.main(["--checkpoint", str(checkpoint), "--gib", "0.001", "--seconds", "5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["processes"]) for r in rows] == [(v, 1) for v in probe.VARIANTS] * 2 + [("fp8", 2)] * 2
    assert all(r["bytes"] > 0 and r["gb_per_s"] > 0 for r in rows)


@pytest.mark.parametrize(
    "argv,message", [(["--variants", "fp16"], "unknown variants ['fp16']"), ([], "no safetensors files")]
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert probe.main(["--checkpoint", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
