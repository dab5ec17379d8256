"""What bigmoe keeps on disk for each model, and taking it away again.

Three kinds of files belong to a model: its download (huggingface_hub's cache layout, shared with every HF
tool), the checkpoint bigmoe made for a synthetic preset, and the SSD tier's paging files (a second copy of every
expert, often the largest file on the machine), with what a build that died left of one. Logs, server records and
measured link speeds are bigmoe's own and are not a model's.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bigmoe_pager.core.paging_names import damaged_marker, partial_files

from bigmoe.errors import BigmoeError
from bigmoe.model import presets, repo_lock
from bigmoe.model.hubcache import READY_DIR, REPO_PREFIX, RepoCache, repo_id_of
from bigmoe.model.synthetic import tiny_model_path
from bigmoe.paths import paging_file_name


class StoreError(BigmoeError):
    """A model's files could not be listed or removed."""


@dataclass(frozen=True)
class Held:
    """One thing on disk that belongs to a model."""

    model: str
    """Preset name, or the Hub repo id of a download that is no preset."""
    kind: str
    """"download", "made" (a synthetic checkpoint) or "paging file"."""
    path: Path
    """The directory or file."""
    bytes: int
    """Bytes on disk."""
    state: str
    """"ready"; "partial" (a download without bigmoe's ready marker, or what a paging-file build that died left);
    "downloading" (a download another bigmoe writes now); "building" (a paging file a running build writes);
    "damaged" (a paging file a run marked so)."""
    repo_id: str | None = None
    """A download's Hub repo id (None for the other kinds)."""


def held(hub_cache: Path, paging_dir: Path) -> list[Held]:
    """Everything on disk that belongs to a model, presets first in their order, then other downloads."""
    known = [presets.load(name) for name in presets.names()]
    downloads = _downloads(hub_cache, {p.hub_id: p.name for p in known if p.hub_id})
    found: list[Held] = []
    for preset in known:
        found += [d for d in downloads if d.model == preset.name]
        for dtype in sorted({preset.dtype_cpu, preset.dtype_gpu}):  # what a plan of it names, on either device
            made = tiny_model_path(preset, dtype)
            if preset.synthetic and made.is_dir():
                found.append(Held(preset.name, "made", made, _tree_bytes(made), "ready"))
            pages = paging_dir / paging_file_name(preset.name, dtype)
            if pages.is_file():
                damaged = damaged_marker(pages).exists()
                found.append(
                    Held(preset.name, "paging file", pages, _file_bytes(pages), "damaged" if damaged else "ready")
                )
            for tmp in partial_files(pages):
                state = "building" if tmp.writing else "partial"
                found.append(Held(preset.name, "paging file", tmp.path, _file_bytes(tmp.path), state))
    names = {p.name for p in known}
    return found + [d for d in downloads if d.model not in names]


class Server(Protocol):
    """What `used_by` reads of a running server (serve.records.RunInfo has it)."""

    name: str
    model_path: str
    port: int


def writer(item: Held) -> str:
    """Who writes a download that `held` found "downloading": 'pid N (its command)', else 'another process'."""
    return repo_lock.holder(RepoCache(item.path.parent, item.repo_id))


def used_by(item: Held, servers: list[Server]) -> list[Server]:
    """The running servers that read `item`: a server of its model, or one whose checkpoint lies inside it (a
    `--model-dir` in a download's snapshot, a made model)."""
    inside = item.path.resolve()
    return [s for s in servers if s.name == item.model or inside in (p := Path(s.model_path).resolve(), *p.parents)]


def of_model(items: list[Held], model: str) -> list[Held]:
    """The items of `model` (a preset name or a Hub repo id); a StoreError names what exists when none match."""
    hub_ids = {p.hub_id: p.name for p in map(presets.load, presets.names()) if p.hub_id}
    mine = [i for i in items if i.model in (model, hub_ids.get(model))]
    if not mine:
        kept = sorted({i.model for i in items})
        raise StoreError(f"nothing is kept for {model}" + (f" (kept: {', '.join(kept)})" if kept else ""))
    return mine


def remove(items: list[Held]) -> None:
    """Delete the items: a download's whole repo folder (blobs, snapshots, refs and bigmoe's ready markers: for
    every tool that shares the hub cache, as `hf cache delete` would), a made checkpoint, a paging file with its
    damage marker. Each item is gone when this returns, or it raises StoreError naming the one that is not.
    Refused, before anything is removed, while a build writes one of them or another process downloads one; a
    download stays locked until it is gone, so a pull started meanwhile is refused rather than meeting the removal."""
    for item in items:
        if item.state == "building":
            raise StoreError(f"{item.path} is being built by a running bigmoe; stop that run first")
    with ExitStack() as held_locks:
        for item in items:
            if item.repo_id is not None:
                try:
                    held_locks.enter_context(repo_lock.exclusive(RepoCache(item.path.parent, item.repo_id)))
                except repo_lock.RepoBusy as e:
                    raise StoreError(f"{e}; wait for it to finish, or stop it, then remove it") from None
        _remove(items)


def _remove(items: list[Held]) -> None:
    for item in items:
        try:
            if item.kind == "paging file":
                item.path.unlink(missing_ok=True)
                damaged_marker(item.path).unlink(missing_ok=True)
            elif item.path.exists():
                shutil.rmtree(item.path)
        except OSError as e:
            raise StoreError(f"could not remove {item.path}: {e.strerror or e}") from e


def _downloads(hub_cache: Path, preset_of: dict[str, str]) -> list[Held]:
    """Model repos in the hub cache that are a preset's or that bigmoe pulled (they hold its ready markers), whole
    or partial (a partial one may have no snapshot yet, which huggingface_hub's cache scan reports as corrupted)."""
    found = []
    for folder in sorted(hub_cache.glob(f"{REPO_PREFIX}*")) if hub_cache.is_dir() else []:
        repo_id = repo_id_of(folder)
        ready = folder / READY_DIR
        if not folder.is_dir() or (repo_id not in preset_of and not ready.is_dir()):
            continue
        whole = any((folder / "snapshots" / m.stem).is_dir() for m in ready.glob("*.json"))
        name = preset_of.get(repo_id, repo_id)
        state = "downloading" if repo_lock.busy(RepoCache(hub_cache, repo_id)) else "ready" if whole else "partial"
        found.append(Held(name, "download", folder, _tree_bytes(folder), state, repo_id))
    return found


def _tree_bytes(path: Path) -> int:
    """Bytes on disk under `path`, each blob once (snapshot entries are links to blobs)."""
    return sum(_file_bytes(f) for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _file_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512
