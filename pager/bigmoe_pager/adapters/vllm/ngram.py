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
import logging
from pathlib import Path

from bigmoe_pager.adapters.vllm.ngram_process import NgramHookError, NgramProcess, describe, set_current
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines

NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
"""Where vLLM picks the PLE table's storage class (by module-global name)."""
REPLACED = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")
"""The storage classes PagedPLEEmbedding stands in for."""
CHECKPOINT_SHARD = ".ple_embedding.ngram_embedding.shard_"
"""Checkpoint tensors the loader must not read (the PLE table's row shards)."""


def install(settings: PagerSettings, checkpoint: list[Path] | None = None) -> None:
    """Serve every Qwen4Exp PLE table of this process from SSD.

    `checkpoint` names the safetensors files to read; default: the served model's. The plugin calls this
    once per process; a later call's settings serve the PLE layers built after it.
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
    from bigmoe_pager.adapters.vllm.ngram_layer import PagedPLEEmbedding

    set_current(NgramProcess(settings, checkpoint))
    for name in REPLACED:
        setattr(module, name, PagedPLEEmbedding)
    _skip_shards_at_load()
    log.warning(
        "bigmoe: n-gram pager enabled: PLE table read from the checkpoint (%s); needs "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=1 with cudagraph_mode PIECEWISE, or --enforce-eager",
        describe(settings),
    )


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
