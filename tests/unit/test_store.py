"""`bigmoe list` shows what bigmoe keeps on disk for each model, and `bigmoe rm` takes exactly that away: never
another tool's download, never a model a server still runs, never without a yes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from bigmoe.cli import main
from bigmoe.serve import records

FLASH = "Qwen/Qwen3.8-Flash-Next-FP8"
COMMIT = "a" * 40
BLOB = "e" * 64


def hub_repo(cache: Path, repo_id: str, *, ready: bool, snapshot: bool = True, marked: bool = True) -> Path:
    """A repo in huggingface_hub's cache layout: one 4 KiB blob, its snapshot link, refs/main, bigmoe's marker."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / BLOB).write_bytes(b"x" * 4096)
    if snapshot:
        (repo / "snapshots" / COMMIT).mkdir(parents=True)
        (repo / "snapshots" / COMMIT / "config.json").symlink_to(repo / "blobs" / BLOB)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
    if marked:
        (repo / "bigmoe-ready").mkdir()
        if ready:
            (repo / "bigmoe-ready" / f"{COMMIT}.json").write_text("{}")
    return repo


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A hub cache with a whole Flash-Next download, a partial Qwen3.6 one, an Org/Name bigmoe pulled and a repo of
    another tool; the tiny model made; Flash-Next's paging file, marked damaged."""
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = tmp_path / "hub"
    repos = {
        "flash": hub_repo(hub, FLASH, ready=True),
        "qwen36": hub_repo(hub, "Qwen/Qwen3.6-35B-A3B-FP8", ready=False, snapshot=False, marked=False),
        "pulled": hub_repo(hub, "Org/Name", ready=True),
        "foreign": hub_repo(hub, "Other/Tool", ready=True, marked=False),
    }
    made = tmp_path / "home" / "models" / "tiny-moe-bf16"
    made.mkdir(parents=True)
    (made / "model.safetensors").write_bytes(b"y" * 8192)
    paging = tmp_path / "home" / "paging"
    paging.mkdir()
    pages = paging / "qwen3.8-flash-next-fp8.pages"
    pages.write_bytes(b"z" * 16384)
    pages.with_name(pages.name + ".damaged").write_text("crc32 mismatch")
    return {**repos, "made": made, "pages": pages}


def listed(bigmoe) -> list[tuple[str, str, str, str]]:
    code, out, _ = bigmoe("list", "--json")
    assert code == 0
    return [(r["model"], r["kind"], Path(r["path"]).name, r["state"]) for r in json.loads(out)]


def test_list_shows_each_models_files_and_their_state_and_no_other_tools(disk, bigmoe):
    assert listed(bigmoe) == [
        ("qwen3.6-35b-a3b", "download", "models--Qwen--Qwen3.6-35B-A3B-FP8", "partial"),
        ("qwen3.8-flash-next", "download", "models--Qwen--Qwen3.8-Flash-Next-FP8", "ready"),
        ("qwen3.8-flash-next", "paging file", "qwen3.8-flash-next-fp8.pages", "damaged"),
        ("tiny-moe", "made", "tiny-moe-bf16", "ready"),
        ("Org/Name", "download", "models--Org--Name", "ready"),
    ]
    code, out, _ = bigmoe("list")
    assert code == 0 and "Other" not in out and out.splitlines()[-1].startswith("total")


@pytest.mark.parametrize(
    "args, gone, kept",
    [
        (("qwen3.8-flash-next",), {"flash", "pages"}, {"qwen36", "pulled", "foreign", "made"}),
        (("qwen3.8-flash-next", "--only", "paging"), {"pages"}, {"flash", "qwen36", "pulled", "foreign", "made"}),
        ((FLASH, "--only", "download"), {"flash"}, {"pages", "qwen36", "pulled", "foreign", "made"}),
        (("tiny-moe",), {"made"}, {"flash", "pages", "qwen36", "pulled", "foreign"}),
        (("Org/Name",), {"pulled"}, {"flash", "pages", "qwen36", "foreign", "made"}),
    ],
)
def test_rm_removes_exactly_what_it_names(disk, bigmoe, args, gone, kept):
    code, out, err = bigmoe("rm", *args, "--yes")
    assert code == 0 and out.splitlines()[-1].startswith("removed"), err
    assert {k for k in gone | kept if not disk[k].exists()} == gone
    if "pages" in gone:
        assert not disk["pages"].with_name(disk["pages"].name + ".damaged").exists()


def test_rm_without_yes_and_without_a_terminal_removes_nothing(disk, bigmoe, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    code, _, err = bigmoe("rm", "qwen3.8-flash-next")
    assert code == 2 and "--yes" in err and len(err.strip().splitlines()) == 1
    assert disk["flash"].exists() and disk["pages"].exists()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("answer, removed", [("n\n", False), ("\n", False), ("y\n", True)])
def test_rm_asks_at_a_terminal_and_a_no_removes_nothing(disk, bigmoe, monkeypatch, answer, removed):
    monkeypatch.setattr("sys.stdin", Terminal(answer))
    code, out, err = bigmoe("rm", "qwen3.8-flash-next")
    assert "remove these" in out
    assert (code, disk["flash"].exists(), disk["pages"].exists()) == ((0, False, False) if removed else (1, True, True))
    assert removed or "nothing removed" in err


class BuildStartsWhileAsked(Terminal):
    """A terminal whose user takes so long to answer yes that a run starts building the model's paging file."""

    def __init__(self, pages: Path):
        super().__init__("y\n")
        self.pages = pages

    def readline(self, *args) -> str:
        from bigmoe_pager.core.paging_names import partial_file

        partial_file(self.pages, os.getpid()).write_bytes(b"b" * 4096)  # this live process stands in for the build
        return super().readline(*args)


def test_rm_asks_again_after_the_question_and_a_build_begun_meanwhile_keeps_everything(disk, bigmoe, monkeypatch):
    monkeypatch.setattr("sys.stdin", BuildStartsWhileAsked(disk["pages"]))
    code, out, err = bigmoe("rm", "qwen3.8-flash-next")
    assert "remove these" in out and code == 1 and "is building" in err, err
    assert disk["flash"].exists() and disk["pages"].exists()


def a_running_server(name: str, port: int, model_path: str) -> None:
    """A record of a server that runs (this test's own process stands in for it)."""
    me = psutil.Process(os.getpid())
    info = records.RunInfo(
        name, me.pid, "127.0.0.1", port, "/x.log", model_path, name, time.time(), "", me.create_time()
    )
    records.save(info)


@pytest.mark.parametrize(
    "server, model, reads",
    [
        (("tiny-moe", 8123, "/m"), "tiny-moe", "made"),
        (("my-own-name", 8124, f"models--Qwen--Qwen3.8-Flash-Next-FP8/snapshots/{COMMIT}"), FLASH, "flash"),
    ],
    ids=["its-model", "its-checkpoint-inside-a-download"],
)
def test_list_names_the_server_that_reads_a_file_and_rm_refuses_it(disk, bigmoe, server, model, reads):
    name, port, model_path = server
    a_running_server(name, port, str(disk["flash"].parent / model_path) if "snapshots" in model_path else model_path)
    code, out, _ = bigmoe("list", "--json")
    used = {Path(r["path"]): r["ports"] for r in json.loads(out)}
    assert used[disk[reads]] == [port] and sum(map(bool, used.values())) == 1
    assert f"(read by the server on port {port})" in bigmoe("list")[1]
    code, _, err = bigmoe("rm", model, "--yes")
    assert code == 1 and f"bigmoe stop {port}" in err and disk[reads].exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (("no-such-model", "--yes"), "nothing is kept for no-such-model (kept: Org/Name, qwen3.6"),
        (("tiny-moe", "--only", "paging", "--yes"), "no paging file is kept for tiny-moe"),
    ],
)
def test_rm_of_nothing_says_what_there_is(disk, bigmoe, args, says):
    code, _, err = bigmoe("rm", *args)
    assert code == 1 and says in err and len(err.strip().splitlines()) == 1


def test_what_a_dead_build_left_is_listed_and_removed_and_a_build_under_way_is_left_alone(disk, bigmoe):
    from bigmoe_pager.core.paging_names import partial_file

    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = partial_file(disk["pages"], int(exited.stdout))
    dead.write_bytes(b"p" * 4096)
    assert ("qwen3.8-flash-next", "paging file", dead.name, "partial") in listed(bigmoe)
    building = partial_file(disk["pages"], os.getpid())
    building.write_bytes(b"b" * 4096)
    assert ("qwen3.8-flash-next", "paging file", building.name, "building") in listed(bigmoe)

    for only in ("paging", "download"):  # the build reads the download: neither goes while it runs
        code, _, err = bigmoe("rm", "qwen3.8-flash-next", "--only", only, "--yes")
        assert code == 1 and "is building" in err and len(err.strip().splitlines()) == 1, err
        assert dead.exists() and disk["pages"].exists() and disk["flash"].exists()
    building.unlink()
    code, _, err = bigmoe("rm", "qwen3.8-flash-next", "--only", "paging", "--yes")
    assert code == 0 and not dead.exists() and not disk["pages"].exists(), err


def test_rm_of_a_download_whose_lock_cannot_be_made_is_one_line_and_removes_nothing(disk, bigmoe):
    (disk["flash"].parent / ".locks").write_text("not a folder")  # the hub cache's lock folder cannot be made
    code, _, err = bigmoe("rm", "qwen3.8-flash-next", "--yes")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "cannot lock" in err, err
    assert disk["flash"].exists() and disk["pages"].exists()
