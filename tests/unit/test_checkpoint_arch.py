"""The plan's architecture numbers from the checkpoint's config.json (and safetensors headers),
the preset's before download, each with its origin; mismatches visible in the reasons."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
from bigmoe import run as sequence
from bigmoe.machine.hardware import Hardware
from bigmoe.model import presets
from bigmoe.model.checkpoint_arch import (
    CheckpointConfigError,
    facts_for,
    find_checkpoint,
    fp8_expert_bytes,
    preset_for,
    read_facts,
)
from bigmoe.model.hubcache import RemoteFile, RepoCache, write_ready, write_ref
from bigmoe.model.tinymoe.shape import TinyShape
from bigmoe.plan.planner import Overrides, plan
from qwen4exp_tiny import TINY_QWEN4EXP
from test_links import machine

ARCH_KEYS = ("moe_layers", "experts", "top_k", "expert_bytes", "dense_bytes", "ngram_table")


@pytest.fixture(params=["bf16", "fp8"])
def model(request, tiny_checkpoint):
    return (
        tiny_checkpoint(TinyShape(), request.param, seed=0, with_tokenizer=False, scale_dtype="float32")
        if request.param == "fp8"
        else tiny_checkpoint(TinyShape(), "bf16", seed=0, with_tokenizer=False)
    )


def edited(model, tmp_path, **changes):
    """A copy of the checkpoint with config.json changed."""
    copy = tmp_path / "ckpt"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_the_tiny_checkpoint_gives_the_presets_numbers(model):
    preset = presets.load("tiny-moe")
    facts = read_facts(preset, model)
    assert dataclasses.replace(facts.arch, dense_bytes=preset.arch.dense_bytes) == preset.arch
    if "fp8" in json.dumps(json.loads((model / "config.json").read_text()).get("quantization_config")):
        # the preset counts bf16 dense weights; the FP8 checkpoint stores its attention in FP8, so the headers say less
        assert facts.arch.dense_bytes < preset.arch.dense_bytes
        assert facts.mismatches == (
            f"dense_bytes is {facts.arch.dense_bytes} from the safetensors headers, "
            f"but preset tiny-moe says {preset.arch.dense_bytes}",
        )
    else:
        assert facts.arch.dense_bytes == preset.arch.dense_bytes and facts.mismatches == ()
    assert facts.origins["experts"] == "from config.json (num_experts)"
    assert facts.origins["dense_bytes"].startswith("from the safetensors headers")
    assert facts.origins["kv_bytes_per_token"] == "from config.json (4 layers x K,V x 2 heads x 64 x 2 B)"
    assert facts.origins["max_context"].startswith("from preset tiny-moe")
    assert "128x128 block" in facts.origins["expert_bytes_fp8"]


@pytest.mark.parametrize("name", presets.names())
def test_fp8_expert_bytes_match_every_preset(name):
    arch = presets.load(name).arch
    assert fp8_expert_bytes(arch.hidden, arch.moe_intermediate, (128, 128)) == arch.expert_bytes_fp8
    assert fp8_expert_bytes(arch.hidden, arch.moe_intermediate, None) == 3 * arch.hidden * arch.moe_intermediate + 12


def test_more_experts_in_the_config_shows_in_the_plan(model, tmp_path):
    preset = presets.load("tiny-moe")
    facts = read_facts(preset, edited(model, tmp_path, num_experts=32))
    p = plan(machine("cpu-laptop"), preset, Overrides(model_dir=str(tmp_path), paging_dir=str(tmp_path)), facts)
    assert p.experts == 32
    assert p.reasons["experts"] == "from config.json (num_experts); but preset tiny-moe says 16"
    assert any("experts is 32 from config.json, but preset tiny-moe says 16" in n for n in p.notes)
    assert any("routed experts" in n for n in p.notes)  # the shards hold 16 experts' bytes, not 32
    with pytest.raises(presets.PresetError, match="num_experts is 32"):
        presets.check_config(preset, tmp_path / "ckpt")  # the launch-time refusal stays


@pytest.mark.parametrize(
    "changes, layers, said",
    [
        ({"mlp_only_layers": [0]}, 3, "mlp_only_layers [0]"),
        ({"decoder_sparse_step": 2}, 2, "decoder_sparse_step 2"),
    ],
)
def test_moe_layers_follow_the_sparse_keys(model, tmp_path, changes, layers, said):
    facts = read_facts(presets.load("tiny-moe"), edited(model, tmp_path, **changes))
    assert facts.arch.moe_layers == layers and said in facts.origins["moe_layers"]


def test_ngram_table_bytes_come_from_the_ple_keys(model, tmp_path):
    ckpt = edited(
        model,
        tmp_path,
        ple_layer_ids=[2],
        hidden_size=2560,
        split_ngram_parts=128,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )
    facts = read_facts(presets.load("tiny-moe"), ckpt)
    assert facts.arch.ngram_table_bytes == 51_200_245_760
    assert "320,001,536 rows x 160 B" in facts.origins["ngram_table_bytes"]


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("config", "is not valid JSON"),
        ("experts", "num_experts is 'many', not a non-negative integer"),
        ("block", "weight_block_size is [128], not [rows, cols]"),
        ("header", "not safetensors or truncated"),
    ],
)
def test_a_broken_checkpoint_is_one_clear_error(model, tmp_path, breakage, message):
    ckpt = edited(model, tmp_path)
    if breakage == "config":
        (ckpt / "config.json").write_text("{broken")
    elif breakage == "experts":
        ckpt = edited(model, tmp_path / "x", num_experts="many")
    elif breakage == "block":
        ckpt = edited(model, tmp_path / "x", quantization_config={"quant_method": "fp8", "weight_block_size": [128]})
    else:
        shard = sorted(ckpt.glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(CheckpointConfigError, match=re.escape(message)) as err:
        read_facts(presets.load("tiny-moe"), ckpt)
    assert "\n" not in str(err.value)


def test_before_download_the_preset_numbers_are_named_as_such():
    p = plan(
        machine("h200"),
        presets.load("qwen3.8-flash-next"),
        Overrides(model_dir="/srv/models", paging_dir="/srv/paging"),
        facts_for(presets.load("qwen3.8-flash-next"), None, "the model is not downloaded yet"),
    )
    for key in ARCH_KEYS:
        assert p.reasons[key] == "from preset qwen3.8-flash-next (the model is not downloaded yet)"
    assert p.config_path is None and p.ngram_table_bytes == 51_200_245_760


def test_a_hub_download_counts_only_once_ready(model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    preset = presets.load("qwen3.6-35b-a3b")
    cache, commit = RepoCache((tmp_path / "hub").resolve(), preset.hub_id), "a" * 40
    shutil.copytree(model, cache.snapshot(commit))
    write_ref(cache, preset.revision, commit)
    assert find_checkpoint(preset, None, ("fp8",)) == (None, "the model is not downloaded yet")
    size = (cache.snapshot(commit) / "config.json").stat().st_size
    write_ready(cache, commit, [RemoteFile("config.json", size, "b" * 40, None)])
    assert find_checkpoint(preset, None, ("fp8",)) == (cache.snapshot(commit), "")


def test_the_pipeline_plans_with_a_given_checkpoint(model, tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    preset = presets.load("tiny-moe")
    hw: Hardware = machine("cpu-laptop")
    given = sequence.make_plan(hw, preset, sequence.RunOptions(model="tiny-moe", model_dir=str(model)))
    assert given.config_path == str(model / "config.json")
    assert given.reasons["top_k"] == "from config.json (num_experts_per_tok)"
    made_yet = sequence.make_plan(hw, preset, sequence.RunOptions(model="tiny-moe"))
    assert made_yet.config_path is None and "not made yet" in made_yet.reasons["experts"]


# ---- Qwen4Exp (Qwen3.8-Flash-Next architecture) checkpoint directories ------------------------------------

QWEN4EXP = dict(layers=5, **TINY_QWEN4EXP)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def qwen4exp(request, tmp_path_factory):
    from bigmoe.model.tinymoe.qwen4exp import make_qwen4exp
    from bigmoe.model.tinymoe.qwen4exp_shape import Qwen4ExpShape

    return make_qwen4exp(
        tmp_path_factory.mktemp("q4") / "ckpt", Qwen4ExpShape(**QWEN4EXP), request.param, seed=0, with_tokenizer=False
    )


def test_a_qwen4exp_checkpoint_gives_its_own_numbers(qwen4exp):
    from bigmoe_pager.ngram import TableSpec

    config = json.loads((qwen4exp / "config.json").read_text())
    fp8 = "quantization_config" in config
    facts = read_facts(presets.load("qwen3.8-flash-next"), qwen4exp)
    spec = TableSpec.from_config(config)
    expert = fp8_expert_bytes(128, 128, (128, 128)) if fp8 else 3 * 128 * 128 * 2
    assert (facts.arch.moe_layers, facts.arch.experts, facts.arch.top_k, facts.arch.shared_experts) == (5, 12, 4, 1)
    assert facts.arch.mtp_layers == 1 and facts.origins["mtp_layers"] == "from config.json (mtp_num_hidden_layers)"
    assert facts.arch.ngram_table_bytes == spec.rows * 160
    # one full-attention layer in five (the 3:1 pattern), K and V of 1 head x 128, bf16
    assert facts.arch.kv_bytes_per_token == 1 * 2 * 1 * 128 * 2
    # the routed experts the headers hold are exactly the config's (MTP's own experts and the n-gram table left out)
    assert not any("safetensors hold" in line for line in facts.mismatches), facts.mismatches
    per_expert = facts.arch.expert_bytes_fp8 if fp8 else facts.arch.expert_bytes_bf16
    assert per_expert == expert


def test_a_checkpoint_directory_as_model_picks_the_preset_by_architecture(qwen4exp):
    preset = preset_for(qwen4exp)
    assert preset.name == "qwen3.8-flash-next" and preset.arch.experts == 12 and preset.arch.moe_layers == 5
    presets.check_config(preset, qwen4exp)  # the numbers it carries are the directory's: nothing to disagree with
    opts = sequence.RunOptions(model=str(qwen4exp))
    assert sequence.load_preset(opts).name == "qwen3.8-flash-next" and opts.model_dir == str(qwen4exp)


def test_bigmoe_plan_takes_a_checkpoint_directory(qwen4exp):
    from bigmoe.cli.plan import plan as plan_command
    from click.testing import CliRunner

    result = CliRunner().invoke(
        plan_command,
        [str(qwen4exp), "--vram-gib", "24", "--ram-gib", "64", "--disk", "nvme", "--disk-gib", "500", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["config_path"] == str(qwen4exp / "config.json")
    assert report["reasons"]["experts"] == "from config.json (num_experts)"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "is a LlamaForCausalLM; bigmoe serves"),
        ({"model_type": "qwen4_exp"}, "names no architectures"),
    ],
)
def test_a_directory_of_an_unknown_model_is_one_clear_error(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(presets.PresetError, match=message):
        preset_for(tmp_path)
    with pytest.raises(presets.PresetError, match="unknown model"):  # a directory is no preset's name
        presets.load(str(tmp_path))
