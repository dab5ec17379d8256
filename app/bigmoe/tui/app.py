"""The Textual app of `bigmoe run`: plan screen -> progress screen -> dashboard.

The same pipeline steps as `--yes` (bigmoe.run), run in worker threads. Quitting
(q, or Ctrl+Q) at any point stops the server if one was started, then exits; the exit code
is 0, or EXIT_START_FAILED when the server did not come up, or 1 when it died or would not stop."""

from __future__ import annotations

import sys
import threading

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from bigmoe import exit_codes
from bigmoe.run import RunOptions, Steps
from bigmoe.tui.dashboard import Dashboard
from bigmoe.tui.messages import ServerStopped
from bigmoe.tui.plan_screen import PlanScreen
from bigmoe.tui.progress_screen import ProgressScreen
from bigmoe.tui.worker import Session

EXIT_OK = exit_codes.OK
EXIT_START_FAILED = exit_codes.START_FAILED
EXIT_SERVER_LOST = exit_codes.ERROR
"""The server died while serving (not stopped by `bigmoe stop`), or could not be stopped."""
POLL_S = 2.0
"""Seconds between dashboard polls of /metrics and the log."""


class StoppingScreen(Screen):
    """Shown while the server is being stopped (SIGTERM to its group can take seconds)."""

    def compose(self):
        yield Header()
        yield Static("Stopping the server...", id="stopping")
        yield Footer()


class BigmoeApp(App[int]):
    TITLE = "bigmoe"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True, show=False)]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, preset, opts: RunOptions, steps: Steps | None = None, poll_s: float = POLL_S):
        super().__init__()
        self.session = Session(steps or Steps(), preset, opts)
        self.poll_s = poll_s
        self.plan = None
        self.start_failed = False
        self.server_lost = False
        self.stopping = False
        self.exit_message: str | None = None

    def on_mount(self) -> None:
        self.push_screen(PlanScreen(self.session))

    # ---- the run's screens ------------------------------------------------------------

    def start_run(self, plan, opts: RunOptions) -> None:
        """Leave the plan screen: make or fetch the model, prepare, start the server."""
        screen = ProgressScreen(self.session.preset.name)
        self.switch_screen(screen)
        self.plan = plan
        # A daemon thread, not a Textual worker: quitting must not wait for a download to finish
        # (asyncio waits for its executor's threads at exit); a fetch resumes on the next run.
        threading.Thread(
            target=self.session.launch, args=(plan, opts, screen.post_message), name="bigmoe-launch", daemon=True
        ).start()

    def show_dashboard(self, server) -> None:
        if self.stopping:
            return
        self.switch_screen(Dashboard(self.session, server, self.plan, self.poll_s))

    # ---- quitting ---------------------------------------------------------------------

    def action_quit(self) -> None:
        """Stop the server (in a thread: it may take seconds), then exit."""
        if self.stopping:
            return
        self.stopping = True
        if isinstance(self.screen, Dashboard) and self.screen.crashed:
            self.server_lost = True
        self.push_screen(StoppingScreen())
        self.run_worker(self._stop, thread=True, group="stop", name="stop")

    def _stop(self) -> None:
        self.post_message(ServerStopped(self.session.stop()))

    def on_server_stopped(self, message: ServerStopped) -> None:
        if message.error is not None:
            self.exit_message = message.error
        self.exit(self.exit_code(message.error), return_code=self.exit_code(message.error))

    def exit_code(self, stop_error: str | None) -> int:
        if stop_error is not None or self.server_lost:
            return EXIT_SERVER_LOST
        if self.start_failed:
            return EXIT_START_FAILED
        return EXIT_OK


def run_tui(opts: RunOptions, steps: Steps | None = None) -> int:
    """Run the TUI for these options; returns the process exit code.

    The preset is read before the screen opens, so an unknown model is the same one line
    as with --yes (raised to the CLI's handler)."""
    steps = steps or Steps()
    preset = steps.load_preset(opts)
    app = BigmoeApp(preset, opts, steps)
    try:
        code = app.run()
    finally:
        app.session.stop()  # a no-op after q; stops the server if the app ended any other way
    if app.exit_message:
        print(f"bigmoe: {app.exit_message}", file=sys.stderr)
    return code if isinstance(code, int) else app.return_code or EXIT_OK
