"""The synthetic Qwen4Exp checkpoint: what vLLM's loader maps, what the pager reads, what a tampered config breaks.

vLLM's loader packs checkpoint tensors into its parameters (q/k/v/indexer into qkv_proj, routed
experts into w13/w2, the n-gram shards into one table, ...). `packed_shapes` does that packing
from the safetensors headers; it is compared with the parameter shapes vLLM 0.32 itself had after
loading a checkpoint of the same shape (tests/fixtures/qwen4exp/vllm032_params.json, recorded by
the e2e test's child), and with the shapes the config implies for other sizes and FP8.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bigmoe.model.checkpoint_arch import read_facts
from bigmoe.model.presets import load as load_preset
from bigmoe.model.tinymoe.fp8 import BLOCK
from bigmoe.model.tinymoe.qwen4exp import CheckpointExistsError, make_qwen4exp
from bigmoe.model.tinymoe.qwen4exp_shape import Qwen4ExpShape, Qwen4ExpShapeError
from bigmoe.model.tinymoe.qwen4exp_tensors import table_rows
from bigmoe_pager.core.safetensors_index import read_header
from bigmoe_pager.ngram import NgramLayoutError, TableSpec
from bigmoe_pager.ngram.shards import find_shards
from qwen4exp_tiny import TINY_QWEN4EXP

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = json.loads((ROOT / "tests/fixtures/qwen4exp/vllm032_params.json").read_text())
TINY = TINY_QWEN4EXP


def headers(checkpoint: Path) -> dict[str, tuple[list[int], str]]:
    """Every tensor of the checkpoint: name -> (shape, safetensors dtype)."""
    found = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        header = read_header(file)[0]
        found.update({name: (e["shape"], e["dtype"]) for name, e in header.items() if name != "__metadata__"})
    return found


STACKED = [  # (checkpoint name pattern, vLLM parameter name) of tensors vLLM concatenates along rows
    (r"(.*\.self_attn)\.(q_proj|k_proj|v_proj|indexer\.index_qk_proj)\.weight", r"\1.qkv_proj.weight"),
    (r"(.*\.linear_attn)\.in_proj_(qkv|z)\.weight", r"\1.in_proj_qkvz.weight"),
    (r"(.*\.linear_attn)\.in_proj_(b|a)\.weight", r"\1.in_proj_ba.weight"),
    (r"(.*\.shared_expert)\.(gate|up)_proj\.weight", r"\1.gate_up_proj.weight"),
    (r"(.*\.ple)\.(key|value)_proj\.weight", r"\1.kv_proj.weight"),
    (r"(.*\.ple\.ple_embedding\.ngram_embedding)\.shard_\d+\.weight", r"\1.weight"),
    (
        r"(.*_hyper_connection)\.(input_mix_weight_down|block_inject_weight)\.weight",
        r"\1.input_mix_weight_down_block_inject.weight",
    ),
]
EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def packed_shapes(tensors: dict[str, tuple[list[int], str]], prefix: str, strip: str) -> dict[str, list[int]]:
    """vLLM parameter name -> shape, packing the bf16 checkpoint's tensors under `prefix` the way vLLM's loader does."""
    packed: dict[str, list[int]] = {}
    experts: dict[str, set[int]] = {}
    for name, (shape, _) in tensors.items():
        if not name.startswith(prefix) or name.endswith("weight_scale_inv"):
            continue
        name = strip + name[len(prefix) :]
        if (m := EXPERT.fullmatch(name)) is not None:
            experts.setdefault(m[1], set()).add(int(m[2]))
            key = f"{m[1]}.experts.routed_experts.{'w2' if m[3] == 'down' else 'w13'}_weight"
            packed[key] = shape if m[3] == "down" else [2 * shape[0], shape[1]]
            continue
        for pattern, target in STACKED:
            if re.fullmatch(pattern, name):
                key = re.sub(pattern, target, name)
                rows = packed.get(key, [0])[0] + shape[0]
                packed[key] = [rows, *shape[1:]]
                break
        else:
            packed[name] = shape or [1]  # a 0-dim scale loads into vLLM's 1-element parameter
    for moe, ids in experts.items():
        for key in (f"{moe}.experts.routed_experts.w13_weight", f"{moe}.experts.routed_experts.w2_weight"):
            packed[key] = [len(ids), *packed[key]]
    for key, shape in packed.items():
        if key.endswith("input_mix_weight_down_block_inject.weight"):
            packed[key] = [-(-shape[0] // 16) * 16, shape[1]]  # vLLM pads the merged HC projection to 16 rows
    return packed


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def build(dtype: str, with_tokenizer: bool = False, **shape) -> Path:
        key = (dtype, with_tokenizer, tuple(sorted(shape.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("q4") / "ckpt"
            made[key] = make_qwen4exp(out, Qwen4ExpShape(**shape), dtype, seed=0, with_tokenizer=with_tokenizer)
        return made[key]

    return build


def test_packed_like_vllm_032_loaded_it(make):
    """The shapes vLLM 0.32 had after loading this shape (main model and MTP head) are what the headers pack into."""
    tensors = headers(make("bf16", **SNAPSHOT["shape"]))
    main = {name: shape for name, (shape, _) in SNAPSHOT["Qwen4ExpForCausalLM"].items()}
    mtp = {name: shape for name, (shape, _) in SNAPSHOT["Qwen4ExpMTP"].items()}
    text_model = packed_shapes(tensors, "model.language_model.", "model.")
    assert text_model | packed_shapes(tensors, "lm_head", "lm_head") == main
    expected_mtp = packed_shapes(tensors, "mtp.", "model.")
    shared = {k: v for k, v in main.items() if k in ("model.embed_tokens.weight", "lm_head.weight")}  # MTP shares them
    assert expected_mtp | shared == mtp


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("layers", [2, 5])
def test_every_part_has_the_shapes_its_config_implies(make, dtype, layers):
    checkpoint = make(dtype, layers=layers, **TINY)
    config = json.loads((checkpoint / "config.json").read_text())
    text, tensors = config["text_config"], headers(checkpoint)
    h, wide, kinds = text["hidden_size"], text["hidden_size"] * text["hc_count"], text["layer_types"]
    assert kinds.count("full_attention") >= 1 and kinds[1] == "linear_attention" and text["ple_layer_ids"] == [2]
    packed = packed_shapes(tensors, "model.language_model.", "model.")
    for layer, kind in enumerate(kinds):
        p = f"model.layers.{layer}"
        w13 = [text["num_experts"], 2 * text["moe_intermediate_size"], h]
        assert packed[f"{p}.mlp.experts.routed_experts.w13_weight"] == w13
        assert packed[f"{p}.mlp.shared_expert.gate_up_proj.weight"] == [2 * text["shared_expert_intermediate_size"], h]
        assert packed[f"{p}.mlp.shared_expert_gate.weight"] == [1, h]
        if kind == "full_attention":
            q = text["num_attention_heads"] * text["head_dim"]
            index = (text["indexer_n_heads"] + 1) * text["indexer_head_dim"]
            kv = 2 * text["num_key_value_heads"] * text["head_dim"]
            assert packed[f"{p}.self_attn.qkv_proj.weight"] == [2 * q + kv + index, h]
        else:
            assert f"{p}.linear_attn.in_proj_qkvz.weight" in packed
    spec = TableSpec.from_config(config)
    assert packed["model.layers.1.ple.ple_embedding.ngram_embedding.weight"] == [spec.rows, 160]
    assert packed["model.layers.1.ple.kv_proj.weight"] == [wide + h, text["ple_embed_dim"]]
    assert any(name.startswith("mtp.layers.0.mlp.experts.") for name in tensors)
    assert len([n for n in tensors if n.startswith("mtp.layers.")]) and "mtp.layers.1.mlp.gate.weight" not in tensors
    quantized = {n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith("weight_scale_inv")}
    assert bool(quantized) == (dtype == "fp8")
    for module in quantized:
        (rows, cols), dtype_name = tensors[f"{module}.weight"]
        assert dtype_name == "F8_E4M3"
        assert tensors[f"{module}.weight_scale_inv"] == ([rows // BLOCK, cols // BLOCK], "F32")
    unconverted = set(config.get("quantization_config", {}).get("modules_to_not_convert", []))
    assert not unconverted & quantized


def test_the_pager_reads_the_ngram_table_in_the_real_row_format(make):
    checkpoint = make("fp8", layers=2, **TINY)
    config = json.loads((checkpoint / "config.json").read_text())
    spec = TableSpec.from_config(config)
    table = find_shards(sorted(checkpoint.glob("*.safetensors")), spec=spec)
    assert (table.row_bytes, table.dtype, len(table.shards)) == (160, "F8_E4M3", 3) and table.scale is not None
    ids = np.array([0, 1, spec.shard_rows - 1, spec.shard_rows, spec.rows - 1], np.int64)
    files, offsets = table.locate(ids)
    got = np.stack([np.fromfile(table.files[f], np.uint8, 160, offset=o) for f, o in zip(files, offsets)])
    assert np.array_equal(got, np.concatenate([table_rows(int(i), 1, seed=0) for i in ids]))
    assert torch.isfinite(torch.from_numpy(got).view(torch.float8_e4m3fn).float()).all()


@pytest.mark.parametrize(
    "tamper, caught_by",
    [
        ({"num_experts": 24}, "routed experts"),
        ({"split_ngram_parts": 4}, "ngram"),
        ({"ngram_vocab_size_base": 2048}, "ngram"),
    ],
)
def test_a_tampered_config_is_caught(make, tmp_path, tamper, caught_by):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(make("bf16", layers=2, **TINY), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"].update(tamper)
    (checkpoint / "config.json").write_text(json.dumps(config))
    files = sorted(checkpoint.glob("*.safetensors"))
    if caught_by == "ngram":
        with pytest.raises(NgramLayoutError):
            find_shards(files, spec=TableSpec.from_config(config))
    else:
        facts = read_facts(load_preset("qwen3.8-flash-next"), checkpoint)
        assert any("safetensors hold" in line and "routed experts" in line for line in facts.mismatches), (
            facts.mismatches
        )


def test_transformers_reference_model_gives_finite_varied_logits(make):
    """transformers' own Qwen4Exp (QSA indexer, GDN, HC, PLE, MoE) runs the bf16 checkpoint on CPU."""
    transformers = pytest.importorskip("transformers")
    checkpoint = make("bf16", layers=4, **TINY)
    model, info = transformers.Qwen4ExpForCausalLM.from_pretrained(
        checkpoint, dtype=torch.bfloat16, output_loading_info=True
    )
    # Only buffers it computes itself are missing; it has no notion of the FP8 table's scale.
    assert all(".ple_embedding." in k for k in info["missing_keys"]), info["missing_keys"]
    assert set(info["unexpected_keys"]) == {"model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale"}
    ids = torch.tensor([[5, 100, 7, 300, 42, 9, 1000, 77, 3, 500, 11, 900]])
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).flatten().tolist())) > 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp8", "--hidden", "200"], "divisible by 128"),
        (["--layers", "1"], "at least 2"),
        (["--top-k", "9", "--experts", "8"], "exceeds"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(tmp_path, argv, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_qwen4exp.py"), str(tmp_path / "out"), *argv],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


def test_shape_validation_names_the_field():
    from bigmoe.model.tinymoe.qwen4exp_shape import validate

    with pytest.raises(Qwen4ExpShapeError, match="indexer_budget"):
        validate(Qwen4ExpShape(indexer_budget=10, indexer_compress_ratio=4), "bf16")


def test_same_request_is_a_no_op_a_damaged_one_is_remade_a_different_one_refused(tmp_path):
    """The Qwen4Exp maker keeps the checkpoint directory's rules (tinymoe.checkpoint_dir), as the Qwen3-MoE one."""
    shape = Qwen4ExpShape(layers=2, **TINY)
    out = make_qwen4exp(tmp_path / "ckpt", shape, "bf16", seed=0, with_tokenizer=False)
    shard = sorted(out.glob("*.safetensors"))[0]
    whole, inode = shard.read_bytes(), shard.stat().st_ino
    assert make_qwen4exp(out, shape, "bf16", seed=0, with_tokenizer=False) == out
    assert shard.stat().st_ino == inode, "asked again: nothing is rewritten"

    shard.write_bytes(whole[:-100])
    lines: list[str] = []
    assert make_qwen4exp(out, shape, "bf16", seed=0, with_tokenizer=False, log=lines.append) == out
    assert shard.read_bytes() == whole and "making it again" in lines[0]

    with pytest.raises(CheckpointExistsError, match="seed 0 != 1.*replace it with --force"):
        make_qwen4exp(out, shape, "bf16", seed=1, with_tokenizer=False)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
