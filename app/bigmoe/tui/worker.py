"""The blocking parts of the run (bigmoe.run's steps, polls, chat) as plain functions that Textual runs in
worker threads; they report through `post` (a thread-safe
post_message) with the typed messages of bigmoe.tui.messages.

A Session holds what one `bigmoe run` has decided and started, so that quitting at any
moment stops the server it may have started, exactly once."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Callable

import httpx

from bigmoe import run as sequence
from bigmoe.errors import BigmoeError
from bigmoe.run import RunOptions, Steps
from bigmoe.tui.logtail import LogTail
from bigmoe.tui.messages import (
    ChatAnswered,
    PlanMade,
    ServerReady,
    ServerStarted,
    StageReached,
    StartFailed,
    StatsPolled,
    StepProgress,
)

Post = Callable[[object], object]
"""Thread-safe delivery of a message to a screen (its post_message)."""

EDITABLE = ("vram_slots", "ram_slots", "compress", "context", "model_dir", "paging_dir")
"""RunOptions fields the plan screen edits."""


PROGRESS_EVENTS = ("model", "fetch", "prepare")
"""Events of bigmoe.run's steps the progress screen shows as rows (stages have their own message)."""


def one_line(error: BaseException) -> str:
    """A failure as one line: the message of an error the user can act on, else its type and message."""
    if isinstance(error, (BigmoeError, ValueError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


class Session:
    """One run: its preset and options, the machines probed so far, and the server once started."""

    def __init__(self, steps: Steps, preset, opts: RunOptions):
        self.steps = steps
        self.preset = preset
        self.opts = opts
        self.server = None
        self.quitting = False
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._probed: dict[tuple, object] = {}

    # ---- plan -------------------------------------------------------------------------

    def options_with(self, edits: dict) -> RunOptions:
        unknown = set(edits) - set(EDITABLE)
        if unknown:
            raise ValueError(f"not an editable plan field: {sorted(unknown)}")
        return dataclasses.replace(self.opts, **edits)

    def hardware_for(self, opts: RunOptions):
        """The probed machine for these directories (probed once per pair of directories)."""
        key = (opts.model_dir, opts.paging_dir)
        with self._probe_lock:  # edits re-plan in parallel threads; the disks are probed once
            if key not in self._probed:
                self._probed[key] = self.steps.probe_machine(self.preset, opts)
            return self._probed[key]

    def replan(self, edits: dict, generation: int, post: Post) -> None:
        """Plan with the form's values; post PlanMade with the plan or the reason there is none."""
        opts = self.options_with(edits)
        hardware = None
        try:
            hardware = self.hardware_for(opts)
            the_plan = self.steps.make_plan(hardware, self.preset, opts)
        except (BigmoeError, ValueError, OSError) as e:
            post(PlanMade(hardware, None, one_line(e), generation))
            return
        post(PlanMade(hardware, the_plan, None, generation))

    # ---- launch -----------------------------------------------------------------------

    def launch(self, the_plan, opts: RunOptions, post: Post) -> None:
        """bigmoe.run's model -> prepare -> launch -> ready; posts progress, then ServerReady or StartFailed."""
        self.opts = opts
        server = None

        def say(event: str, fields: dict) -> None:
            if event == "stage":
                post(StageReached(fields["stage"]))
            elif event in PROGRESS_EVENTS:
                post(StepProgress(event, dict(fields)))

        try:
            model_path = sequence.model_ready(self.steps, self.preset, the_plan, opts, say)
            with self._lock:
                if self.quitting:
                    return
                server = self.server = sequence.launch_server(self.steps, self.preset, the_plan, model_path, opts, say)
            post(ServerStarted(server))
            sequence.ready(self.steps, server, opts, say)
        except Exception as e:  # every failure of a start is shown, and a started server stopped
            if self.quitting:
                return
            if server is not None:
                self._stop_quietly(server)
            post(StartFailed(one_line(e), Path(server.info.log) if server is not None else None))
            return
        post(ServerReady(server))

    def stop(self) -> str | None:
        """Stop the server if one was started (once); no more starts after this. Returns an error line or None."""
        with self._lock:
            self.quitting = True
            server, self.server = self.server, None
        if server is None:
            return None
        try:
            self.steps.stop(server)
        except (BigmoeError, OSError) as e:
            return f"could not stop the server (pid {server.info.pid}): {one_line(e)}"
        return None

    def _stop_quietly(self, server) -> None:
        with self._lock:
            if self.server is server:
                self.server = None
        try:
            self.steps.stop(server)
        except (BigmoeError, OSError):
            pass

    # ---- serving ----------------------------------------------------------------------

    def chat(self, prompt: str, post: Post) -> None:
        server = self.server
        if server is None:
            post(ChatAnswered(None, "the server is not running"))
            return
        try:
            result = self.steps.chat(
                server.endpoint, server.info.served_name, prompt, self.opts.max_tokens, api_key=self.opts.api_key
            )
        except (BigmoeError, httpx.HTTPError, ValueError) as e:
            post(ChatAnswered(None, one_line(e)))
            return
        post(ChatAnswered(result, None))


def poll(watcher, server, tail: LogTail, post: Post) -> None:
    """One dashboard refresh: a /metrics window, the new log lines, and whether the server is gone."""
    window, error = None, None
    exited = sequence.ended(server)
    if exited is None and not server.runfile.exists():
        exited = sequence.STOPPED_ELSEWHERE
    if exited is None:
        try:
            window = watcher.poll()
        except (httpx.HTTPError, ValueError) as e:
            error = f"/metrics did not answer: {one_line(e)}"
    post(StatsPolled(window, error, tail.read_new(), exited))
