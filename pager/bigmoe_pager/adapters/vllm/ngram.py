"""The n-gram pager inside vLLM: Qwen4Exp's PLE table read from the checkpoint, never loaded.

vLLM 0.32/0.33 builds the table as `Qwen4ExpPLEPinnedHostEmbedding` (the whole
table in pinned host RAM, looked up through UVA; the default) or
`Qwen4ExpPLEDeviceEmbedding` (the whole table in VRAM), picked by name inside
`vllm.models.qwen4_exp.nvidia.ngram_embedding`. `install()` keeps the process's
state in one NgramProcess (settings, checkpoint files) and binds both names to
`PagedPLEEmbedding` (ngram_layer.py), whose weight is a meta tensor (no memory at
all); lookups gather the rows from the checkpoint's shard files through
`NgramTable` (page cache, or O_DIRECT plus a row cache when
BIGMOE_NGRAM_CACHE_ROWS > 0). It also
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


class NgramProcess:
    """The n-gram pager's state in one vLLM process: what `install` was given, handed to every PLE layer."""

    def __init__(self, settings: PagerSettings, checkpoint: list[Path] | None = None):
        self.settings = settings
        """Read once when the plugin loaded (reader choice, row cache, read deadline and retries)."""
        self.checkpoint = checkpoint
        """The safetensors files to read; None: the served model's (found from vLLM's config)."""

    def prefetcher(
        self, vllm_config, prefix: str, spec: TableSpec, max_ids: int, device: torch.device
    ) -> RowPrefetcher:
        """The rows of vLLM layer `prefix` (table checked against `spec`), staged `max_ids` per step for `device`."""
        files = self.checkpoint if self.checkpoint is not None else model_checkpoint(vllm_config)
        table = open_table(self.settings, files, prefix, spec)
        s = self.settings
        timeout = s.read_timeout_s * (s.read_retries + 1) + 5.0  # s; the reader's own timeouts fire first
        return RowPrefetcher(table, max_ids, device, timeout_s=timeout)


_installed: NgramProcess | None = None


def install(settings: PagerSettings, checkpoint: list[Path] | None = None) -> None:
    """Serve every Qwen4Exp PLE table of this process from SSD.

    `checkpoint` names the safetensors files to read; default: the served model's. The plugin calls this
    once per process; a later call's settings serve the PLE layers built after it.
    """
    global _installed
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
    from bigmoe_pager.adapters.vllm.ngram_layer import PagedPLEEmbedding

    _installed = NgramProcess(settings, checkpoint)
    for name in REPLACED:
        setattr(module, name, PagedPLEEmbedding)
    _skip_shards_at_load()
    log.warning(
        "bigmoe: n-gram pager enabled: PLE table read from the checkpoint (%s); needs "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode PIECEWISE, or --enforce-eager",
        describe(settings),
    )


def current() -> NgramProcess | None:
    """The process's NgramProcess, or None when the n-gram pager was not installed here."""
    return _installed


def describe(settings: PagerSettings) -> str:
    if settings.ngram_cache_rows:
        return f"O_DIRECT reads, row cache of {settings.ngram_cache_rows} rows"
    return "page-cache reads"


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
