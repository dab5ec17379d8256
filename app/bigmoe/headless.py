"""`bigmoe run --yes`: the run's sequence (bigmoe.run) with plain progress lines (or JSON lines). Never imports Textual.

Signals while the server runs (bigmoe.serve.run_signals): the first Ctrl-C or SIGTERM prints that it is
stopping the server and stops it (SIGTERM to its group, SIGKILL after a grace period); a second one
kills the group at once. SIGHUP (the terminal closed) leaves the server running with its record, so
`bigmoe ps` and `bigmoe stop` find it; the run exits 129 with a line in the server's log.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import httpx

from bigmoe import exit_codes
from bigmoe import run as sequence
from bigmoe.run import RunOptions, Steps
from bigmoe.serve import launch, records
from bigmoe.serve.client import chat
from bigmoe.serve.preflight import exposure_warning
from bigmoe.serve.run_signals import Killed, RunSignals, Stop

STATS_EVERY_S = 10.0
"""Seconds between stats lines while serving."""
POLL_S = 0.5
"""Seconds between checks that the server still runs (a `bigmoe stop` is noticed within this)."""
EXIT_FOR_SIGNAL = {signal.SIGINT: exit_codes.INTERRUPTED, signal.SIGTERM: exit_codes.TERMINATED}
"""The run's exit code after a signal stopped its server."""


class Printer:
    """Renders progress events as human lines or JSON lines on stdout; quiet once the terminal is gone."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.closed = False

    def __call__(self, event: str, fields: dict) -> None:
        if self.as_json:
            self.line(json.dumps({"event": event, "time": round(time.time(), 3), **fields}))
            return
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        self.line(f"[{event}] {text}")

    def line(self, text: str, file=None) -> None:
        """Print one line as it is (stdout unless `file`)."""
        if self.closed:
            return
        try:
            print(text, file=file or sys.stdout, flush=True)
        except OSError:  # the terminal closed (EIO) or the pipe reader left
            self.closed = True

    def warn(self, message: str) -> None:
        self.line(f"bigmoe: warning: {message}", file=sys.stderr)


def run(opts: RunOptions, as_json: bool = False, steps: Steps | None = None) -> int:
    """The whole run (bigmoe.run's sequence) with progress lines; returns the exit code."""
    say, steps = Printer(as_json), steps or Steps()
    if warning := exposure_warning(opts.host, opts.api_key):
        say.warn(warning)
    preset = steps.load_preset(opts)
    the_plan = sequence.plan(steps, preset, opts, say)
    model_path = sequence.model_ready(steps, preset, the_plan, opts, say)
    launch_server = partial(sequence.launch_server, steps, preset, the_plan, model_path, opts, say)
    return launch_and_serve(launch_server, lambda server: sequence.ready(steps, server, opts, say), opts, say)


def launch_and_serve(
    start: Callable[[], launch.Server], ready: Callable[[launch.Server], None], opts: RunOptions, say: Printer
) -> int:
    """Start the server with the signal handlers in place (a signal during the start acts once its record
    exists), wait until it is `ready`, then serve; the server is stopped on every way out except SIGHUP.
    Returns the exit code."""
    with RunSignals() as signals:
        server = start()
        try:
            signals.started(server)
            ready(server)
            if opts.prompt is not None:
                answer(server, opts, say)
            else:
                watch(server, say)
        except Stop as stop:
            if stop.signum == signal.SIGHUP:
                detach(server)
                return exit_codes.HANGUP
            why = signal.Signals(stop.signum).name
            stop_server(
                server, say, signals, {"pid": server.info.pid, "why": why, "hint": "Ctrl-C again kills it at once"}
            )
            return EXIT_FOR_SIGNAL.get(stop.signum, exit_codes.INTERRUPTED)
        except BaseException:
            stop_server(server, say, signals)
            raise
        stop_server(server, say, signals)
        return exit_codes.OK


def answer(server: launch.Server, opts: RunOptions, say: Printer) -> None:
    result = chat(server.endpoint, server.info.served_name, opts.prompt, opts.max_tokens, api_key=opts.api_key)
    timing = {"tokens": result.tokens, "ttft_ms": round(result.ttft_ms, 2), "tpot_ms": round(result.tpot_ms, 3)}
    if say.as_json:
        say("answer", {"text": result.text, **timing})
    else:
        say.line(result.text)
        say.line(f"TTFT {result.ttft_ms:.1f} ms, TPOT {result.tpot_ms:.2f} ms ({result.tokens} tokens)")


def stop_server(server: launch.Server, say: Printer, signals: RunSignals, stopping: dict | None = None) -> None:
    """Stop the server (a second Ctrl-C meanwhile, even during the `stopping` line, kills its group at once);
    say how it ended."""
    signals.stopping = True
    try:
        if stopping is not None:
            say("stopping", stopping)
        launch.stop(server)
        say("stopped", {"pid": server.info.pid})
    except Killed:
        launch.kill(server)
        say("killed", {"pid": server.info.pid})


def detach(server: launch.Server) -> None:
    """The terminal closed: leave the server running, its record in place, and a line in its log."""
    with records.open_log(Path(server.info.log)) as log:
        log.write(
            f"bigmoe: the terminal of `bigmoe run` closed (SIGHUP); the server keeps running as pid "
            f"{server.info.pid}; `bigmoe ps` lists it, `bigmoe stop {server.info.port}` stops it\n".encode()
        )


def watch(server: launch.Server, say: Printer, every_s: float = STATS_EVERY_S) -> None:
    """Print stats lines until the server stops; return when `bigmoe stop` stopped it, raise when it died.
    Idle windows print one `state=idle` line, not one line per window."""
    from bigmoe.serve.watch import Watcher

    watcher, idle, next_stats = Watcher(server.endpoint), False, time.monotonic()
    while (why := sequence.ended(server)) is None:
        if time.monotonic() >= next_stats:
            next_stats += every_s
            idle = stats_line(watcher, say, idle)
        time.sleep(POLL_S)
    if why == sequence.STOPPED_ELSEWHERE:
        say("stopped", {"by": "bigmoe stop"})
        return
    raise launch.LaunchError(why)


def stats_line(watcher, say: Printer, was_idle: bool) -> bool:
    """One poll: print its window (or `state=idle` once when nothing happens); whether it was idle."""
    try:
        window = watcher.poll()
    except httpx.HTTPError as e:
        say("stats", {"error": f"/metrics did not answer: {e}"})
        return was_idle
    if window is None:
        return was_idle
    if window.idle:
        if not was_idle:
            say("stats", {"state": "idle"})
        return True
    say("stats", window.summary())
    return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(RunOptions(model=sys.argv[1]), as_json=False))
