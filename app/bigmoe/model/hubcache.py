"""A Hub model on disk, in huggingface_hub's cache layout: which files are whole, their
hashes against the Hub's listing, and bigmoe's ready marker.

Layout (huggingface_hub's own, so the files are shared with every other HF tool):
`<cache>/models--Org--Name/blobs/<etag>` holds the bytes (etag = LFS sha256, or the git
blob id for small files), `snapshots/<commit>/<path>` links to them, `refs/<branch>` names
a commit. bigmoe adds `bigmoe-ready/<commit>.json`, written only after every file of the
commit was checked, so a half-downloaded model is never taken for a whole one.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from bigmoe.paths import write_atomic

HASH_BLOCK = 8 << 20  # bytes read per hash update; large enough that hashlib drops the GIL
READY_DIR = "bigmoe-ready"
REPO_PREFIX = "models--"
"""huggingface_hub's cache folder of a model repo: `models--Org--Name`."""
LOCK_NAME = "bigmoe-fetch.lock"
MARKER_FORMAT = 1


class Cancelled(Exception):
    """Raised inside a worker when the caller asked to stop."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at one commit, as the Hub lists it."""

    path: str
    """Path inside the repo ('/'-separated)."""
    size: int
    """Bytes."""
    blob_id: str
    """Git blob id (sha1 of 'blob <size>\\0' + content)."""
    sha256: str | None
    """sha256 of the content for LFS files, None for files kept in git."""

    @property
    def etag(self) -> str:
        """Name of the file's blob in the cache (what the Hub sends as its ETag)."""
        return self.sha256 or self.blob_id

    @property
    def hash_kind(self) -> str:
        return "sha256" if self.sha256 else "git blob id"


@dataclass(frozen=True)
class RepoCache:
    """Where one repo's files live under a huggingface_hub cache directory."""

    root: Path
    """The hub cache directory (HF_HUB_CACHE or --cache-dir)."""
    repo_id: str
    """'Org/Name'."""

    @property
    def storage(self) -> Path:
        return self.root / (REPO_PREFIX + self.repo_id.replace("/", "--"))

    def snapshot(self, commit: str) -> Path:
        return self.storage / "snapshots" / commit

    def pointer(self, commit: str, f: RemoteFile) -> Path:
        return self.snapshot(commit).joinpath(*f.path.split("/"))

    def blob(self, f: RemoteFile) -> Path:
        return self.storage / "blobs" / f.etag

    def marker(self, commit: str) -> Path:
        return self.storage / READY_DIR / f"{commit}.json"

    def ref(self, revision: str) -> Path:
        return self.storage / "refs" / revision

    @property
    def lock(self) -> Path:
        """The lock of bigmoe's writers of this repo (model/repo_lock.py): in huggingface_hub's lock folder for
        the repo, outside the repo's own, so removing the repo leaves it in place for a waiting writer."""
        return self.root / ".locks" / self.storage.name / LOCK_NAME


def repo_id_of(folder: Path) -> str:
    """The repo id a cache folder holds ('models--Org--Name' -> 'Org/Name'): RepoCache.storage read backwards."""
    return "/".join(folder.name[len(REPO_PREFIX) :].split("--", 1))


def is_whole(cache: RepoCache, commit: str, f: RemoteFile) -> bool:
    """The file's bytes are all on disk (by size; hashes are checked by `check_file`)."""
    for path in (cache.pointer(commit, f), cache.blob(f)):
        try:
            if path.stat().st_size == f.size:
                return True
        except OSError:
            continue
    return False


def partial_files(cache: RepoCache) -> list[Path]:
    """Temporary files huggingface_hub is writing (or left behind) for this repo."""
    blobs = cache.storage / "blobs"
    try:
        return [p for p in blobs.iterdir() if p.name.endswith(".incomplete")]
    except OSError:
        return []


def stale_partials(cache: RepoCache, older_than_s: float) -> list[Path]:
    """Partial files no live download touched for `older_than_s` seconds (left by a killed run)."""
    now = time.time()
    stale = []
    for path in partial_files(cache):
        try:
            if now - path.stat().st_mtime > older_than_s:
                stale.append(path)
        except OSError:
            continue
    return stale


def remove_file(cache: RepoCache, commit: str, f: RemoteFile) -> None:
    """Delete a file's snapshot link and the blob it names, so the next run fetches it again."""
    pointer = cache.pointer(commit, f)
    targets = {cache.blob(f)}
    if pointer.is_symlink():
        targets.add(pointer.resolve())
    for path in (pointer, *targets):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def file_digest(path: Path, f: RemoteFile, on_bytes: Callable[[int], None], cancel: threading.Event) -> str:
    """The file's sha256 (LFS) or git blob id, reading it in HASH_BLOCK pieces."""
    if f.sha256 is not None:
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as stream:
        while block := stream.read(HASH_BLOCK):
            if cancel.is_set():
                raise Cancelled(f"stopped while checking {f.path}")
            h.update(block)
            on_bytes(len(block))
    return h.hexdigest()


def check_file(
    cache: RepoCache, commit: str, f: RemoteFile, on_bytes: Callable[[int], None], cancel: threading.Event
) -> str | None:
    """Why the downloaded file is not the one the Hub listed, or None when it is."""
    path = cache.pointer(commit, f)
    if not path.is_file():
        return "missing after the download"
    size = path.stat().st_size
    if size != f.size:
        return f"has {size} bytes, the hub lists {f.size}"
    got = file_digest(path, f, on_bytes, cancel)
    expected = f.sha256 or f.blob_id
    if got != expected:
        return f"{f.hash_kind} {got[:12]}... differs from the hub's {expected[:12]}..."
    return None


def write_ready(cache: RepoCache, commit: str, files: list[RemoteFile]) -> Path:
    """Record that every file of `commit` was checked (atomically: a torn marker is never read as valid)."""
    entries = []
    for f in files:
        entries.append(asdict(f) | {"mtime_ns": cache.pointer(commit, f).stat().st_mtime_ns})
    payload = {"format": MARKER_FORMAT, "repo_id": cache.repo_id, "commit": commit, "files": entries}
    marker = cache.marker(commit)
    marker.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, json.dumps(payload, indent=1).encode())
    return marker


def read_ready(cache: RepoCache, commit: str) -> list[RemoteFile] | None:
    """The files the ready marker vouches for, or None when there is no valid marker
    or any file changed on disk since it was written (size or modification time)."""
    try:
        payload = json.loads(cache.marker(commit).read_text())
        if payload.get("format") != MARKER_FORMAT or payload.get("commit") != commit:
            return None
        files = []
        for entry in payload["files"]:
            f = RemoteFile(path=entry["path"], size=entry["size"], blob_id=entry["blob_id"], sha256=entry["sha256"])
            stat = cache.pointer(commit, f).stat()
            if stat.st_size != f.size or stat.st_mtime_ns != entry["mtime_ns"]:
                return None
            files.append(f)
        return files
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorded_files(cache: RepoCache, commit: str) -> list[RemoteFile] | None:
    """The files and Hub hashes the ready marker recorded, even if files changed since (None: no marker)."""
    try:
        payload = json.loads(cache.marker(commit).read_text())
        if payload.get("format") != MARKER_FORMAT or payload.get("commit") != commit:
            return None
        return [
            RemoteFile(path=e["path"], size=e["size"], blob_id=e["blob_id"], sha256=e["sha256"])
            for e in payload["files"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_ref(cache: RepoCache, revision: str, commit: str) -> None:
    """Name `commit` as `revision` (what huggingface_hub does for branch downloads) for offline use."""
    if revision == commit:
        return
    ref = cache.ref(revision)
    ref.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(ref, commit.encode())


def read_ref(cache: RepoCache, revision: str) -> str | None:
    try:
        return cache.ref(revision).read_text().strip() or None
    except OSError:
        return None
