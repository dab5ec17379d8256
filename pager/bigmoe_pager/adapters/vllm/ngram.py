"""The n-gram pager inside vLLM: Qwen4Exp's PLE table read from the checkpoint, never loaded.

vLLM 0.32/0.33 builds the table as `Qwen4ExpPLEPinnedHostEmbedding` (the whole
table in pinned host RAM, looked up through UVA; the default) or
`Qwen4ExpPLEDeviceEmbedding` (the whole table in VRAM), picked by name inside
`vllm.models.qwen4_exp.nvidia.ngram_embedding`. `install()` binds both names to
`PagedPLEEmbedding`, whose weight is a meta tensor (no memory at all); lookups
gather the rows from the checkpoint's shard files through `NgramTable` (page
cache, or O_DIRECT plus a row cache when BIGMOE_NGRAM_CACHE_ROWS > 0). It also
makes vLLM's safetensors loader skip the shard tensors so start-up does not
read 47.7 GiB it would throw away.

On CUDA the lookup runs as vLLM's pinned path does: `start_prefetch` (before
the layer ahead of the PLE layer) sends the ids to the host and starts the
gather on a worker thread; `finalize_prefetch` waits for it and copies the rows
up. Both are eager breaks, so the step works with breakable CUDA graphs in
PIECEWISE mode or with --enforce-eager; any mode that captures full graphs
would freeze one step's rows into the graph, so it is refused at start-up.
While a breakable graph is being captured, its eager segments run once with ids
the (recorded, not run) kernels never computed: that run reads nothing and
yields zeros; every replay reads for real.
Dequantization stays vLLM's own (FP8 rows x the table's global scale).

vLLM 0.33's NVIDIA path (models/qwen4_exp/nvidia/ngram_embedding.py, ple_layer.py) keeps what
this relies on from 0.32: both storage class names looked up as module globals when the PLE
layer is built, the same constructor keywords, start_prefetch(ids) / finalize_prefetch(tokens)
called by the PLE layer, and `<prefix>.ngram_embedding.shard_<i>.weight` row shards. It adds
NVFP4 tables (rows plus `weight_scale` shards), which are refused with one line, and its
eager-break decorator always wraps (0.32's wraps only when VLLM_USE_BREAKABLE_CUDAGRAPH was
set at import), reading the variable per call as graph_mode() does.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Iterable

import torch
from bigmoe_pager.ngram.dequant import STORED
from bigmoe_pager.ngram.errors import NgramError, NgramFileError, NgramLayoutError
from bigmoe_pager.ngram.prefetch import RowPrefetcher
from bigmoe_pager.ngram.shards import SHARD_NAME, list_tables
from bigmoe_pager.ngram.spec import TableSpec
from bigmoe_pager.ngram.table import NgramTable
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines

NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
"""Where vLLM picks the PLE table's storage class (by module-global name)."""
REPLACED = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")
"""The storage classes PagedPLEEmbedding stands in for."""
CHECKPOINT_SHARD = ".ple_embedding.ngram_embedding.shard_"
"""Checkpoint tensors the loader must not read (the PLE table's row shards)."""


class NgramHookError(NgramError):
    """vLLM or its configuration cannot host the n-gram pager; the message says what to change."""


def install(settings: PagerSettings, checkpoint: list[Path] | None = None) -> None:
    """Serve every Qwen4Exp PLE table of this process from SSD (idempotent).

    `checkpoint` names the safetensors files to read; default: the served model's.
    """
    try:
        module = importlib.import_module(NGRAM_MODULE)
    except ImportError as e:
        raise NgramHookError(
            f"bigmoe n-gram pager: this vLLM has no Qwen4Exp n-gram embedding ({e}); set BIGMOE_NGRAM=0"
        ) from None
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        raise NgramHookError(
            "bigmoe n-gram pager supports vLLM's NVIDIA/CPU Qwen4Exp path only; set BIGMOE_NGRAM=0 on ROCm"
        )
    paged = paged_class(settings, module, checkpoint)
    for name in REPLACED:
        setattr(module, name, paged)
    _skip_shards_at_load()
    log.warning(
        "bigmoe: n-gram pager enabled: PLE table read from the checkpoint (%s); needs "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode PIECEWISE, or --enforce-eager",
        describe(settings),
    )


def describe(settings: PagerSettings) -> str:
    if settings.ngram_cache_rows:
        return f"O_DIRECT reads, row cache of {settings.ngram_cache_rows} rows"
    return "page-cache reads"


def paged_class(settings: PagerSettings, module, checkpoint: list[Path] | None = None) -> type:
    """PagedPLEEmbedding built on this vLLM's Qwen4ExpPLEEmbedding."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture
    from vllm.config import get_current_vllm_config

    fp8_method = module.Qwen4ExpPLEFp8EmbeddingMethod
    plain_method = module.Qwen4ExpPLEUnquantizedEmbeddingMethod

    class PagedPLEEmbedding(module.Qwen4ExpPLEEmbedding):
        """The PLE table left in the checkpoint; rows gathered from SSD per step."""

        supports_prefetch = False

        def __init__(
            self,
            num_embeddings,
            embedding_dim,
            *,
            params_dtype,
            padding_size,
            prefix,
            embedding_method,
            num_ngram_heads=1,
            max_total_tokens=0,
            data_parallel_rank=0,
            reduce_results=True,
        ):
            super().__init__(
                num_embeddings,
                embedding_dim,
                params_dtype=params_dtype,
                padding_size=padding_size,
                prefix=prefix,
                embedding_method=embedding_method,
                num_ngram_heads=num_ngram_heads,
                max_total_tokens=max_total_tokens,
                data_parallel_rank=data_parallel_rank,
                reduce_results=reduce_results,
            )
            if self.tp_size != 1:
                raise NgramHookError(
                    f"bigmoe n-gram pager serves one unsharded table; the PLE table here is split {self.tp_size} ways "
                    "(TP/ETP); set BIGMOE_NGRAM=0"
                )
            vllm_config = get_current_vllm_config()
            self._stored = stored_dtype(embedding_method, params_dtype, fp8_method, plain_method)
            self._spec = TableSpec(
                rows=self.org_vocab_size,
                row_elems=embedding_dim,
                dtype=self._stored,
                parts=split_parts(vllm_config),
                heads=num_ngram_heads,
            )
            self._heads = num_ngram_heads
            self._max_ids = max(1, max_total_tokens) * num_ngram_heads
            self._vllm_config = vllm_config
            self._pager: RowPrefetcher | None = None
            cuda = torch.cuda.is_available()
            self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            mode = graph_mode(vllm_config)
            if mode.startswith("breakable") and not hasattr(type(self).start_prefetch, "__wrapped__"):
                # vLLM 0.32 decides at class definition (plugin load) whether eager breaks exist; 0.33 always wraps.
                raise NgramHookError(
                    "bigmoe n-gram pager: set VLLM_USE_BREAKABLE_CUDAGRAPH=1 in the environment before "
                    "vLLM starts (this vLLM reads it when the plugin loads)"
                )
            self.supports_prefetch = cuda
            log.warning(
                "bigmoe: PLE table %s (%d rows x %d B) stays on SSD; %s",
                prefix,
                self._spec.rows,
                self._spec.row_bytes,
                mode,
            )

        def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
            return torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")  # never materialized

        def weight_loader(self, param, loaded_weight, checkpoint_start=None):
            if checkpoint_start is not None:
                return  # a row shard: its rows are read from the file when a step needs them
            if param is self.weight:
                raise NgramLayoutError(
                    f"{self.prefix}: checkpoint stores the PLE table unsharded; "
                    "the n-gram pager reads shard_<i> tensors only; set BIGMOE_NGRAM=0"
                )
            super().weight_loader(param, loaded_weight)

        def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
            """Rows of ngram_ids [tokens, heads] as the stored dtype [tokens, heads, row_elems], synchronously."""
            return self._rows().lookup(ngram_ids).view(STORED[self._stored])

        @eager_break_during_capture
        def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
            # While a graph is being captured its kernels are recorded, not run: these ids were never
            # computed. Replays call this segment again with real ids.
            if BreakableCUDAGraphCapture.current() is not None:
                return
            self._rows().start(ngram_ids)

        def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
            output = torch.empty(
                (total_tokens, self._heads * self.embedding_dim), dtype=STORED[self._stored], device=self._device
            )
            self._finish(output)
            return output

        @eager_break_during_capture
        def _finish(self, output: torch.Tensor) -> None:
            if BreakableCUDAGraphCapture.current() is not None:
                output.zero_()  # capture-time output is never used; replays fill it
                return
            self._rows().finish(output)

        def _rows(self) -> RowPrefetcher:
            """The table and its staging buffers, opened on first use (vLLM's eager profile run, before any capture)."""
            if self._pager is None:
                files = checkpoint if checkpoint is not None else model_checkpoint(self._vllm_config)
                table = open_table(settings, files, self.prefix, self._spec)
                timeout = (
                    settings.read_timeout_s * (settings.read_retries + 1) + 5.0
                )  # s; the reader's own timeouts fire first
                self._pager = RowPrefetcher(table, self._max_ids, self._device, timeout_s=timeout)
            return self._pager

    return PagedPLEEmbedding


# ---- pieces (no vLLM classes needed) -------------------------------------------------


def open_table(settings: PagerSettings, files: list[Path], prefix: str, spec: TableSpec) -> NgramTable:
    """The table of vLLM layer `prefix` in `files`, validated against `spec`, with the reader the settings pick."""
    table = match_table(prefix, list_tables(files))
    opened = NgramTable.open(
        files,
        table=table,
        spec=spec,
        direct=settings.ngram_cache_rows > 0,
        cache_rows=settings.ngram_cache_rows,
        timeout_s=settings.read_timeout_s,
        retries=settings.read_retries,
    )
    log.warning(
        "bigmoe: n-gram table %s: %d shards in %d files, %.1f GiB, %s",
        table,
        len(opened.shards.shards),
        len(opened.shards.files),
        spec.nbytes / 2**30,
        describe(settings),
    )
    return opened


def match_table(vllm_prefix: str, tables: Iterable[str]) -> str:
    """The checkpoint table of a vLLM layer prefix: same `layers.N...` tail, MTP only for MTP layers."""
    tables = sorted(tables)
    at = vllm_prefix.find("layers.")
    tail = vllm_prefix[at:] if at >= 0 else vllm_prefix
    mtp = "mtp" in vllm_prefix.split(".")
    found = [t for t in tables if (t == tail or t.endswith("." + tail)) and ("mtp" in t.split(".")) == mtp]
    if len(found) != 1:
        raise NgramLayoutError(
            f"vLLM layer {vllm_prefix} matches {len(found)} n-gram tables of the checkpoint {tables}; expected one"
        )
    return found[0]


def model_checkpoint(vllm_config) -> list[Path]:
    model_config = vllm_config.model_config
    if model_config is None:
        raise NgramHookError("bigmoe n-gram pager: vLLM has no model config; cannot find the checkpoint")
    download_dir = getattr(vllm_config.load_config, "download_dir", None)
    return checkpoint_files(model_config.model, model_config.revision, download_dir)


def checkpoint_files(model: str, revision: str | None = None, download_dir: str | None = None) -> list[Path]:
    """The safetensors files holding PLE shards (per the index, when there is one) of a local dir or cached hub id."""
    root = Path(model).expanduser()
    if not root.is_dir():
        root = _cached_snapshot(model, revision, download_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise NgramFileError(f"{index}: not a readable safetensors index ({e.__class__.__name__})") from None
        names = sorted({f for n, f in weight_map.items() if SHARD_NAME.match(n)})
        if names:
            return [root / f for f in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise NgramFileError(f"{root}: no *.safetensors files")
    return files


def graph_mode(vllm_config) -> str:
    """How the gathers run under this configuration; raises NgramHookError where they cannot."""
    if not torch.cuda.is_available():
        return "CPU: synchronous lookups"
    model_config = vllm_config.model_config
    if model_config is not None and model_config.enforce_eager:
        return "eager mode (--enforce-eager): gathers overlap the layer before the PLE layer"
    mode = vllm_config.compilation_config.cudagraph_mode
    name = getattr(mode, "name", str(mode))
    if mode is None or name == "NONE":
        return "no CUDA graphs: gathers overlap the layer before the PLE layer"
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    breakable = is_breakable_cudagraph_enabled()
    if breakable and name == "PIECEWISE":
        return "breakable CUDA graphs (PIECEWISE): gathers run as eager segments"
    raise NgramHookError(
        f"bigmoe n-gram pager needs VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode PIECEWISE, or --enforce-eager; "
        f"got cudagraph_mode {name} with breakable CUDA graphs {'on' if breakable else 'off'}"
    )


def stored_dtype(method, params_dtype: torch.dtype, fp8_method: type, plain_method: type) -> str:
    if isinstance(method, fp8_method):
        return "F8_E4M3"
    if isinstance(method, plain_method):
        names = {v: k for k, v in STORED.items()}
        if params_dtype in names:
            return names[params_dtype]
    raise NgramHookError(
        f"bigmoe n-gram pager reads FP8 or unquantized PLE tables, not {type(method).__name__}; set BIGMOE_NGRAM=0"
    )


def split_parts(vllm_config) -> int | None:
    """split_ngram_parts of the served model (vLLM's default 512 when unset); None without a model config."""
    text = getattr(vllm_config.model_config, "hf_text_config", None)
    return None if text is None else int(getattr(text, "split_ngram_parts", 512))


def _cached_snapshot(model: str, revision: str | None, download_dir: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model,
                revision=revision,
                cache_dir=download_dir,
                local_files_only=True,
                allow_patterns=["*.json", "*.safetensors"],
            )
        )
    except Exception as e:  # huggingface_hub raises many kinds; all mean "not here"
        raise NgramFileError(
            f"bigmoe n-gram pager: checkpoint {model} is not on this machine ({e.__class__.__name__}); fetch it first"
        ) from None


def _skip_shards_at_load() -> None:
    """Make vLLM's safetensors iterator skip PLE row shards before reading them."""
    from vllm.model_executor.model_loader import weight_utils

    original = weight_utils.should_skip_weight
    if getattr(original, "_bigmoe_ngram", False):
        return

    def should_skip_weight(name, local_expert_ids):
        return CHECKPOINT_SHARD in name or original(name, local_expert_ids)

    should_skip_weight._bigmoe_ngram = True
    weight_utils.should_skip_weight = should_skip_weight
