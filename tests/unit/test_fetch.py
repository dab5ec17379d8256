"""fetch against a local Hub (tests/hubserver.py) through the real huggingface_hub client.

The served repo is a synthetic Qwen3-MoE checkpoint (scripts/make_tiny_moe.py) with a
~12 MiB first shard, so a connection cut after 11 MiB leaves one 10 MiB chunk written
and huggingface_hub resumes it with a Range request.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from bigmoe.cli.pull import pull
from bigmoe.model import fetch, hubcache
from click.testing import CliRunner

from tests.hubserver import HubServer

REPO = "Qwen/Qwen3.8-Flash-Next-FP8"  # the preset's hub id, so preset names resolve to the local hub
PRESET = "qwen3.8-flash-next"
BIG = "model-00001-of-00002.safetensors"
CHUNK = 10 << 20  # huggingface_hub writes downloads in 10 MiB chunks


@dataclass
class FakeFreeSpace:
    """Fake free-space probe: stands in for a disk of `free` bytes (a real small tmpfs needs root)."""

    free: int

    def __call__(self, path: Path) -> int:
        return self.free


@pytest.fixture
def served(tmp_path, tiny_checkpoint) -> Path:
    """A private copy of the synthetic checkpoint, as the repo the hub serves (tests may edit it)."""
    source = tiny_checkpoint(shard_bytes=12 << 20)
    root = shutil.copytree(source, tmp_path / "served")
    assert (root / BIG).stat().st_size > CHUNK + (1 << 20)
    return Path(root)


@pytest.fixture
def start_hub(served, monkeypatch):
    """Factory: start the local hub (optionally requiring a token) and point HF_ENDPOINT at it."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    running = []

    def start(token: str | None = None) -> HubServer:
        server = HubServer(served, REPO, token=token).__enter__()
        running.append(server)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        return server

    yield start
    for server in running:
        server.__exit__(None, None, None)


@pytest.fixture
def hub(start_hub) -> HubServer:
    return start_hub()


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hf-cache"


def assert_exact(snapshot: Path, served: Path) -> None:
    """The snapshot holds exactly the served files, byte for byte."""
    want = sorted(p.relative_to(served).as_posix() for p in served.rglob("*") if p.is_file())
    got = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert got == want
    for rel in want:
        assert (snapshot / rel).read_bytes() == (served / rel).read_bytes(), rel


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


@pytest.mark.parametrize("model", [PRESET, REPO])
def test_full_download_is_exact_and_ready(hub, served, cache, model):
    plan = fetch.dry_run(model, cache_dir=cache)
    sizes = {p.relative_to(served).as_posix(): p.stat().st_size for p in files_under(served)}
    assert (plan.repo_id, plan.commit) == (REPO, hub.commit())
    assert {f.path: f.size for f in plan.files} == sizes
    assert plan.bytes_to_download == plan.bytes_total == sum(sizes.values())
    assert plan.fits and not plan.ready and not plan.offline
    assert not cache.exists(), "a dry run writes nothing"

    events: list[fetch.FetchProgress] = []
    path = fetch.fetch(plan, events.append, poll_s=0.02)

    assert path == plan.snapshot_dir and fetch.is_ready(plan)
    assert_exact(path, served)
    phases = [e.phase for e in events]
    assert phases[0] == "download" and phases[-1] == "ready" and "verify" in phases
    assert phases == sorted(phases, key=["download", "verify", "ready"].index)
    download = [e.bytes_done for e in events if e.phase == "download"]
    assert download == sorted(download) and download[-1] == plan.bytes_total
    finished = [e for e in events if e.phase == "download"][-1]
    assert finished.speed_bps > 0 and finished.eta_s == 0 and finished.files_done == len(plan.files)
    verify = [e for e in events if e.phase == "verify"][-1]
    assert (verify.files_done, verify.bytes_done) == (len(plan.files), plan.bytes_total)
    assert all(hub.content_gets(name) for name in sizes)
    assert hub.unknown_routes() == []

    again = fetch.dry_run(model, cache_dir=cache)
    assert again.ready and again.bytes_to_download == 0 and again.missing == ()
    gets_before = len([r for r in hub.requests if r.method == "GET"])
    assert fetch.fetch(again) == path
    assert len([r for r in hub.requests if r.method == "GET"]) == gets_before, "a ready model is not fetched again"


@pytest.mark.parametrize("whole_before", [False, True], ids=["fresh", "after-a-cut-run"])
def test_progress_counts_bytes_as_the_hub_client_writes_them(hub, served, cache, monkeypatch, whole_before):
    """Download events come from huggingface_hub's own progress bars: the bytes grow in steps while the
    (paced) download runs and end at the model's size; files already whole count from the first event."""
    from huggingface_hub import constants

    if whole_before:  # a run cut inside BIG leaves every other file whole
        hub.drop_midway(BIG, after_bytes=CHUNK + (1 << 20), outage=True)
        with pytest.raises(fetch.DownloadFailed):
            fetch.fetch(fetch.dry_run(REPO, cache_dir=cache))
        hub.heal()
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 20)  # a bar update per MiB written, not per 10 MiB
    hub.pace(8 << 20)
    plan = fetch.dry_run(REPO, cache_dir=cache)
    whole = plan.bytes_total - plan.bytes_to_download
    assert (whole > 0) == whole_before

    events: list[fetch.FetchProgress] = []
    fetch.fetch(plan, events.append, poll_s=0.05)

    download = [e for e in events if e.phase == "download"]
    done = [e.bytes_done for e in download]
    assert done == sorted(done) and done[0] >= whole and done[-1] == plan.bytes_total
    assert len({d for d in done if whole < d < plan.bytes_total}) >= 3, f"no growth seen: {done}"
    files = [e.files_done for e in download]
    assert files == sorted(files) and files[-1] == len(plan.files)
    assert {(e.files_total, e.bytes_total) for e in download} == {(len(plan.files), plan.bytes_total)}


def test_dropped_connection_resumes_with_range_in_the_same_run(hub, served, cache):
    hub.drop_midway(BIG, after_bytes=CHUNK + (1 << 20))
    path = fetch.fetch(fetch.dry_run(REPO, cache_dir=cache))
    assert_exact(path, served)
    gets = hub.content_gets(BIG)
    assert [g.headers.get("range") for g in gets] == [None, f"bytes={CHUNK}-"]


def test_interrupted_download_resumes_when_run_again(hub, served, cache):
    hub.drop_midway(BIG, after_bytes=CHUNK + (1 << 20), outage=True)
    plan = fetch.dry_run(REPO, cache_dir=cache)
    with pytest.raises(fetch.DownloadFailed) as failed:
        fetch.fetch(plan)
    assert "\n" not in str(failed.value) and "run again" in str(failed.value)
    assert not fetch.is_ready(plan)
    assert not hubcache.RepoCache(cache, REPO).marker(plan.commit).exists()
    assert not (plan.snapshot_dir / BIG).exists(), "a cut file never appears whole"
    assert not list(cache.rglob("*.incomplete"))

    hub.heal()
    resumed = fetch.dry_run(REPO, cache_dir=cache)
    assert resumed.missing == (BIG,) and resumed.bytes_to_download == (served / BIG).stat().st_size
    path = fetch.fetch(resumed)
    assert_exact(path, served)
    small = [p.name for p in files_under(served) if p.name != BIG]
    assert all(len(hub.content_gets(name)) == 1 for name in small), "whole files are not fetched twice"


@pytest.fixture(params=["tmpfs", "fake-probe"])
def small_disk(request, tmp_path):
    """(cache dir, free-space probe or None) on a disk of 2 MiB."""
    if request.param == "fake-probe":
        yield tmp_path / "hf-cache", FakeFreeSpace(2 << 20)
        return
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the fake-probe case covers it")
    try:
        yield mount / "hf-cache", None
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_disk_too_small_is_refused_before_any_byte(hub, small_disk):
    cache, probe = small_disk
    plan = fetch.dry_run(REPO, cache_dir=cache, free_space=probe, headroom_bytes=0)
    assert not plan.fits and plan.shortfall_bytes == plan.bytes_to_download - plan.free_bytes > 0
    with pytest.raises(fetch.DiskTooSmall) as refused:
        fetch.fetch(plan, free_space=probe)
    assert "short" in str(refused.value) and "\n" not in str(refused.value)
    assert files_under(cache) == []
    assert [r for r in hub.requests if "/resolve/" in r.path or r.role == "cdn"] == []


@pytest.mark.parametrize("spare, fits", [(-1, False), (0, True)])
def test_disk_check_counts_bytes_and_headroom(hub, cache, spare, fits):
    listed = fetch.dry_run(REPO, cache_dir=cache)
    probe = FakeFreeSpace(listed.bytes_total + 4096 + spare)
    plan = fetch.dry_run(REPO, cache_dir=cache, free_space=probe, headroom_bytes=4096)
    assert plan.fits is fits and plan.shortfall_bytes == (0 if fits else 1)


@pytest.mark.parametrize("name", ["config.json", "model-00002-of-00002.safetensors"])
def test_file_changed_on_the_hub_after_listing_is_not_ready(hub, served, cache, name):
    plan = fetch.dry_run(REPO, cache_dir=cache)
    data = bytearray((served / name).read_bytes())
    data[-2] ^= 0x01  # same size: only the hash can tell
    (served / name).write_bytes(bytes(data))

    with pytest.raises(fetch.NotReady) as not_ready:
        fetch.fetch(plan)
    message = str(not_ready.value)
    assert name in message and "differs from the hub's" in message and "\n" not in message
    assert not fetch.is_ready(plan)
    assert not (plan.snapshot_dir / name).exists(), "the bad file is removed"

    fresh = fetch.dry_run(REPO, cache_dir=cache)
    assert fresh.commit != plan.commit and fresh.commit == hub.commit()
    assert_exact(fetch.fetch(fresh), served)


def test_damaged_file_on_disk_is_fetched_again(hub, served, cache):
    plan = fetch.dry_run(REPO, cache_dir=cache)
    path = fetch.fetch(plan)
    with open((path / BIG).resolve(), "r+b") as blob:
        blob.truncate(1000)
    again = fetch.dry_run(REPO, cache_dir=cache)
    assert not again.ready and again.missing == (BIG,)
    assert_exact(fetch.fetch(again), served)
    assert len(hub.content_gets(BIG)) == 2


def test_hf_token_is_sent_as_bearer_and_not_to_the_cdn(start_hub, served, cache, monkeypatch):
    hub = start_hub(token="hf_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert_exact(fetch.fetch(fetch.dry_run(REPO, cache_dir=cache)), served)
    to_hub = [r for r in hub.requests if r.role == "hub" and r.path != "/api/agent-harnesses"]
    assert to_hub and all(r.headers.get("authorization") == "Bearer hf_secret" for r in to_hub)
    to_cdn = [r for r in hub.requests if r.role == "cdn"]
    assert to_cdn and all("authorization" not in r.headers for r in to_cdn)


def test_wrong_token_is_one_clear_line(start_hub, tmp_path, monkeypatch):
    start_hub(token="hf_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(fetch.ModelNotFound, match="HF_TOKEN"):
        fetch.dry_run(REPO, cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "model, revision, words",
    [
        ("acme/no-such-model", None, "was not found"),
        (REPO, "v9", "has no revision 'v9'"),
    ],
)
def test_unknown_repo_or_revision(hub, cache, model, revision, words):
    with pytest.raises(fetch.ModelNotFound, match=words):
        fetch.dry_run(model, revision, cache_dir=cache)


def test_synthetic_preset_has_nothing_to_download(cache):
    with pytest.raises(fetch.FetchError, match="made on this machine"):
        fetch.dry_run("tiny-moe", cache_dir=cache)


@pytest.mark.parametrize("downloaded_before", [False, True])
def test_unreachable_hub_uses_the_ready_marker_or_says_so(hub, served, cache, monkeypatch, downloaded_before):
    if downloaded_before:
        fetch.fetch(fetch.dry_run(REPO, cache_dir=cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    if not downloaded_before:
        with pytest.raises(fetch.HubUnreachable, match="cannot reach"):
            fetch.dry_run(REPO, cache_dir=cache)
        return
    plan = fetch.dry_run(REPO, cache_dir=cache)
    assert plan.offline and plan.ready and plan.commit == hub.commit()
    assert_exact(fetch.fetch(plan), served)


def test_cancel_stops_before_any_file_is_whole(hub, cache):
    plan = fetch.dry_run(REPO, cache_dir=cache)
    stop = threading.Event()
    stop.set()
    with pytest.raises(fetch.FetchCancelled):
        fetch.fetch(plan, cancel=stop)
    assert not fetch.is_ready(plan)
    assert not [p for p in files_under(cache / "models--Qwen--Qwen3.8-Flash-Next-FP8" / "blobs")]


def test_ctrl_c_in_progress_stops_the_download_thread(hub, cache):
    plan = fetch.dry_run(REPO, cache_dir=cache)

    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch.fetch(plan, interrupt, poll_s=0.01)
    assert not [t for t in threading.enumerate() if t.name.startswith("bigmoe-fetch")]
    assert not fetch.is_ready(plan)


# -- the CLI ---------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(pull, list(args), catch_exceptions=False)


def test_pull_prints_progress_and_the_ready_path(hub, served, cache):
    result = invoke(PRESET, "--cache-dir", str(cache))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{REPO}@main (commit {hub.commit()[:12]})")
    assert lines[-1].startswith("ready ")
    assert_exact(Path(lines[-1].removeprefix("ready ")), served)


def test_pull_json_lines(hub, served, cache):
    result = invoke(REPO, "--cache-dir", str(cache), "--json")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["event"] == "plan" and events[0]["bytes_to_download"] == events[0]["bytes_total"]
    assert {e["event"] for e in events[1:-1]} == {"progress"}
    assert events[-2]["phase"] == "ready" and events[-1]["event"] == "ready"
    assert_exact(Path(events[-1]["path"]), served)


def test_pull_dry_run_downloads_nothing(hub, cache):
    result = invoke(REPO, "--cache-dir", str(cache), "--dry-run")
    assert result.exit_code == 0 and "to download" in result.stdout
    assert not cache.exists()


@pytest.mark.parametrize(
    "args, code, words",
    [
        (("acme/no-such-model",), fetch.EXIT_NOT_FOUND, "was not found"),
        ((REPO, "--revision", "v9"), fetch.EXIT_NOT_FOUND, "no revision"),
        (("no-such-preset",), 1, "unknown model"),
        ((REPO, "--small-disk"), fetch.EXIT_NO_SPACE, "short"),
    ],
)
def test_pull_errors_are_one_line_with_an_exit_code(hub, cache, monkeypatch, args, code, words):
    if "--small-disk" in args:
        monkeypatch.setattr(fetch, "free_bytes", FakeFreeSpace(1 << 20))
        args = tuple(a for a in args if a != "--small-disk")
    result = invoke(*args, "--cache-dir", str(cache))
    assert result.exit_code == code
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bigmoe: ") and words in result.stderr
    assert "Traceback" not in result.output
    assert files_under(cache) == []


def listed_downloads(cache: Path, tmp_path: Path) -> list[tuple[str, str, int]]:
    from bigmoe.cli.store import list_command

    args = ["--cache-dir", str(cache), "--paging-dir", str(tmp_path / "no-paging"), "--json"]
    result = CliRunner().invoke(list_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [(r["model"], r["state"], r["bytes"]) for r in json.loads(result.output) if r["kind"] == "download"]


def test_list_follows_a_pull_from_partial_to_ready_and_rm_takes_it_away(hub, served, cache, tmp_path, monkeypatch):
    from bigmoe.cli.store import rm_command

    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    hub.drop_midway(BIG, after_bytes=CHUNK + (1 << 20), outage=True)
    assert invoke(PRESET, "--cache-dir", str(cache)).exit_code == fetch.EXIT_NETWORK
    assert [(m, s) for m, s, _ in listed_downloads(cache, tmp_path)] == [(PRESET, "partial")]
    hub.heal()
    assert invoke(PRESET, "--cache-dir", str(cache)).exit_code == 0
    [(model, state, size)] = listed_downloads(cache, tmp_path)
    served_bytes = sum(p.stat().st_size for p in files_under(served))
    assert (model, state) == (PRESET, "ready") and served_bytes <= size < served_bytes + (1 << 20)

    removed = CliRunner().invoke(rm_command, [PRESET, "--cache-dir", str(cache), "--yes"], catch_exceptions=False)
    assert removed.exit_code == 0, removed.output
    assert listed_downloads(cache, tmp_path) == [] and not hubcache.RepoCache(cache, REPO).storage.exists()
    assert fetch.dry_run(REPO, cache_dir=cache).bytes_to_download == served_bytes


def test_a_hub_address_that_answers_nothing_names_hf_endpoint(cache, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    result = CliRunner().invoke(pull, [REPO, "--cache-dir", str(cache)])
    assert result.exit_code == fetch.EXIT_NETWORK
    assert "cannot reach http://127.0.0.1:9" in result.stderr and "HF_ENDPOINT" in result.stderr


@pytest.mark.parametrize("ending", ["finishes", "is-killed"])
def test_a_running_pull_locks_its_download_against_rm_verify_and_a_second_pull(
    hub, served, cache, tmp_path, monkeypatch, bigmoe, ending
):
    """A real `bigmoe pull` in another process: while it downloads, list says so and rm, verify and another pull
    are refused with one line naming it, removing nothing; once it ends (done, or SIGKILLed) the lock is gone."""
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    hub.pace(1 << 20)  # the 12 MiB shard takes 12 s, unless the pace is lifted
    child = subprocess.Popen(
        [sys.executable, "-m", "bigmoe", "pull", REPO, "--cache-dir", str(cache)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        repo = hubcache.RepoCache(cache, REPO)
        deadline = time.monotonic() + 30
        while not (
            repo.lock.is_file() and repo.lock.read_text().strip() == str(child.pid) and hubcache.partial_files(repo)
        ):
            assert time.monotonic() < deadline and child.poll() is None, "the pull never started downloading"
            time.sleep(0.05)
        assert [(m, s) for m, s, _ in listed_downloads(cache, tmp_path)] == [(PRESET, "downloading")]
        # the model's files already whole, as the fetch code judges them; the rest of the cache folder also holds
        # huggingface_hub's own short-lived files (partial downloads, its umask and symlink probes), which it removes
        listing = fetch.dry_run(REPO, cache_dir=cache)
        whole_before = [f for f in listing.files if hubcache.is_whole(repo, listing.commit, f)]
        for args in (["rm", "--yes"], ["verify"], ["verify", "--keep"], ["pull"]):  # verify --keep only reads
            code, _, line = bigmoe(args[0], PRESET, "--cache-dir", str(cache), *args[1:])
            assert code == 1 and line.count("\n") == 1 and f"pid {child.pid} (bigmoe pull {REPO})" in line, line
        assert child.poll() is None, "the refusals ended the pull"
        removed = [f.path for f in whole_before if not hubcache.is_whole(repo, listing.commit, f)]
        assert not removed, f"a refusal removed files: {removed}"
        if ending == "is-killed":
            child.kill()
        else:
            hub.pace(None)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == (0 if ending == "finishes" else -9), child.stderr.read()
    [(_, state, _)] = listed_downloads(cache, tmp_path)
    assert state == ("ready" if ending == "finishes" else "partial")
    code, _, err = bigmoe("rm", PRESET, "--cache-dir", str(cache), "--yes")
    assert code == 0, err
    assert not hubcache.RepoCache(cache, REPO).storage.exists()
