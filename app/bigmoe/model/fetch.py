"""fetch: a model from the Hugging Face Hub, dry run first, live progress, "ready" only when whole.

`dry_run()` lists the repo at one commit (`HfApi.model_info(files_metadata=True)`) and
measures what is still missing against the free disk. `fetch()` refuses a plan that does
not fit before writing a byte, downloads with `huggingface_hub.snapshot_download` pinned to
that commit, reports progress from huggingface_hub's own progress bars (a tqdm class it
is handed), then checks every file's size and
hash (sha256 for LFS files, the git blob id for the rest) against the listing, and only
then writes the ready marker. A file that fails the check is deleted and the fetch fails.

Resume: run it again. Whole files are kept and never fetched twice. huggingface_hub 2.4
resumes a connection dropped mid-file inside the same run (a Range request from its last
10 MiB chunk, up to 5 times), but discards a partial file when the run ends, so a rerun
restarts only the files that were not whole.

The Hub is `HF_ENDPOINT` (read at each call) and the token `HF_TOKEN` (else huggingface_hub's
stored login). Plain HTTP works against any Hub-compatible server; Xet is used only when the
Hub offers it and hf_xet is installed; neither hf_xet nor hf_transfer is required.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from bigmoe import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.model import hubcache, repo_lock
from bigmoe.model.hubcache import Cancelled, RemoteFile, RepoCache
from bigmoe.paths import nearest_dir
from bigmoe.units import size_text

HEADROOM_BYTES = 1 << 30  # left free after a download: logs, the tree cache, filesystem metadata
STALE_PARTIAL_S = 600.0  # a partial file untouched this long belongs to a run that died
POLL_S = 0.5  # seconds between progress reports
BYTES_BAR = "huggingface_hub.snapshot_download"  # snapshot_download's bar of file bytes written (2.4)
SPEED_WINDOW_S = 5.0  # download speed is averaged over this many seconds
MAX_WORKERS = 8  # files downloaded at once (huggingface_hub's default)
VERIFY_WORKERS = min(4, os.cpu_count() or 1)  # files hashed at once (hashlib releases the GIL)

EXIT_NO_SPACE = exit_codes.NO_SPACE
EXIT_NOT_READY = exit_codes.NOT_READY
EXIT_NOT_FOUND = exit_codes.NOT_FOUND
EXIT_NETWORK = exit_codes.NETWORK
EXIT_CANCELLED = exit_codes.INTERRUPTED


class FetchError(BigmoeError):
    """A fetch failed; the message is one line."""


class ModelNotFound(FetchError):
    """The repo or revision does not exist, or is gated/private without a valid token."""

    exit_code = EXIT_NOT_FOUND


class HubUnreachable(FetchError):
    """The Hub could not be reached (network down, HF_HUB_OFFLINE, wrong HF_ENDPOINT)."""

    exit_code = EXIT_NETWORK


class DownloadFailed(FetchError):
    """The download broke off (connection lost, server error); whole files are kept."""

    exit_code = EXIT_NETWORK


class DiskTooSmall(FetchError):
    """The files still to download do not fit in the free space."""

    exit_code = EXIT_NO_SPACE


class NotReady(FetchError):
    """A downloaded file differs from the Hub's listing; it was removed."""

    exit_code = EXIT_NOT_READY


class FetchCancelled(FetchError):
    """The caller stopped the fetch."""

    exit_code = EXIT_CANCELLED


@dataclass(frozen=True)
class FetchPlan:
    """What a fetch will do, measured before any byte is written."""

    repo_id: str
    """'Org/Name' on the Hub."""
    revision: str
    """The revision asked for (branch, tag or commit)."""
    commit: str
    """The commit the revision named when listed; the fetch is pinned to it."""
    endpoint: str
    """The Hub's URL (HF_ENDPOINT or huggingface.co)."""
    cache_dir: Path
    """The huggingface_hub cache directory the files go to."""
    files: tuple[RemoteFile, ...]
    """Every file of the commit."""
    missing: tuple[str, ...]
    """Paths of the files not yet whole on disk."""
    bytes_total: int
    """Bytes of all files."""
    bytes_to_download: int
    """Bytes of the missing files."""
    free_bytes: int
    """Free bytes on the cache directory's filesystem."""
    reclaimable_bytes: int
    """Bytes of partial files left by dead runs (deleted before downloading)."""
    headroom_bytes: int
    """Bytes that must stay free after the download."""
    ready: bool
    """Every file was already checked and is unchanged (nothing to do)."""
    offline: bool
    """The Hub was unreachable; the plan comes from the ready marker."""

    @property
    def snapshot_dir(self) -> Path:
        """The model directory to serve (config.json, safetensors...) once ready."""
        return RepoCache(self.cache_dir, self.repo_id).snapshot(self.commit)

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0

    @property
    def shortfall_bytes(self) -> int:
        """Bytes of disk missing for this download (0 when it fits)."""
        need = self.bytes_to_download + self.headroom_bytes if self.bytes_to_download else 0
        return max(0, need - self.free_bytes - self.reclaimable_bytes)

    def summary(self) -> dict:
        """Plain fields for JSON output and progress events."""
        return {
            "repo": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "path": str(self.snapshot_dir),
            "files": len(self.files),
            "files_missing": len(self.missing),
            "bytes_total": self.bytes_total,
            "bytes_to_download": self.bytes_to_download,
            "free_bytes": self.free_bytes,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "ready": self.ready,
            "offline": self.offline,
        }


@dataclass
class FetchProgress:
    """One progress report; `fetch` sends one every POLL_S seconds and at each phase's end."""

    phase: str
    """'download', 'verify' (hashing what was downloaded) or 'ready'."""
    files_done: int
    """Files whole on disk (download) or checked (verify)."""
    files_total: int
    """Files in the model."""
    bytes_done: int
    """Bytes of whole files plus bytes written so far (download), or bytes hashed (verify)."""
    bytes_total: int
    """Bytes of the model."""
    speed_bps: float
    """Bytes per second over the last SPEED_WINDOW_S seconds."""
    eta_s: float | None
    """Seconds left at that speed; None while unknown."""
    elapsed_s: float
    """Seconds since this phase began."""

    def as_dict(self) -> dict:
        return asdict(self)


ProgressFn = Callable[[FetchProgress], None]
FreeSpaceFn = Callable[[Path], int]


def resolve_model(preset_or_repo: str, revision: str | None) -> tuple[str, str]:
    """(repo id, revision) from 'Org/Name' or a preset name / preset TOML path."""
    if "/" in preset_or_repo and not preset_or_repo.endswith(".toml"):
        return preset_or_repo.strip("/"), revision or "main"
    from bigmoe.model import presets

    preset = presets.load(preset_or_repo)
    if preset.synthetic or not preset.hub_id:
        raise FetchError(
            f"{preset.name} is made on this machine (bigmoe run {preset.name}); there is nothing to download"
        )
    return preset.hub_id, revision or preset.revision or "main"


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it only once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or constants.ENDPOINT


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once it is created)."""
    return shutil.disk_usage(nearest_dir(path)).free


def dry_run(
    preset_or_repo: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    *,
    free_space: FreeSpaceFn | None = None,
    headroom_bytes: int = HEADROOM_BYTES,
) -> FetchPlan:
    """List the repo and measure what is missing and whether it fits. Writes nothing."""
    from huggingface_hub import constants

    repo_id, revision = resolve_model(preset_or_repo, revision)
    cache = RepoCache(Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve(), repo_id)
    endpoint = hub_endpoint()
    try:
        commit, files = _list_repo(repo_id, revision, endpoint)
        offline = False
    except HubUnreachable:
        commit = revision if _is_commit(revision) else hubcache.read_ref(cache, revision)
        files = hubcache.read_ready(cache, commit) if commit else None
        if files is None:
            raise
        offline = True
    return _measure(cache, revision, commit, endpoint, files, offline, free_space or free_bytes, headroom_bytes)


def is_ready(plan: FetchPlan) -> bool:
    """Every file of the plan's commit was checked and is unchanged on disk."""
    vouched = hubcache.read_ready(RepoCache(plan.cache_dir, plan.repo_id), plan.commit)
    return vouched is not None and set(vouched) == set(plan.files)


def fetch(
    plan: FetchPlan,
    progress: ProgressFn | None = None,
    *,
    cancel: threading.Event | None = None,
    free_space: FreeSpaceFn | None = None,
    poll_s: float = POLL_S,
) -> Path:
    """Download what the plan lacks, check every file, mark the model ready; return its directory.

    `progress` is called on the caller's thread. Setting `cancel` (from any thread) stops
    the download within one 10 MiB chunk and raises FetchCancelled. Ctrl-C, or an exception
    raised by `progress`, stops the download the same way and then propagates.
    """
    emit = progress or (lambda p: None)
    cache = RepoCache(plan.cache_dir, plan.repo_id)
    files = list(plan.files)
    if is_ready(plan):
        emit(_final(files))
        return plan.snapshot_dir
    if plan.offline:
        raise HubUnreachable(f"cannot reach {plan.endpoint} and {plan.repo_id} is not complete on disk")
    _refuse_unless_fits(plan, cache, free_space or free_bytes)  # before the lock file: a refusal writes nothing
    try:
        with repo_lock.exclusive(cache):
            return _fetch_alone(plan, cache, emit, cancel or threading.Event(), poll_s)
    except repo_lock.RepoBusy as e:
        raise repo_lock.RepoBusy(f"{e}; wait for it to finish, or stop it, then run this again") from None


def _fetch_alone(plan: FetchPlan, cache: RepoCache, emit: ProgressFn, cancel: threading.Event, poll_s: float) -> Path:
    """fetch's work, while this process holds the repo's lock."""
    files = list(plan.files)
    _discard_broken(cache, plan.commit, files)
    tally = _Tally(whole_bytes=sum(f.size for f in files if hubcache.is_whole(cache, plan.commit, f)))
    _run_with_progress(
        lambda: _download(plan, _hub_bar(tally, cancel)), "download", files, emit, cancel, poll_s, tally.read
    )
    hubcache.write_ref(cache, plan.revision, plan.commit)
    _verify(cache, plan.commit, files, emit, cancel, poll_s)
    hubcache.write_ready(cache, plan.commit, files)
    emit(_final(files))
    return plan.snapshot_dir


# -- the Hub -------------------------------------------------------------------


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _is_commit(revision: str) -> bool:
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def list_repo(repo_id: str, revision: str) -> tuple[str, list[RemoteFile]]:
    """(commit, files with sizes and hashes) of repo_id@revision as the Hub (HF_ENDPOINT) lists them."""
    return _list_repo(repo_id, revision, hub_endpoint())


def _list_repo(repo_id: str, revision: str, endpoint: str) -> tuple[str, list[RemoteFile]]:
    from huggingface_hub import HfApi

    with _hub_errors(repo_id, revision, endpoint, "listing"):
        info = HfApi(endpoint=endpoint, token=_token()).model_info(repo_id, revision=revision, files_metadata=True)
    if not info.sha or info.siblings is None:
        raise FetchError(f"{endpoint} listed {repo_id}@{revision} without a commit or files; is HF_ENDPOINT a Hub?")
    files = []
    for s in info.siblings:
        if s.size is None or s.blob_id is None:
            raise FetchError(f"{endpoint} listed {s.rfilename} without its size; is HF_ENDPOINT a Hub?")
        files.append(
            RemoteFile(path=s.rfilename, size=s.size, blob_id=s.blob_id, sha256=s.lfs.sha256 if s.lfs else None)
        )
    return info.sha, files


def _download(plan: FetchPlan, bar_class: type) -> None:
    from huggingface_hub import snapshot_download

    with _hub_errors(plan.repo_id, plan.revision, plan.endpoint, "download"):
        snapshot_download(
            plan.repo_id,
            revision=plan.commit,
            cache_dir=plan.cache_dir,
            endpoint=plan.endpoint,
            token=_token(),
            max_workers=MAX_WORKERS,
            tqdm_class=bar_class,
        )


@contextmanager
def _hub_errors(repo_id: str, revision: str, endpoint: str, during: str) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions, as one-line bigmoe errors."""
    import httpx2
    from huggingface_hub import errors as hf

    try:
        yield
    except Cancelled as e:
        raise FetchCancelled(f"{repo_id}: {e}") from e
    except hf.GatedRepoError as e:
        raise ModelNotFound(
            f"{repo_id} on {endpoint} is gated or private and the token was refused: "
            "accept its terms on the Hub, then set HF_TOKEN"
        ) from e
    except hf.RevisionNotFoundError as e:
        raise ModelNotFound(f"{repo_id} has no revision {revision!r} on {endpoint}") from e
    except hf.RepositoryNotFoundError as e:
        raise ModelNotFound(f"{repo_id} was not found on {endpoint} (if it is private, set HF_TOKEN)") from e
    except hf.OfflineModeIsEnabled as e:
        raise HubUnreachable(f"HF_HUB_OFFLINE is set and {repo_id} is not complete on disk") from e
    except hf.LocalEntryNotFoundError as e:  # a file's metadata request could not reach the Hub
        raise HubUnreachable(f"{during} {repo_id}: cannot reach {endpoint}; run again to resume") from e
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if during == "listing" and status >= 500:
            raise HubUnreachable(f"{endpoint} answered {status} while listing {repo_id}; try again later") from e
        raise DownloadFailed(
            f"{during} {repo_id}: {endpoint} answered {status} ({_one_line(e)}); run again to resume"
        ) from e
    except httpx2.TransportError as e:
        if during == "listing":
            raise HubUnreachable(
                f"cannot reach {endpoint}: {type(e).__name__}: {_one_line(e)}; check the network"
                + (" and HF_ENDPOINT, which names this address" if os.environ.get("HF_ENDPOINT") else "")
            ) from e
        raise DownloadFailed(
            f"connection to the Hub lost while downloading {repo_id} ({_one_line(e)}); run again to resume"
        ) from e
    except OSError as e:
        if e.errno == 28:  # ENOSPC: something else filled the disk meanwhile
            raise DiskTooSmall(f"the disk filled up while downloading {repo_id}: {e.strerror}") from e
        raise DownloadFailed(f"{during} {repo_id}: {_one_line(e)}; run again to resume") from e


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class _Tally:
    """Files done and bytes written as huggingface_hub's progress bars count them (from its worker threads)."""

    def __init__(self, whole_bytes: int):
        self._lock = threading.Lock()
        self._files = 0
        self._bytes = whole_bytes  # files already whole are skipped by snapshot_download without a byte counted

    def add(self, counter: str, n: float) -> None:
        with self._lock:
            if counter == "files":
                self._files += int(n)
            else:
                self._bytes += int(n)  # negative when a server ignores a Range and the file restarts

    def read(self) -> tuple[int, int]:
        """(files done, bytes done)."""
        with self._lock:
            return self._files, self._bytes


def _hub_bar(tally: _Tally, cancel: threading.Event) -> type:
    """A silent tqdm class for snapshot_download. It makes three bars of it: bytes written (named BYTES_BAR),
    bytes received (named BYTES_BAR + ".transfer", not counted: Xet may compress them) and files done (no name);
    the first and last forward their updates to `tally`. Any update raises Cancelled once `cancel` is set:
    the bars are the only hook inside its worker threads."""
    from huggingface_hub.utils import tqdm as hub_tqdm  # its base class hands over the bar's `name`

    counters = {BYTES_BAR: "bytes", None: "files"}

    class HubBar(hub_tqdm):
        def __init__(self, *args, **kwargs):
            self.counter = counters.get(kwargs.get("name"))
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if cancel.is_set():
                raise Cancelled("stopped by request")
            if self.counter is not None and n:
                tally.add(self.counter, n)
            return super().update(n)

    return HubBar


# -- disk -----------------------------------------------------------------------


def _measure(
    cache: RepoCache,
    revision: str,
    commit: str,
    endpoint: str,
    files: list[RemoteFile],
    offline: bool,
    free_space: FreeSpaceFn,
    headroom_bytes: int,
) -> FetchPlan:
    missing = [f for f in files if not hubcache.is_whole(cache, commit, f)]
    reclaimable = sum(_size(p) for p in hubcache.stale_partials(cache, STALE_PARTIAL_S))
    vouched = hubcache.read_ready(cache, commit)
    ready = vouched is not None and set(vouched) == set(files)
    return FetchPlan(
        repo_id=cache.repo_id,
        revision=revision,
        commit=commit,
        endpoint=endpoint,
        cache_dir=cache.root,
        files=tuple(files),
        missing=tuple(f.path for f in missing),
        bytes_total=sum(f.size for f in files),
        bytes_to_download=sum(f.size for f in missing),
        free_bytes=free_space(cache.root),
        reclaimable_bytes=reclaimable,
        headroom_bytes=headroom_bytes,
        ready=ready,
        offline=offline,
    )


def _refuse_unless_fits(plan: FetchPlan, cache: RepoCache, free_space: FreeSpaceFn) -> None:
    """Measure again now (the plan may be old) and refuse before writing anything."""
    now = _measure(
        cache,
        plan.revision,
        plan.commit,
        plan.endpoint,
        list(plan.files),
        plan.offline,
        free_space,
        plan.headroom_bytes,
    )
    if not now.fits:
        raise DiskTooSmall(
            f"{plan.repo_id} needs {size_text(now.bytes_to_download, 2, 'MiB')} more "
            f"plus {size_text(now.headroom_bytes, 2, 'MiB')} headroom, "
            f"but {cache.root} has {size_text(now.free_bytes + now.reclaimable_bytes, 2, 'MiB')} free "
            f"({size_text(now.shortfall_bytes, 2, 'MiB')} short); free some space or pass another --cache-dir"
        )


def _discard_broken(cache: RepoCache, commit: str, files: list[RemoteFile]) -> None:
    """Delete what huggingface_hub would wrongly keep: partial files of dead runs, and
    links or blobs of the wrong size (it skips any file that merely exists)."""
    for path in hubcache.stale_partials(cache, STALE_PARTIAL_S):
        path.unlink(missing_ok=True)
    for f in files:
        pointer = cache.pointer(commit, f)
        if pointer.is_symlink() and not pointer.exists():
            pointer.unlink()
        for path in (pointer, cache.blob(f)):
            if path.exists() and path.stat().st_size != f.size:
                hubcache.remove_file(cache, commit, f)


def _verify(
    cache: RepoCache, commit: str, files: list[RemoteFile], emit: ProgressFn, cancel: threading.Event, poll_s: float
) -> None:
    hashed = [0, 0]  # files, bytes
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            hashed[1] += n

    def check_one(f: RemoteFile) -> tuple[RemoteFile, str | None]:
        reason = hubcache.check_file(cache, commit, f, count, cancel)
        with lock:
            hashed[0] += 1
        return f, reason

    def check_all() -> list[tuple[RemoteFile, str]]:
        with ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="bigmoe-fetch-hash") as pool:
            return [(f, reason) for f, reason in pool.map(check_one, files) if reason is not None]

    def measure() -> tuple[int, int]:
        with lock:
            return hashed[0], hashed[1]

    with _hub_errors(cache.repo_id, commit, "", "verify"):
        bad = _run_with_progress(check_all, "verify", files, emit, cancel, poll_s, measure)
    for f, _ in bad:
        hubcache.remove_file(cache, commit, f)
    if bad:
        f, reason = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise NotReady(
            f"{cache.repo_id}: {f.path} {reason}{more}; the file changed on the Hub or was "
            "corrupted in transit and was removed; run again"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# -- progress -------------------------------------------------------------------


def _final(files: list[RemoteFile]) -> FetchProgress:
    total = sum(f.size for f in files)
    return FetchProgress("ready", len(files), len(files), total, total, 0.0, 0.0, 0.0)


def _run_with_progress(
    work: Callable[[], object],
    phase: str,
    files: list[RemoteFile],
    emit: ProgressFn,
    cancel: threading.Event,
    poll_s: float,
    measure: Callable[[], tuple[int, int]],
):
    """Run `work` on a worker thread; report `measure()` every poll_s seconds on this one.
    Ctrl-C or an exception in `emit` stops the worker (via `cancel`) before it propagates."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # handed to the caller's thread below
            outcome["error"] = e

    worker = threading.Thread(target=target, name=f"bigmoe-fetch-{phase}", daemon=True)
    total = sum(f.size for f in files)
    started = time.monotonic()
    samples = collections.deque([(started, measure()[1])])  # (seconds, bytes): the speed window
    worker.start()
    try:
        while True:
            worker.join(poll_s)
            files_done, bytes_done = measure()
            now = time.monotonic()
            samples.append((now, bytes_done))
            while len(samples) > 2 and now - samples[0][0] > SPEED_WINDOW_S:
                samples.popleft()
            span = now - samples[0][0]
            speed = (bytes_done - samples[0][1]) / span if span > 0 else 0.0
            eta = (total - bytes_done) / speed if speed > 0 else None
            emit(FetchProgress(phase, files_done, len(files), bytes_done, total, speed, eta, now - started))
            if not worker.is_alive():
                break
    except BaseException:
        cancel.set()
        worker.join()
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")
