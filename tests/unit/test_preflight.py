"""preflight: the causes that made vLLM fail 12-50 s into its start-up are named in one line, in well
under a second, before it starts: pager settings (the plugin's own parser), truncated shards, a busy
port, no room for the paging file. The run pipeline calls it before prepare and launch."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from bigmoe import run as sequence
from bigmoe.model import presets
from bigmoe.serve.preflight import (
    TOKENIZER_FILES,
    PreflightError,
    paging_space_problem,
    port_problem,
    preflight,
    settings_problem,
    shards_problem,
)

SHARD = "model-00001-of-00001.safetensors"


def a_plan(**fields):
    """The fields of bigmoe.plan.planner.Plan that preflight and the run's model step read (a stand-in, not the
    estimator)."""
    base = dict(
        env={},
        pager=True,
        layers=4,
        experts=16,
        expert_bytes=196608,
        expert_dtype="bf16",
        ssd_source="checkpoint",
        paging_file=None,
    )
    return SimpleNamespace(**(base | fields))


@pytest.fixture
def private_checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(), tmp_path / "ckpt"))


@pytest.mark.parametrize(
    "env, words",
    [
        ({"BIGMOE_VRAM_SLOTS": "many"}, "BIGMOE_VRAM_SLOTS"),
        ({"BIGMOE_READ_TIMEOUT_S": "-1"}, "BIGMOE_READ_TIMEOUT_S"),
        ({"BIGMOE_COMPRESS": "maybe"}, "BIGMOE_COMPRESS"),
        ({"BIGMOE_VRAM_SLOTS": "8", "BIGMOE_RAM_SLOTS": "4"}, "RAM slots must be >= VRAM slots"),
        ({"BIGMOE_VRAM_SLOTS": "8,8"}, "BIGMOE_VRAM_SLOTS"),
    ],
)
def test_bad_pager_variables_are_one_line_naming_the_variable(env, words):
    start = time.monotonic()
    why = settings_problem({}, a_plan(), environ={"BIGMOE_PAGER": "1", **env})
    assert time.monotonic() - start < 1.0
    assert why is not None and words in why and "\n" not in why


@pytest.mark.parametrize(
    "text, words",
    [("vram_slots = [", "not valid TOML"), ("vram_slot = 4\n", "unknown keys"), ("io_workers = 'x'\n", "io_workers")],
)
def test_a_bad_settings_file_is_named(tmp_path, text, words):
    file = tmp_path / "pager.toml"
    file.write_text(text)
    why = settings_problem({}, None, environ={"BIGMOE_SETTINGS": str(file)})
    assert why is not None and str(file) in why and words.lower() in why.lower()


def test_the_plans_own_variables_beat_the_environment_and_pass():
    assert settings_problem({"BIGMOE_VRAM_SLOTS": "8"}, a_plan(), environ={"BIGMOE_VRAM_SLOTS": "x"}) is None


@pytest.mark.parametrize(
    "synthetic, in_cache, fix",
    [
        (True, True, "bigmoe makes it anew"),
        (True, False, "copy or download the checkpoint again"),
        (False, False, "copy or download the checkpoint again"),
    ],
)
def test_a_truncated_shard_is_named_with_its_fix(private_checkpoint, monkeypatch, synthetic, in_cache, fix):
    """Only a checkpoint bigmoe made in its own cache is made anew; a --model-dir is the user's to replace."""
    monkeypatch.setenv("BIGMOE_HOME", str(private_checkpoint.parent if in_cache else private_checkpoint.parent / "x"))
    if in_cache:
        (private_checkpoint.parent / "models").mkdir()
        private_checkpoint = Path(shutil.move(private_checkpoint, private_checkpoint.parent / "models" / "ckpt"))
    model = "tiny-moe" if synthetic else ""
    assert shards_problem(private_checkpoint) is None
    shard = private_checkpoint / SHARD
    shard.write_bytes(shard.read_bytes()[:-4096])
    why = shards_problem(private_checkpoint, synthetic, model)
    assert why.startswith(f"checkpoint shard {shard}: truncated") and fix in why and "\n" not in why


def test_a_busy_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert f"port {port} on 127.0.0.1 is in use" in port_problem("127.0.0.1", port)
    assert port_problem("127.0.0.1", port) is None


def test_no_room_for_the_paging_file(tmp_path, monkeypatch):
    plan = a_plan(ssd_source="paging file", paging_file=str(tmp_path / "p" / "m.pages"))
    assert paging_space_problem(plan) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=10 << 20, total=1 << 40, used=0))
    assert "needs up to" in paging_space_problem(plan) and "--paging-dir" in paging_space_problem(plan)
    assert paging_space_problem(a_plan(**(vars(plan) | {"forced": True}))) is None  # --force accepted it


def test_the_run_pipeline_stops_before_vllm_on_a_truncated_shard(private_checkpoint, monkeypatch):
    shard = private_checkpoint / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    preset = presets.load("tiny-moe")
    opts = sequence.RunOptions(model="tiny-moe", model_dir=str(private_checkpoint), port=1)
    plan = a_plan()
    with pytest.raises(PreflightError, match=f"checkpoint shard {shard}: truncated"):
        sequence.obtain_model(preset, plan, opts, lambda e, f: None)


def test_preflight_passes_a_sound_start(private_checkpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preflight(a_plan(), private_checkpoint, "127.0.0.1", port, True, "tiny-moe")


@pytest.mark.parametrize("kept", [(), ("tokenizer_config.json",), ("tokenizer.json",)])
def test_a_checkpoint_without_any_tokenizer_is_named_before_vllm_loads_it(private_checkpoint, kept):
    for name in TOKENIZER_FILES:
        if name not in kept and (private_checkpoint / name).exists():
            (private_checkpoint / name).unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if kept:
        preflight(a_plan(), private_checkpoint, "127.0.0.1", port, True, "tiny-moe")
    else:
        with pytest.raises(PreflightError, match=f"{private_checkpoint} has no tokenizer"):
            preflight(a_plan(), private_checkpoint, "127.0.0.1", port, True, "tiny-moe")


@pytest.mark.parametrize("left_by", ["a dead build", "a build under way"])
def test_what_a_dead_build_left_counts_as_room_for_the_paging_file(tmp_path, monkeypatch, left_by):
    from bigmoe.serve.preflight import paging_file_bytes
    from bigmoe_pager.core.paging_names import partial_file

    path = tmp_path / "m.pages"
    plan = a_plan(ssd_source="paging file", paging_file=str(path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout) if left_by == "a dead build" else os.getpid()
    with partial_file(path, pid).open("wb") as left:
        left.truncate(paging_file_bytes(plan) + (2 << 30))  # sparse: its size is what a whole build would take
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=10 << 20, total=1 << 40, used=0))
    problem = paging_space_problem(plan)
    assert (problem is None) == (left_by == "a dead build"), problem
