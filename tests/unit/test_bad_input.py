"""Bad input a demanding user tries: each is one line on stderr and a non-zero exit, never a traceback, a hang or a
damaged file used (sizes past any machine, nan timeouts, bytes that are not UTF-8, a TERM that cannot show the TUI,
an unwritable state directory, damaged server records and links.json entries, a log that is gone, a --host that is
no address here, shards an index names but the directory lacks)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import psutil
import pytest
from bigmoe import exit_codes
from bigmoe.cli import main
from bigmoe.machine.links import Link, read_cache, write_cache
from bigmoe.model import presets
from bigmoe.plan.inputs import Overrides, PlanError, check_overrides
from bigmoe.serve import records
from bigmoe.serve.preflight import port_problem, shards_problem

SHARD = "model-00001-of-00001.safetensors"


def one_line(err: str) -> bool:
    return err.startswith("bigmoe: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "home"
    monkeypatch.setenv("BIGMOE_HOME", str(path))
    return path


@pytest.mark.parametrize("field", ["vram_gib", "ram_gib", "disk_gib"])
@pytest.mark.parametrize("value", [1e300, 2e6])
def test_a_size_past_any_machine_is_a_plan_error_not_an_overflow(field, value):
    with pytest.raises(PlanError, match=f"--{field.replace('_', '-')} .*at most 1048576"):
        check_overrides(presets.load("tiny-moe"), Overrides(**{field: value}))


@pytest.mark.parametrize(
    "args, words",
    [
        (("--start-timeout", "nan"), "not a finite number"),
        (("--start-timeout", "inf"), "not a finite number"),
        (("--prompt", "hi \udcff"), "not UTF-8"),
        (("--api-key", "k\udce9y"), "printable ASCII"),
    ],
)
def test_run_refuses_values_that_would_hang_or_fail_after_the_start(bigmoe, home, args, words):
    code, _, err = bigmoe("run", "tiny-moe", "--yes", *args)
    assert code == exit_codes.USAGE and one_line(err) and words in err and "\udce9" not in err


@pytest.mark.parametrize("term", ["dumb", ""])
def test_a_terminal_that_cannot_show_the_tui_points_to_yes(bigmoe, home, monkeypatch, term):
    import sys

    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    code, _, err = bigmoe("run", "tiny-moe")
    assert code == exit_codes.USAGE and one_line(err) and "--yes" in err


@pytest.mark.parametrize("command", [("ps",), ("logs",), ("stop",), ("stop", "--all")])
def test_an_unwritable_state_directory_is_one_line(bigmoe, tmp_path, monkeypatch, command):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("BIGMOE_HOME", str(not_a_dir))
    code, _, err = bigmoe(*command)
    assert code == exit_codes.ERROR and one_line(err) and str(not_a_dir) in err and "BIGMOE_HOME" in err


def a_record(home: Path, **fields) -> Path:
    """A record for this test's own process (alive, so only its damage can make it unusable)."""
    me = psutil.Process()
    info = dict(
        name="tiny-moe",
        pid=me.pid,
        host="127.0.0.1",
        port=8000,
        log=str(home / "logs" / "tiny-moe-8000-20260101-000000.log"),
        model_path="/m",
        served_name="tiny-moe",
        started=time.time(),
        create_time=me.create_time(),
    )
    path = home / "run" / "tiny-moe-8000-1.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info | fields))
    return path


@pytest.mark.parametrize(
    "damage",
    [{"pid": "abc"}, {"pid": -5}, {"pid": True}, {"port": "x"}, {"create_time": "x"}, {"started": "yesterday"}],
)
def test_a_damaged_record_is_never_used(bigmoe, home, damage):
    a_record(home, **damage)
    assert records.live() == []
    code, _, err = bigmoe("stop", "tiny-moe")
    assert code == exit_codes.ERROR and one_line(err) and "no bigmoe server is running" in err


def test_a_whole_record_still_counts(home):
    a_record(home)
    assert [info.pid for info in records.live()] == [os.getpid()]


@pytest.mark.parametrize("log", ["missing.log", "a-directory"])
def test_a_log_that_cannot_be_read_is_one_line(bigmoe, home, log):
    (home / "a-directory").mkdir(parents=True)
    a_record(home, log=str(home / log))
    code, _, err = bigmoe("logs", "tiny-moe")
    assert code == exit_codes.ERROR and one_line(err) and "cannot read the log" in err


def test_logs_with_several_matches_does_not_offer_an_option_it_lacks(bigmoe, home):
    a_record(home)
    second = json.loads((home / "run" / "tiny-moe-8000-1.json").read_text()) | {"port": 8001}
    (home / "run" / "tiny-moe-8001-1.json").write_text(json.dumps(second))
    code, _, err = bigmoe("logs", "tiny-moe")
    assert code == exit_codes.ERROR and one_line(err) and "2 servers match" in err and "--all" not in err


@pytest.mark.parametrize(
    "gbps, measured_at",
    [(float("inf"), 1.7e9), (1e300, 1.7e9), (1e-300, 1.7e9), (float("nan"), 1.7e9), (2.0, 1e30), (2.0, float("nan"))],
)
def test_an_implausible_cached_link_is_measured_again(tmp_path, gbps, measured_at):
    path = tmp_path / "links.json"
    write_cache(path, {"disk:vda": Link(gbps, "reads", measured_at), "disk:vdb": Link(1.5, "reads", 1.7e9)})
    cache, _ = read_cache(path)
    assert list(cache) == ["disk:vdb"]


@pytest.mark.parametrize(
    "host, words", [("not.a.host.invalid", "cannot be bound here"), ("h\udcff", "not a valid host name")]
)
def test_a_host_that_is_no_address_here_is_not_called_a_busy_port(host, words):
    why = port_problem(host, 8000)
    assert words in why and "in use" not in why and "127.0.0.1" in why


def test_a_busy_port_is_still_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert "is in use" in port_problem("127.0.0.1", s.getsockname()[1])


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(), tmp_path / "ckpt"))


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(checkpoint):
    (checkpoint / SHARD).unlink()
    why = shards_problem(checkpoint)
    assert f"{checkpoint / SHARD}: missing" in why and "copy or download the checkpoint again" in why


def test_a_directory_without_weights_is_named(checkpoint):
    (checkpoint / SHARD).unlink()
    (checkpoint / "model.safetensors.index.json").unlink()
    assert "*.safetensors: none there" in shards_problem(checkpoint)
