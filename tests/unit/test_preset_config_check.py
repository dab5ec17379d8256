"""A checkpoint whose config.json disagrees with its preset is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from bigmoe.model import presets
from bigmoe.model.tinymoe.shape import TinyShape


@pytest.fixture
def model(tiny_checkpoint):
    return tiny_checkpoint(TinyShape(), "bf16", seed=0, with_tokenizer=False)


def test_the_tiny_preset_matches_its_checkpoint(model):
    presets.check_config(presets.load("tiny-moe"), model)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("experts", 32, "num_experts is 16, but preset tiny-moe says experts = 32"),
        ("top_k", 8, "num_experts_per_tok is 4, but preset tiny-moe says top_k = 8"),
        ("moe_layers", 5, "the model has 4 MoE layers, but preset tiny-moe says 5"),
        ("hidden", 512, "hidden_size is 256"),
    ],
)
def test_mismatched_architecture_is_refused(model, field, value, message):
    preset = presets.load("tiny-moe")
    wrong = dataclasses.replace(preset, arch=dataclasses.replace(preset.arch, **{field: value}))
    with pytest.raises(presets.PresetError, match=message):
        presets.check_config(wrong, model)


def test_another_architecture_is_refused(model, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        presets.PresetError, match="is a MixtralForCausalLM, but preset tiny-moe is for Qwen3MoeForCausalLM"
    ):
        presets.check_config(presets.load("tiny-moe"), copy)


def test_moe_layer_count_follows_qwens_sparse_rules():
    from bigmoe_pager.model_config import moe_layer_count

    assert moe_layer_count({"num_hidden_layers": 48}) == 48
    assert moe_layer_count({"num_hidden_layers": 8, "mlp_only_layers": [0, 1]}) == 6
    assert moe_layer_count({"num_hidden_layers": 8, "decoder_sparse_step": 2}) == 4
    assert moe_layer_count({}) is None


def test_a_source_checkout_without_an_install_finds_the_presets_folder(monkeypatch):
    """With PYTHONPATH=app (no install maps bigmoe.preset_files to presets/), the checkout's presets/ are read."""
    installed = presets.names()

    def not_installed(package):
        raise ModuleNotFoundError(f"No module named {package!r}")

    monkeypatch.setattr(presets.resources, "files", not_installed)
    assert presets.names() == installed and "qwen3.8-flash-next" in installed
    assert presets.load("qwen3.8-flash-next").arch.experts == 512
