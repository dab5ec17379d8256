"""scripts/make_tiny_moe.py: synthetic Qwen3-MoE checkpoints, bf16 and Qwen-layout FP8."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
import make_tiny_moe as tiny  # noqa: E402  (scripts/ is on pytest's pythonpath: pyproject)

TinyShape = tiny.TinyShape

SHAPES = {
    "preset": TinyShape(),
    "wide": TinyShape(
        layers=2, experts=6, top_k=2, hidden=128, moe_intermediate=256, vocab=1024, heads=2, kv_heads=1, head_dim=128
    ),
}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read through its index the way loaders do."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(path / shard, framework="pt") as f:
            for name in f.keys():
                assert weight_map[name] == shard
                out[name] = f.get_tensor(name)
    assert set(out) == set(weight_map)
    return out


def expected_tensors(shape: TinyShape, dtype: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of a Qwen3-MoE checkpoint as Qwen publishes them."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    linears = {"lm_head": (shape.vocab, h)}
    norms = {"model.norm": (h,)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        linears |= {
            f"{p}.self_attn.q_proj": (q, h),
            f"{p}.self_attn.k_proj": (kv, h),
            f"{p}.self_attn.v_proj": (kv, h),
            f"{p}.self_attn.o_proj": (h, q),
            f"{p}.mlp.gate": (shape.experts, h),
        }
        norms |= {
            f"{p}.input_layernorm": (h,),
            f"{p}.post_attention_layernorm": (h,),
            f"{p}.self_attn.q_norm": (shape.head_dim,),
            f"{p}.self_attn.k_norm": (shape.head_dim,),
        }
        for e in range(shape.experts):
            linears |= {
                f"{p}.mlp.experts.{e}.gate_proj": (shape.moe_intermediate, h),
                f"{p}.mlp.experts.{e}.up_proj": (shape.moe_intermediate, h),
                f"{p}.mlp.experts.{e}.down_proj": (h, shape.moe_intermediate),
            }
    want = {"model.embed_tokens.weight": ((shape.vocab, h), torch.bfloat16)}
    want |= {f"{m}.weight": (s, torch.bfloat16) for m, s in norms.items()}
    for module, (rows, cols) in linears.items():
        if dtype == "fp8" and module.rsplit(".", 1)[-1] in QUANTIZED:
            want[f"{module}.weight"] = ((rows, cols), torch.float8_e4m3fn)
            want[f"{module}.weight_scale_inv"] = ((rows // 128, cols // 128), torch.float32)
        else:
            want[f"{module}.weight"] = ((rows, cols), torch.bfloat16)
    return want


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_same_seed_gives_the_same_bytes(tiny_checkpoint, tmp_path, dtype):
    again = tiny.make_tiny_moe(tmp_path / "again", TinyShape(), dtype, seed=0)
    assert file_bytes(tiny_checkpoint(dtype=dtype, seed=0)) == file_bytes(again)


def test_another_seed_draws_other_weights(tiny_checkpoint):
    a = read_checkpoint(tiny_checkpoint(SHAPES["wide"], "bf16", seed=0))
    b = read_checkpoint(tiny_checkpoint(SHAPES["wide"], "bf16", seed=1))
    for name in a:
        same = torch.equal(a[name], b[name])
        assert same == name.endswith("norm.weight"), name  # norms are ones in every seed


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("shape_name", SHAPES)
def test_tensor_names_shapes_and_dtypes_follow_qwen(tiny_checkpoint, shape_name, dtype):
    shape = SHAPES[shape_name]
    found = {n: (tuple(t.shape), t.dtype) for n, t in read_checkpoint(tiny_checkpoint(shape, dtype)).items()}
    assert found == expected_tensors(shape, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("shape_name", SHAPES)
def test_config_describes_qwen3_moe(tiny_checkpoint, shape_name, dtype):
    shape = SHAPES[shape_name]
    path = tiny_checkpoint(shape, dtype)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (
        config["num_hidden_layers"],
        config["num_experts"],
        config["num_experts_per_tok"],
        config["hidden_size"],
        config["moe_intermediate_size"],
        config["vocab_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    ) == (
        shape.layers,
        shape.experts,
        shape.top_k,
        shape.hidden,
        shape.moe_intermediate,
        shape.vocab,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    )
    assert config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1
    if dtype == "bf16":
        assert "quantization_config" not in config
        return
    quant = config["quantization_config"]
    not_converted = ["lm_head"] + [
        f"model.layers.{i}.{m}"
        for i in range(shape.layers)
        for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    ]
    assert quant == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": not_converted,
    }


@pytest.mark.parametrize("shape_name", SHAPES)
def test_fp8_dequantizes_to_the_bf16_weights_within_e4m3_error(tiny_checkpoint, shape_name):
    shape = SHAPES[shape_name]
    bf16 = read_checkpoint(tiny_checkpoint(shape, "bf16"))
    fp8 = read_checkpoint(tiny_checkpoint(shape, "fp8"))
    for name, source in bf16.items():
        if name not in fp8 or fp8[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(fp8[name], source), name
            continue
        scale = fp8[name.replace(".weight", ".weight_scale_inv")]
        per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        restored = fp8[name].float() * per_element
        exact = source.float()
        # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, and an
        # absolute step of 2^-9 (in scale units) at the bottom of the range.
        bound = exact.abs() / 16 + per_element * 2.0**-9
        assert bool(((restored - exact).abs() <= bound).all()), name
        assert (restored - exact).abs().mean() < 0.03 * exact.abs().mean(), name


@pytest.mark.parametrize("shape_name", SHAPES)
def test_routers_spread_tokens_over_every_expert(tiny_checkpoint, shape_name):
    shape = SHAPES[shape_name]
    tensors = read_checkpoint(tiny_checkpoint(shape, "bf16"))
    tokens = tensors["model.embed_tokens.weight"].float()
    tokens = tokens / tokens.pow(2).mean(dim=1, keepdim=True).sqrt()  # what a router sees after RMSNorm
    for layer in range(shape.layers):
        logits = tokens @ tensors[f"model.layers.{layer}.mlp.gate.weight"].float().T
        chosen = logits.topk(shape.top_k, dim=1).indices.flatten()
        counts = torch.bincount(chosen, minlength=shape.experts).float()
        assert bool((counts > 0).all()) and counts.max() < 2 * counts.mean(), counts.tolist()
        assert logits.std() > 1.0  # routing decided by clear margins, not ties


@pytest.mark.parametrize(
    ("shape_name", "scale_dtype"), [("preset", "float32"), ("wide", "float32"), ("wide", "bfloat16")]
)
def test_block_scales_map_each_128x128_block_max_to_448(tiny_checkpoint, shape_name, scale_dtype):
    shape = SHAPES[shape_name]
    source = read_checkpoint(tiny_checkpoint(shape, "bf16"))
    fp8 = read_checkpoint(tiny_checkpoint(shape, "fp8", scale_dtype=scale_dtype))
    checked = 0
    for name, weight in fp8.items():
        if weight.dtype != torch.float8_e4m3fn:
            continue
        scale = fp8[name.replace(".weight", ".weight_scale_inv")]
        rows, cols = weight.shape
        assert scale.dtype == getattr(torch, scale_dtype) and scale.shape == (rows // 128, cols // 128)
        blocks = weight.float().reshape(rows // 128, 128, cols // 128, 128)
        assert bool((blocks.abs().amax(dim=3).amax(dim=1) == 448.0).all()), name
        amax = source[name].float().reshape(rows // 128, 128, cols // 128, 128).abs().amax(dim=3).amax(dim=1)
        torch.testing.assert_close(scale.float(), amax / 448.0, rtol=2.0**-8, atol=0.0)
        checked += 1
    assert checked == shape.layers * (4 + 3 * shape.experts)


def test_several_shards_index_every_tensor_once_and_keep_scales_with_weights(tiny_checkpoint):
    limit = 256 << 10
    path = tiny_checkpoint(SHAPES["wide"], "fp8", shard_bytes=limit)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 5
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    tensors = read_checkpoint(path)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in tensors:
        if name.endswith("weight_scale_inv"):
            assert index["weight_map"][name] == index["weight_map"][name.replace("_scale_inv", "")]
    for shard in shards:
        in_shard = [t for n, t in tensors.items() if index["weight_map"][n] == shard]
        size = sum(t.numel() * t.element_size() for t in in_shard)
        assert size <= limit or len(in_shard) == 1, shard


@pytest.mark.parametrize("shape_name", SHAPES)
def test_tokenizer_fills_the_vocab_and_speaks_chatml(tiny_checkpoint, shape_name):
    from transformers import AutoTokenizer

    shape = SHAPES[shape_name]
    path = tiny_checkpoint(shape, "bf16")
    tok = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    assert len(tok) == shape.vocab
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        shape.vocab - 3,
        shape.vocab - 2,
        shape.vocab - 1,
    ]
    assert tok.eos_token == "<|im_end|>" and config["eos_token_id"] == tok.eos_token_id
    assert tok.eos_token_id in generation["eos_token_id"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("Plain words, 42 of them!")["input_ids"]
    assert tok.decode(ids) == "Plain words, 42 of them!" and len(ids) < len("Plain words, 42 of them!")


def test_rerun_is_a_no_op_and_a_different_request_needs_force(tmp_path):
    out = tmp_path / "ckpt"
    tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=0)
    shard = out / "model-00001-of-00001.safetensors"
    inode = shard.stat().st_ino
    assert tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=0) == out.absolute()
    assert shard.stat().st_ino == inode
    with pytest.raises(tiny.CheckpointExistsError, match="seed 0 != 1"):
        tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=1)
    tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=1, force=True)
    assert json.loads((out / tiny.MANIFEST).read_text())["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _cut(path):
    path.write_bytes(path.read_bytes()[:-100])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, caught_by_sizes", [(_cut, True), (_flip, False), (lambda p: p.unlink(), True)])
def test_damaged_checkpoint_is_made_again_not_refused(tmp_path, damage, caught_by_sizes):
    out = tiny.make_tiny_moe(tmp_path / "ckpt", SHAPES["wide"], "bf16", seed=0)
    shard = out / "model-00001-of-00001.safetensors"
    whole = shard.read_bytes()
    damage(shard)
    assert tiny.is_complete(out) is not caught_by_sizes and not tiny.is_complete(out, hashes=True)
    lines = []
    assert tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=0, log=lines.append) == out.absolute()
    assert shard.read_bytes() == whole and tiny.is_complete(out, hashes=True)
    assert "making it again" in lines[0] and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_different_checkpoint_says_what_fixes_it(tmp_path):
    out = tiny.make_tiny_moe(tmp_path / "ckpt", SHAPES["wide"], "bf16", seed=0)
    with pytest.raises(tiny.CheckpointExistsError, match="delete it, or replace it with --force"):
        tiny.make_tiny_moe(out, SHAPES["wide"], "bf16", seed=1)


def test_interrupted_build_leaves_no_out(tmp_path, monkeypatch):
    made = []
    real = tiny.tensors.materialize

    def interrupted_after_ten(*args):
        if len(made) == 10:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of the shards
        made.append(args[0])
        yield from real(*args)

    monkeypatch.setattr(tiny.tensors, "materialize", interrupted_after_ten)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny_moe(tmp_path / "ckpt", SHAPES["wide"], "fp8", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_killed_build_leaves_no_out_and_the_next_build_cleans_up(tmp_path):
    out = tmp_path / "ckpt"
    # Kill -9 the builder right after its shards are written, before it can clean up.
    killer = (
        "import sys, os, signal; import bigmoe.model.tinymoe.make as m, bigmoe.model.tinymoe.checkpoint_dir as d\n"
        "d.write_json = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"m.main([{str(out)!r}, '--layers', '2', '--experts', '4', '--top-k', '2', '--hidden', '128',"
        " '--moe-intermediate', '128', '--vocab', '1024', '--dtype', 'bf16', '--seed', '0', '--no-tokenizer'])\n"
    )
    run = subprocess.run([sys.executable, "-c", killer], capture_output=True, timeout=120)
    assert run.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert not out.exists() and len(leftovers) == 1 and leftovers[0].startswith(".ckpt.partial.")
    shape = TinyShape(layers=2, experts=4, top_k=2, hidden=128, moe_intermediate=128, vocab=1024)
    tiny.make_tiny_moe(out, shape, "bf16", seed=0, with_tokenizer=False)
    assert tiny.is_complete(out) and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_command_line_matches_the_api(tiny_checkpoint, tmp_path):
    shape = SHAPES["wide"]
    out = tmp_path / "cli"
    argv = [
        sys.executable,
        str(SCRIPTS / "make_tiny_moe.py"),
        str(out),
        "--layers",
        str(shape.layers),
        "--experts",
        str(shape.experts),
        "--top-k",
        str(shape.top_k),
        "--hidden",
        str(shape.hidden),
        "--moe-intermediate",
        str(shape.moe_intermediate),
        "--dtype",
        "fp8",
        "--seed",
        "0",
        "--vocab",
        str(shape.vocab),
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "128",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert str(out) in run.stdout
    assert file_bytes(out) == file_bytes(tiny_checkpoint(shape, "fp8", seed=0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "fp8", "--hidden", "96"], "fp8 needs sizes divisible by 128 (the block size), but hidden=96"),
        (["--dtype", "fp8", "--moe-intermediate", "64"], "moe_intermediate=64"),
        (["--experts", "4", "--top-k", "8"], "top_k=8 exceeds experts=4"),
        (["--heads", "3", "--kv-heads", "2"], "heads=3 is not a multiple of kv_heads=2"),
        (["--layers", "0"], "layers must be a positive integer"),
        (["--seed", "-1"], "seed must be a non-negative integer"),
        (["--vocab", "100"], "vocab=100 is too small"),
        (["--shard-size", "lots"], "is not a size"),
        (["--dtype", "fp4"], "invalid choice"),
    ],
)
def test_bad_sizes_give_one_clear_line(tmp_path, capsys, args, message):
    try:
        code = tiny.main([str(tmp_path / "ckpt"), *args])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("make_tiny_moe.py: error: ") and message in err
    assert list(tmp_path.iterdir()) == []


def test_preset_numbers_are_the_default_checkpoint(tiny_checkpoint):
    arch = tomllib.loads((REPO / "presets" / "tiny-moe.toml").read_text())["arch"]
    shape = TinyShape()
    sizes = {}
    for dtype in ("bf16", "fp8"):
        tensors = read_checkpoint(tiny_checkpoint(shape, dtype))
        nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        expert = sum(b for n, b in nbytes.items() if n.startswith("model.layers.0.mlp.experts.0."))
        experts = sum(b for n, b in nbytes.items() if ".mlp.experts." in n)
        sizes[dtype] = (expert, sum(nbytes.values()) - experts)
    assert (
        arch["moe_layers"],
        arch["experts"],
        arch["top_k"],
        arch["hidden"],
        arch["moe_intermediate"],
        arch["vocab"],
        arch["shared_experts"],
    ) == (shape.layers, shape.experts, shape.top_k, shape.hidden, shape.moe_intermediate, shape.vocab, 0)
    assert arch["expert_bytes_bf16"] == sizes["bf16"][0]
    assert arch["expert_bytes_fp8"] == sizes["fp8"][0]
    assert arch["dense_bytes"] == sizes["bf16"][1]
    config = json.loads((tiny_checkpoint(shape, "bf16") / "config.json").read_text())
    kv = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    assert arch["kv_bytes_per_token"] == kv == shape.kv_bytes_per_token()
    assert arch["max_context"] <= config["max_position_embeddings"]


def test_cuda_build_is_refused_clearly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present; tests/gpu covers --device cuda")
    with pytest.raises(tiny.DeviceError, match="no CUDA GPU"):
        tiny.make_tiny_moe(tmp_path / "ckpt", TinyShape(), "bf16", 0, device="cuda")
    assert list(tmp_path.iterdir()) == []
