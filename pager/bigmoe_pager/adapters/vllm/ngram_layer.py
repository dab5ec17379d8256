"""PagedPLEEmbedding: vLLM's Qwen4ExpPLEEmbedding with its table left in the checkpoint.

This module imports vLLM's Qwen4Exp n-gram module at import time, so only `ngram.install()`
imports it, after checking that module exists. That import is the plugin's load: vLLM 0.32
decides there, when `eager_break_during_capture` wraps the methods below, whether the eager
breaks exist (it reads VLLM_USE_BREAKABLE_CUDAGRAPH once); 0.33 always wraps.

The layer takes the process's NgramProcess (`ngram_process.current()`) when vLLM builds it and asks it
for its rows on first use; the rows' prefetcher is the layer's own (one per PLE table).
"""

from __future__ import annotations

import logging

import torch
from bigmoe_pager.adapters.vllm.ngram_process import NgramHookError, current
from bigmoe_pager.ngram.dequant import STORED
from bigmoe_pager.ngram.errors import NgramLayoutError
from bigmoe_pager.ngram.prefetch import RowPrefetcher
from bigmoe_pager.ngram.spec import TableSpec
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.models.qwen4_exp.nvidia import ngram_embedding

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


class PagedPLEEmbedding(ngram_embedding.Qwen4ExpPLEEmbedding):
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
        self._process = current()
        self._stored = stored_dtype(
            embedding_method,
            params_dtype,
            ngram_embedding.Qwen4ExpPLEFp8EmbeddingMethod,
            ngram_embedding.Qwen4ExpPLEUnquantizedEmbeddingMethod,
        )
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
            self._pager = self._process.prefetcher(
                self._vllm_config, self.prefix, self._spec, self._max_ids, self._device
            )
        return self._pager


# ---- what the layer reads of vLLM's configuration -------------------------------------


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
