"""The one object that holds what the n-gram pager keeps in a vLLM process, and the pieces that find and open its
table in the checkpoint (none of them needs a vLLM class).

`ngram.install()` makes the NgramProcess (`set_current`); each PLE layer vLLM builds takes it (`current()`, the one
module-level reference) and asks it for its rows' prefetcher on first use.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import torch
from bigmoe_pager.ngram.errors import NgramError, NgramFileError, NgramLayoutError
from bigmoe_pager.ngram.prefetch import RowPrefetcher
from bigmoe_pager.ngram.shards import SHARD_NAME, list_tables
from bigmoe_pager.ngram.spec import TableSpec
from bigmoe_pager.ngram.table import NgramTable
from bigmoe_pager.settings import PagerSettings

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines


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


_current: NgramProcess | None = None


def set_current(process: NgramProcess) -> None:
    """Hand `process` to the PLE layers built from now on."""
    global _current
    _current = process


def current() -> NgramProcess | None:
    """The process's NgramProcess, or None when the n-gram pager was not installed here."""
    return _current


def describe(settings: PagerSettings) -> str:
    if settings.ngram_cache_rows:
        return f"O_DIRECT reads, row cache of {settings.ngram_cache_rows} rows"
    return "page-cache reads"


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
