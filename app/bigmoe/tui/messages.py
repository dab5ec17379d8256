"""Typed messages the worker threads post to the screens (Textual's post_message is thread-safe)."""

from __future__ import annotations

from textual.message import Message


class PlanMade(Message):
    """A (re-)plan finished: a plan, or the one line that says why there is none."""

    def __init__(self, hardware, plan, error: str | None, generation: int):
        super().__init__()
        self.hardware = hardware
        """The machine the plan was made for (None when probing failed)."""
        self.plan = plan
        """The Plan, or None when the overrides made no sense."""
        self.error = error
        """Why there is no plan (PlanError's line), else None."""
        self.generation = generation
        """Which edit of the form this answers; older answers are dropped."""


class StepProgress(Message):
    """A pipeline step reported progress (the same events the headless shell prints)."""

    def __init__(self, event: str, fields: dict):
        super().__init__()
        self.event = event
        """"model", "fetch" or "prepare"."""
        self.fields = fields
        """What the step said, e.g. {"state": "ready", "path": ...}."""


class ServerStarted(Message):
    """vLLM was started (not yet ready); its log can be followed now."""

    def __init__(self, server):
        super().__init__()
        self.server = server
        """The launch.Server."""


class StageReached(Message):
    """The server's log shows it reached a start-up stage (launch.STAGES)."""

    def __init__(self, stage: str):
        super().__init__()
        self.stage = stage
        """Stage name, e.g. "weights"."""


class ServerReady(Message):
    """/health answered 200."""

    def __init__(self, server):
        super().__init__()
        self.server = server
        """The launch.Server."""


class StartFailed(Message):
    """A step before "ready" failed; the server (if any) is already stopped."""

    def __init__(self, error: str, log_path):
        super().__init__()
        self.error = error
        """The failure in one line."""
        self.log_path = log_path
        """The server's log (None when it never started)."""


class StatsPolled(Message):
    """One poll of /metrics and of the log."""

    def __init__(self, window, error: str | None, log_lines: list[str], exited: str | None):
        super().__init__()
        self.window = window
        """The watch.Window since the previous poll, or None when /metrics did not answer."""
        self.error = error
        """Why there is no window, else None."""
        self.log_lines = log_lines
        """Lines appended to the server's log since the last poll."""
        self.exited = exited
        """Set when the server process has exited: its exit code and error line."""


class ChatAnswered(Message):
    """The chat box's request came back."""

    def __init__(self, result, error: str | None):
        super().__init__()
        self.result = result
        """The client.ChatResult, or None on failure."""
        self.error = error
        """Why it failed, else None."""


class ServerStopped(Message):
    """The server was stopped (on quit); the app may exit now."""

    def __init__(self, error: str | None):
        super().__init__()
        self.error = error
        """Why stopping failed, else None."""
