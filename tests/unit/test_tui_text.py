"""The TUI's pure helpers: following a growing log, finding a failed start's error line, making
outside text printable, and describing pipeline progress events."""

from __future__ import annotations

import pytest
from bigmoe.tui.logtail import LogTail, error_index
from bigmoe.tui.progress_view import describe, finished, fraction
from bigmoe.tui.text import printable


def test_log_tail_hands_out_whole_lines_once(tmp_path):
    log = tmp_path / "vllm.log"
    tail = LogTail(log)
    assert tail.read_new() == []  # not written yet
    log.write_bytes(b"one\ntw")
    assert tail.read_new() == ["one"]
    with open(log, "ab") as f:
        f.write(b"o\r\nthree\n")
    assert tail.read_new() == ["two", "three"]
    assert tail.read_new() == []


@pytest.mark.parametrize(
    "raw,shown",
    [
        ("plain", "plain"),
        ("\x1b[32mINFO\x1b[0m ready\r", "INFO ready"),
        ("a\tb", "a   b"),
        ("odd token\x11", "odd token\ufffd"),
        ("bell\x07 and del\x7f", "bell\ufffd and del\ufffd"),
    ],
)
def test_printable_removes_escapes_and_marks_controls(raw, shown):
    assert printable(raw) == shown


@pytest.mark.parametrize(
    "lines,expected",
    [
        (["INFO start", "Traceback (most recent call last):", "  File x", "ValueError: bad config", "INFO exiting"], 3),
        (["RuntimeError: first", "INFO retry", "\x1b[31mRuntimeError: second\x1b[0m", "INFO bye"], 2),
        (["INFO all fine", "INFO last words"], 1),
    ],
)
def test_error_index_points_at_launch_error_line(tmp_path, lines, expected):
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(lines) + "\n")
    shown = [printable(line) for line in lines]
    assert error_index(shown, log) == expected


@pytest.mark.parametrize(
    "event,fields,line,part,done",
    [
        (
            "model",
            {"state": "making", "name": "tiny-moe", "dtype": "bf16"},
            "making tiny-moe (bf16) on this machine",
            None,
            False,
        ),
        ("model", {"state": "ready", "path": "/m"}, "ready: /m", None, True),
        ("fetch", {"state": "planned", "bytes": 3 << 30, "files": 7}, "3.00 GiB to download in 7 files", None, False),
        (
            "fetch",
            {
                "phase": "download",
                "files_done": 1,
                "files_total": 4,
                "bytes_done": 1 << 30,
                "bytes_total": 4 << 30,
                "speed_bps": 2e8,
                "eta_s": 15.2,
                "elapsed_s": 5.0,
            },
            "download: 1/4 files, 1.00 GiB of 4.00 GiB, 200.0 MB/s, ETA 15 s",
            (1 << 30, 4 << 30),
            False,
        ),
        (
            "prepare",
            {"state": "building", "records_done": 8, "records_total": 64, "elapsed_s": 1.5},
            "building the paging file: 8/64 records, 1.5 s",
            (8, 64),
            False,
        ),
        ("prepare", {"state": "reused", "path": "/p"}, "reused /p (its header matches this checkpoint)", None, True),
        (
            "prepare",
            {"state": "removed", "path": "/.p.partial-7", "reason": "dead"},
            "removed /.p.partial-7: dead",
            None,
            False,
        ),
        ("other", {"x": 1}, "x=1", None, False),
    ],
)
def test_progress_events_are_described(event, fields, line, part, done):
    assert describe(event, fields) == line
    assert fraction(event, fields) == (None if part is None else tuple(float(v) for v in part))
    assert finished(event, fields) is done
