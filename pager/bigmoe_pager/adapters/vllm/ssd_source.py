"""The SSD tier for the paged layers: one store per source in a process (the checkpoint or a
paging file; SsdStores, owned by the PagerProcess), seen by each layer as a RecordSource for its own experts."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from bigmoe_pager.core.expert_store import CheckpointStore
from bigmoe_pager.core.layout import ExpertLayout
from bigmoe_pager.core.odirect import ODirectError, odirect_works
from bigmoe_pager.core.paging_build import checkpoint_meta, compressed_pitch
from bigmoe_pager.core.paging_file import PagingFileError, PagingFileStore, read_meta
from bigmoe_pager.core.safetensors_index import CheckpointError
from bigmoe_pager.settings import SettingsError


class LayerSource:
    """One MoE layer's view of a store of raw records (a compressed paging file's through codec's DecodedStore):
    read_record(expert, dst) fills dst with the raw record."""

    def __init__(self, store, layer: int, layout: ExpertLayout):
        self.store, self.layer, self.layout = store, layer, layout

    def read_record(self, expert: int, dst: torch.Tensor) -> None:
        self.store.read(self.layer, expert, dst)


class SsdStores:
    """The SSD tier's stores open in this process, one per source (the checkpoint, or a paging file and codec).

    read_retries: file-level retries of a failed or short read (BIGMOE_READ_RETRIES).
    """

    def __init__(self, read_retries: int = 2) -> None:
        self.read_retries = read_retries
        self._stores: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def checkpoint_source(self, model_dir: Path, layout: ExpertLayout, decoder_layer: int, io=None) -> LayerSource:
        """The SSD tier reading the checkpoint's own byte ranges (io: a file-I/O fake for tests)."""
        key = ("checkpoint", str(model_dir), layout.signature())
        with self._lock:
            if key not in self._stores:
                try:
                    self._stores[key] = CheckpointStore(model_dir, layout, retries=self.read_retries, io=io)
                    odirect_ok(sorted(model_dir.glob("*.safetensors"))[0], io)
                except (CheckpointError, ODirectError) as e:
                    raise SettingsError(f"the SSD tier cannot read the checkpoint in place: {e}") from None
        store = self._stores[key]
        return LayerSource(store, _moe_layer(store.model_layers, decoder_layer), layout)

    def paging_file_source(
        self,
        path: Path,
        model_dir: Path,
        layout: ExpertLayout,
        decoder_layer: int,
        num_experts: int,
        compressed: bool | None,
        io=None,
    ) -> LayerSource:
        """compressed: whether its records must be codec records; None: as its header says."""
        if compressed is None:
            try:
                compressed = read_meta(path).codec != "raw"
            except PagingFileError as e:
                raise SettingsError(f"BIGMOE_PAGING_FILE: {e}") from None
        key = ("paging", str(path), layout.signature(), compressed)
        with self._lock:
            if key not in self._stores:
                opened = _open_paging_file(path, model_dir, layout, num_experts, compressed, self.read_retries, io)
                self._stores[key] = opened
        store, model_layers = self._stores[key]
        return LayerSource(store, _moe_layer(model_layers, decoder_layer), layout)


def _open_paging_file(
    path: Path, model_dir: Path, layout: ExpertLayout, num_experts: int, compressed: bool, retries: int, io=None
):
    """The store of raw records over the file, which holds every expert layer the checkpoint names (main model,
    then MTP head) as prepare wrote it, and the checkpoint's MoE decoder layers."""
    codec, version = "raw", 0
    if compressed:
        from bigmoe_pager.codec import CODEC_NAME, CODEC_VERSION

        codec, version = CODEC_NAME, CODEC_VERSION
    try:
        model_layers = CheckpointStore(model_dir, layout).model_layers
    except CheckpointError as e:
        raise SettingsError(f"BIGMOE_PAGING_FILE: {e}") from None
    expect = checkpoint_meta(model_dir, layout, len(model_layers), num_experts, codec, version)
    try:
        pitch = compressed_pitch(layout) if compressed else None
        store = PagingFileStore(path, layout, expect, pitch=pitch, retries=retries, io=io)
        odirect_ok(path, io)
    except (PagingFileError, ODirectError) as e:
        raise SettingsError(f"BIGMOE_PAGING_FILE: {e}") from None
    if compressed:
        from bigmoe_pager.codec.record_decoder import DecodedStore, record_decoder

        return DecodedStore(store, record_decoder(layout)), model_layers
    return store, model_layers


def odirect_ok(file: Path, io=None) -> None:
    """Refuse a tier whose file cannot be read with O_DIRECT (a real aligned read; io: a fake for tests)."""
    ok, why = odirect_works(file, io)
    if not ok:
        raise ODirectError(f"O_DIRECT reads fail on {file} ({why}); put it on a local SSD filesystem")


def _moe_layer(model_layers: list[int], decoder_layer: int) -> int:
    try:
        return model_layers.index(decoder_layer)
    except ValueError:
        raise SettingsError(f"the checkpoint has no experts for decoder layer {decoder_layer}") from None
