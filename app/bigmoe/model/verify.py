"""verify: check a downloaded checkpoint again, byte for byte.

Each file of the model's commit is hashed and compared with the Hub's listing (sha256 for
LFS files, the git blob id for the rest, from huggingface_hub's `model_info`; when the Hub
cannot be reached, the hashes recorded at download), and every safetensors file is checked
against its own header.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

from bigmoe.errors import BigmoeError
from bigmoe.model import fetch, hubcache, repo_lock
from bigmoe.model.hubcache import RemoteFile, RepoCache
from bigmoe.model.shard_check import shard_problem

AFTER = "verify it once that is done"
"""What a refused verify says to do."""


class NotDownloaded(BigmoeError):
    """The model has no snapshot on disk to verify."""


@dataclass(frozen=True)
class Verdict:
    """What verify found for one model."""

    repo_id: str
    """Hub repository."""
    commit: str
    """Commit whose snapshot was checked."""
    cache: RepoCache
    """The cache holding it."""
    files: int
    """Files checked."""
    source: str
    """Where the expected hashes came from."""
    bad: tuple[tuple[RemoteFile, str], ...]
    """(file, why) for each file that failed, in listing order."""

    @property
    def snapshot(self) -> Path:
        return self.cache.snapshot(self.commit)


def verify(
    model: str, revision: str | None = None, cache_dir: str | Path | None = None, *, remove_bad: bool = False
) -> Verdict:
    """Check every file of the model's snapshot against the Hub's hashes and its safetensors header; with
    `remove_bad`, remove each bad file (so a pull fetches it again). Refused while another bigmoe writes the
    download (its files under way would read as damaged); the removal holds the repo's lock, checking each bad
    file again under it."""
    from huggingface_hub import constants

    repo_id, revision = fetch.resolve_model(model, revision)
    cache = RepoCache(Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve(), repo_id)
    if repo_lock.busy(cache):
        raise repo_lock.RepoBusy(f"{repo_lock.holder(cache)} is writing {repo_id} in {cache.root}; {AFTER}")
    verdict = _check(cache, model, revision)
    if not (remove_bad and verdict.bad):
        return verdict
    try:
        with repo_lock.exclusive(cache):
            bad = _bad(cache, verdict.commit, [f for f, _ in verdict.bad])  # a pull may have mended one meanwhile
            for f, _ in bad:
                hubcache.remove_file(cache, verdict.commit, f)
    except repo_lock.RepoBusy as e:
        raise repo_lock.RepoBusy(f"{e}; {AFTER}") from None
    return replace(verdict, bad=bad)


def _check(cache: RepoCache, model: str, revision: str) -> Verdict:
    repo_id = cache.repo_id
    commit = revision if fetch._is_commit(revision) else hubcache.read_ref(cache, revision)
    try:
        listed_commit, files = fetch.list_repo(repo_id, commit or revision)
        commit, source = commit or listed_commit, "the Hub's listing"
    except fetch.HubUnreachable:
        files = hubcache.recorded_files(cache, commit) if commit else None
        if files is None:
            raise
        source = "the hashes recorded at download (the Hub cannot be reached)"
    if not cache.snapshot(commit).is_dir():
        raise NotDownloaded(
            f"{repo_id}@{revision} is not downloaded ({cache.snapshot(commit)} does not exist); "
            f"run: bigmoe pull {model}"
        )
    return Verdict(repo_id, commit, cache, len(files), source, _bad(cache, commit, files))


def _bad(cache: RepoCache, commit: str, files: list[RemoteFile]) -> tuple[tuple[RemoteFile, str], ...]:
    return tuple((f, why) for f in files if (why := _problem(cache, commit, f)))


def _problem(cache: RepoCache, commit: str, f: RemoteFile) -> str | None:
    why = hubcache.check_file(cache, commit, f, lambda n: None, threading.Event())
    if why is None and f.path.endswith(".safetensors"):
        header = shard_problem(cache.pointer(commit, f))
        why = header.split(": ", 1)[-1] if header else None
    return why
