"""The plugin's SSD tier refuses, at start-up and in one line, sources it cannot use."""

from __future__ import annotations

import pytest
from bigmoe_pager.adapters.vllm.ssd_source import SsdStores
from bigmoe_pager.core.paging_build import build_paging_file, layout_for_checkpoint
from bigmoe_pager.settings import SettingsError
from ssd_testkit import FakeFaultyIO


@pytest.fixture
def model(tiny_checkpoint):
    from bigmoe.model.tinymoe.shape import TinyShape

    return tiny_checkpoint(
        TinyShape(layers=2, experts=4, top_k=2, hidden=128, moe_intermediate=128, vocab=512),
        "bf16",
        seed=1,
        with_tokenizer=False,
    )


@pytest.fixture
def stores():
    return SsdStores()


def test_filesystem_without_odirect_is_refused_for_the_checkpoint(stores, model):
    """FakeFaultyIO stands in for a filesystem that refuses O_DIRECT (this machine's all accept it)."""
    layout = layout_for_checkpoint(model)
    with pytest.raises(SettingsError, match="O_DIRECT"):
        stores.checkpoint_source(model, layout, 0, io=FakeFaultyIO(refuse_open=True))


def test_filesystem_without_odirect_is_refused_for_a_paging_file(stores, model, tmp_path):
    layout = layout_for_checkpoint(model)
    paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=False)
    with pytest.raises(SettingsError, match="BIGMOE_PAGING_FILE: .*O_DIRECT"):
        stores.paging_file_source(paging, model, layout, 0, 4, compressed=False, io=FakeFaultyIO(refuse_open=True))


@pytest.mark.parametrize("built_compressed,asked_compressed", [(False, True), (True, False)])
def test_codec_mismatch_is_refused(stores, model, tmp_path, built_compressed, asked_compressed):
    layout = layout_for_checkpoint(model)
    paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=built_compressed)
    with pytest.raises(SettingsError, match="BIGMOE_PAGING_FILE"):
        stores.paging_file_source(paging, model, layout, 0, 4, compressed=asked_compressed)


@pytest.mark.parametrize("built_compressed", [False, True])
def test_codec_auto_reads_a_paging_file_as_it_was_written(stores, model, tmp_path, built_compressed):
    import torch

    layout = layout_for_checkpoint(model)
    paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=built_compressed)
    direct = stores.checkpoint_source(model, layout, 1)
    auto = stores.paging_file_source(paging, model, layout, 1, 4, compressed=None)
    for expert in range(4):
        a, b = torch.zeros(layout.pitch, dtype=torch.uint8), torch.ones(layout.pitch, dtype=torch.uint8)
        direct.read_record(expert, a)
        auto.read_record(expert, b)
        assert torch.equal(a[: layout.record_bytes], b[: layout.record_bytes])


def test_codec_auto_refuses_a_file_that_is_not_a_paging_file_in_one_line(stores, model, tmp_path):
    junk = tmp_path / "experts.bmpf"
    junk.write_bytes(b"not a paging file" * 100)
    with pytest.raises(SettingsError, match="BIGMOE_PAGING_FILE: .*not a bigmoe paging file"):
        stores.paging_file_source(junk, model, layout_for_checkpoint(model), 1, 4, compressed=None)


def test_layers_read_exact_records(stores, model, tmp_path):
    import torch

    layout = layout_for_checkpoint(model)
    paging = build_paging_file(model, tmp_path / "experts.bmpf", compress=True)
    direct = stores.checkpoint_source(model, layout, 1)
    paged = stores.paging_file_source(paging, model, layout, 1, 4, compressed=True)
    for expert in range(4):
        a = torch.zeros(layout.pitch, dtype=torch.uint8)
        b = torch.ones(layout.pitch, dtype=torch.uint8)
        direct.read_record(expert, a)
        paged.read_record(expert, b)
        assert torch.equal(a[: layout.record_bytes], b[: layout.record_bytes])
