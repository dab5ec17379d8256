"""`bigmoe logs`' reading of a server log: whole lines and the one still being written, and --follow's lines as they
land, each once, ending when the server is gone (real files; the server's liveness is a function here, a real
process in test_launch_process.py)."""

from __future__ import annotations

import threading
import time

import pytest
from bigmoe.serve.log_follow import follow, read_log


@pytest.mark.parametrize(
    "data,lines,partial",
    [
        (b"", [], ""),
        (b"\n", [""], ""),
        (b"a\n\nb\n", ["a", "", "b"], ""),
        (b"INFO ready\nWARN hal", ["INFO ready"], "WARN hal"),
        (b"no newline yet", [], "no newline yet"),
        (b"bad \xff byte\n", ["bad \ufffd byte"], ""),
    ],
)
def test_a_log_reads_as_whole_lines_and_the_line_still_being_written(tmp_path, data, lines, partial):
    path = tmp_path / "server.log"
    path.write_bytes(data)
    end = read_log(path)
    assert (end.lines, end.partial) == (lines, partial)
    assert data[end.offset :].decode(errors="replace") == partial  # following resumes where the whole lines end


@pytest.mark.parametrize("pieces", [[b"one\n", b"two\nthr", b"ee\n", b"four"], [b"o", b"ne\ntwo", b"\nthree\nfour"]])
def test_following_writes_each_line_once_whole_in_order_and_ends_when_the_server_is_gone(tmp_path, pieces):
    path = tmp_path / "server.log"
    path.write_bytes(b"before\nhalf")
    start = read_log(path)
    running = threading.Event()
    running.set()

    def server() -> None:
        with path.open("ab") as log:
            for piece in [b"-line\n", *pieces]:
                time.sleep(0.03)
                log.write(piece)
                log.flush()
        running.clear()  # gone right after its last write: that write is still shown

    writer = threading.Thread(target=server)
    writer.start()
    shown: list[str] = []
    follow(path, start.offset, running.is_set, shown.append, poll_s=0.005)
    writer.join()
    assert start.lines == ["before"]
    assert shown == ["half-line", "one", "two", "three", "four"]


def test_following_a_log_nothing_writes_any_more_returns_at_once_with_its_rest(tmp_path):
    path = tmp_path / "server.log"
    path.write_bytes(b"done\nlast words")
    shown: list[str] = []
    began = time.monotonic()
    follow(path, read_log(path).offset, lambda: False, shown.append, poll_s=5.0)
    assert shown == ["last words"] and time.monotonic() - began < 1.0
