"""`bigmoe verify MODEL`: check a downloaded checkpoint again, byte for byte.

Each file of the model's commit is hashed and compared with the Hub's listing (sha256 for
LFS files, the git blob id for the rest, from huggingface_hub's `model_info`; when the Hub
cannot be reached, the hashes recorded at download), and every safetensors file is checked
against its own header. A bad file is named on one line and removed, so `bigmoe pull MODEL`
downloads it again; the exit code is then 5.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import click

from bigmoe import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.model import fetch, hubcache
from bigmoe.model.hubcache import RemoteFile, RepoCache
from bigmoe.model.shard_check import shard_problem


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


def verify(model: str, revision: str | None = None, cache_dir: str | Path | None = None) -> Verdict:
    """Check every file of the model's snapshot against the Hub's hashes and its safetensors header."""
    from huggingface_hub import constants

    repo_id, revision = fetch.resolve_model(model, revision)
    cache = RepoCache(Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve(), repo_id)
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
    bad = tuple((f, why) for f in files if (why := _problem(cache, commit, f)))
    return Verdict(repo_id, commit, cache, len(files), source, bad)


def _problem(cache: RepoCache, commit: str, f: RemoteFile) -> str | None:
    why = hubcache.check_file(cache, commit, f, lambda n: None, threading.Event())
    if why is None and f.path.endswith(".safetensors"):
        header = shard_problem(cache.pointer(commit, f))
        why = header.split(": ", 1)[-1] if header else None
    return why


@click.command("verify")
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit (default: the one downloaded).")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="huggingface_hub cache directory (default: HF_HUB_CACHE).",
)
@click.option(
    "--keep", is_flag=True, help="Leave bad files in place (default: remove them so pull fetches them again)."
)
def verify_command(model: str, revision: str | None, cache_dir: str | None, keep: bool) -> None:
    """Check a downloaded MODEL against the Hub's hashes (sha256 / git blob id) and its safetensors headers."""
    try:
        verdict = verify(model, revision, cache_dir)
    except BigmoeError as e:
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(e.exit_code)
    except ValueError as e:  # PresetError
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(exit_codes.USAGE)
    where = f"{verdict.repo_id}@{verdict.commit[:12]}"
    if not verdict.bad:
        click.echo(f"ok: {verdict.files} files of {where} match {verdict.source} and their safetensors headers")
        return
    for f, why in verdict.bad:
        click.echo(f"bad: {verdict.snapshot / f.path}: {why}")
        if not keep:
            hubcache.remove_file(verdict.cache, verdict.commit, f)
    fix = (
        f"they were removed; run: bigmoe pull {model}"
        if not keep
        else f"rerun without --keep to remove them, then: bigmoe pull {model}"
    )
    click.echo(f"bigmoe: {len(verdict.bad)} of {verdict.files} files of {where} are damaged; {fix}", err=True)
    sys.exit(fetch.EXIT_NOT_READY)
