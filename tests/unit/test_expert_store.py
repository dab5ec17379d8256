"""CheckpointStore: experts gathered from safetensors byte ranges, exact under concurrency; bad checkpoints refused."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bigmoe_pager.core.expert_store import CheckpointStore, ExpertStore
from bigmoe_pager.core.odirect import ReadError, aligned_empty
from bigmoe_pager.core.safetensors_index import CheckpointError
from safetensors.torch import save_file
from ssd_testkit import SHAPES, FakeFaultyIO, make_checkpoint, synth_experts

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{request.param}"), request.param)


def test_store_finds_moe_layers_and_experts(ckpt):
    with ckpt.store() as store:
        assert isinstance(store, ExpertStore)
        assert store.model_layers == [ckpt.first_layer + i for i in range(ckpt.num_layers)]
        assert (store.num_layers, store.num_experts, store.codec) == (ckpt.num_layers, ckpt.num_experts, "raw")


def test_every_expert_reads_back_exactly(ckpt):
    with ckpt.store() as store:
        buf = aligned_empty(ckpt.layout.pitch)
        for layer in range(ckpt.num_layers):
            for expert in range(ckpt.num_experts):
                buf.fill_(0xAB)  # padding between components must come back zeroed, not as stale bytes
                n = store.read(layer, expert, buf)
                assert n == ckpt.layout.record_bytes
                assert torch.equal(buf[:n], ckpt.reference(layer, expert))


def test_concurrent_reads_from_many_threads_are_exact(ckpt):
    keys = [(l, e) for l in range(ckpt.num_layers) for e in range(ckpt.num_experts)] * 4
    refs = {k: ckpt.reference(*k) for k in set(keys)}

    def read(key):
        buf = aligned_empty(ckpt.layout.pitch)
        store.read(*key, buf)
        return torch.equal(buf[: ckpt.layout.record_bytes], refs[key])

    with ckpt.store() as store, ThreadPoolExecutor(16) as pool:
        assert all(pool.map(read, keys))
        assert store.counters.snapshot()["errors"] == 0


def test_read_error_names_file_and_offset(ckpt):
    with ckpt.store(io=FakeFaultyIO(then="eio"), retries=1) as store:
        with pytest.raises(ReadError, match=r"model-0000\d-of-00002\.safetensors failed: EIO"):
            store.read(0, 0, aligned_empty(ckpt.layout.pitch))
        assert "expert 0" in store.describe(0, 0)


def test_out_of_range_expert_is_an_index_error(ckpt):
    with ckpt.store() as store, pytest.raises(IndexError, match="outside"):
        store.read(0, ckpt.num_experts, aligned_empty(ckpt.layout.pitch))


def test_missing_tensors_are_listed(tmp_path):
    ck = make_checkpoint(tmp_path, "bf16", num_layers=1, num_experts=3, shards=1)
    shape = SHAPES["bf16"]
    # a second checkpoint that lacks expert 2's up_proj
    other = tmp_path / "broken"
    other.mkdir()
    tensors = {}
    gen = torch.Generator().manual_seed(1)
    for e in range(3):
        for suffix, t in synth_experts.expert_tensors(shape["hidden"], shape["intermediate"], False, gen).items():
            if not (e == 2 and suffix.startswith("up_proj")):
                tensors[f"model.layers.1.mlp.experts.{e}.{suffix}"] = t
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"1 expert tensors missing, e\.g\. model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"
    ):
        CheckpointStore(other, ck.layout)


def test_layout_mismatch_names_tensor_and_shapes(tmp_path):
    ck = make_checkpoint(tmp_path, "fp8", num_layers=1, num_experts=2, shards=1)
    wrong = synth_experts.make_layout(SHAPES["fp8"]["hidden"] * 2, SHAPES["fp8"]["intermediate"], True)
    with pytest.raises(
        CheckpointError,
        match=r"gate_proj\.weight is float8_e4m3fn\[128, 256\] but the expert layout wants float8_e4m3fn\[128, 512\]",
    ):
        CheckpointStore(ck.root, wrong)


def test_scale_rows_that_cannot_split_into_gate_and_up_are_refused(tmp_path):
    ck = make_checkpoint(tmp_path, "fp8", num_layers=1, num_experts=1, shards=1)
    odd = synth_experts.make_layout(256, 64, True)  # 2*64 rows = one 128-block: gate and up share a scale row
    with pytest.raises(CheckpointError, match="multiple of the block"):
        CheckpointStore(ck.root, odd)


def test_truncated_shard_is_refused_at_open(tmp_path):
    ck = make_checkpoint(tmp_path, "bf16", num_layers=1, num_experts=4, shards=1)
    shard = next(ck.root.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated download"):
        ck.store()


@pytest.mark.parametrize(
    "content,words",
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
        (struct.pack("<Q", 5) + b"{notj", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_not_safetensors_is_refused(tmp_path, content, words):
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=words):
        CheckpointStore(tmp_path, synth_experts.make_layout(128, 64, False))


def test_header_with_inconsistent_byte_range_is_refused(tmp_path):
    header = json.dumps(
        {"model.layers.0.mlp.experts.0.gate_proj.weight": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 10]}}
    ).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))
    with pytest.raises(CheckpointError, match="spans 10 bytes but BF16\\[4, 4\\] needs 32"):
        CheckpointStore(tmp_path, synth_experts.make_layout(128, 64, False))


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        CheckpointStore(tmp_path, synth_experts.make_layout(128, 64, False))


def test_reads_the_tiny_moe_checkpoint_exactly(tiny_checkpoint):
    """The synthetic Qwen3-MoE checkpoint the e2e tests serve (sharded, with dense weights) reads back exactly."""
    from bigmoe_pager.core.paging_build import layout_for_checkpoint

    root = tiny_checkpoint(dtype="fp8")
    layout = layout_for_checkpoint(root)
    with CheckpointStore(root, layout) as store:
        buf = aligned_empty(layout.pitch)
        for layer in range(store.num_layers):
            for expert in range(store.num_experts):
                n = store.read(layer, expert, buf)
                ref = synth_experts.reference_record(root, layout, store.model_layers[layer], expert)
                assert torch.equal(buf[:n], ref[:n]), (layer, expert)


QWEN4EXP = "model.language_model.layers.{layer}.mlp.experts.{expert}."
MTP = "mtp.layers.{layer}.mlp.experts.{expert}."


@pytest.mark.parametrize("main", [synth_experts.DEFAULT_PREFIX, QWEN4EXP])
def test_qwen4exp_and_mtp_names_read_back_exactly(tmp_path, main):
    """Main layers keep their numbers; the MTP head's layer 0 is vLLM's decoder layer num_hidden_layers."""
    shape = SHAPES["fp8"]
    root = tmp_path / "ckpt"
    synth_experts.write_checkpoint(root, shape["hidden"], shape["intermediate"], 2, 3, shards=1, prefix=main)
    gen = torch.Generator().manual_seed(7)
    mtp = {
        MTP.format(layer=0, expert=e) + suffix: t
        for e in range(3)
        for suffix, t in synth_experts.expert_tensors(shape["hidden"], shape["intermediate"], True, gen).items()
    }
    save_file(mtp, str(root / "mtp.safetensors"))
    (root / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2}}))
    layout = synth_experts.make_layout(shape["hidden"], shape["intermediate"], True)
    with CheckpointStore(root, layout) as store:
        assert store.model_layers == [0, 1, 2] and store.names.mtp_layers == (2,)
        buf = aligned_empty(layout.pitch)
        for layer, (prefix, ckpt_layer) in enumerate([(main, 0), (main, 1), (MTP, 0)]):
            for expert in range(3):
                store.read(layer, expert, buf)
                ref = synth_experts.reference_record(root, layout, ckpt_layer, expert, prefix=prefix)
                assert torch.equal(buf[: layout.record_bytes], ref[: layout.record_bytes])
    with CheckpointStore(root, layout, model_layers=[0, 1]) as main_only:
        assert main_only.num_layers == 2
