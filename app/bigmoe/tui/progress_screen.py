"""Screen 2: the model (made or fetched), the paging file, and the server's start-up stages,
with the vLLM log following below. A failed start shows the log at the line it died on."""

from __future__ import annotations

import time
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, ProgressBar, RichLog, Static

from bigmoe.serve.launch import STAGES
from bigmoe.tui.logtail import LogTail, error_index
from bigmoe.tui.messages import ServerReady, ServerStarted, StageReached, StartFailed, StepProgress
from bigmoe.tui.progress_view import describe, finished, fraction
from bigmoe.tui.text import printable

STEP_ROWS = {"model": "model", "fetch": "model", "prepare": "prepare"}
"""Progress event -> the row of the screen it updates."""
STAGE_NAMES = tuple(name for name, _ in STAGES)
TAIL_EVERY_S = 0.5
"""How often the log is followed while the server starts (s)."""
CONTEXT_LINES = 8
"""Lines of the log shown above the error line of a failed start."""


class ProgressScreen(Screen):
    BINDINGS = [Binding("q", "app.quit", "Quit (stops the server)")]
    DEFAULT_CSS = """
    ProgressScreen #steps { height: auto; padding: 1 2 0 2; }
    ProgressScreen ProgressBar { padding: 0 2; height: 1; }
    ProgressScreen #error { height: auto; padding: 0 2; color: $error; text-style: bold; }
    ProgressScreen RichLog { border: round $primary; border-title-align: left; }
    """

    def __init__(self, model_name: str):
        super().__init__()
        self.model_name = model_name
        self.lines = {"model": ("…", "waiting"), "prepare": ("·", "waiting"), "server": ("·", "waiting")}
        self.stages: list[str] = []
        self.server = None
        self.tail: LogTail | None = None
        self.started_at: float | None = None
        self.failed: str | None = None
        self.error_at: int | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield Static(id="steps")
            yield ProgressBar(id="bar", show_eta=False)
            yield Static("", id="error")
            log = RichLog(id="log", wrap=False, highlight=False, markup=False, max_lines=5000)
            log.border_title = "vLLM log"
            yield log
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"bigmoe {self.model_name}"
        self.sub_title = "starting"
        self.query_one("#bar", ProgressBar).display = False
        self.set_interval(TAIL_EVERY_S, self.follow_log)
        self.render_steps()

    # ---- messages from the launch worker ------------------------------------------------

    def on_step_progress(self, message: StepProgress) -> None:
        row = STEP_ROWS.get(message.event, message.event)
        done = finished(message.event, message.fields)
        self.lines[row] = ("✓" if done else "…", describe(message.event, message.fields))
        if row == "model" and done:
            self.lines["prepare"] = ("…", self.lines["prepare"][1])
        bar = self.query_one("#bar", ProgressBar)
        part = fraction(message.event, message.fields)
        bar.display = part is not None and not done
        if part is not None:
            bar.update(total=part[1], progress=part[0])
        self.render_steps()

    def on_server_started(self, message: ServerStarted) -> None:
        self.server = message.server
        self.tail = LogTail(Path(message.server.info.log))
        self.started_at = time.monotonic()
        self.lines["server"] = ("…", f"started (pid {message.server.info.pid}), waiting for /health")
        self.render_steps()

    def on_stage_reached(self, message: StageReached) -> None:
        if message.stage not in self.stages:
            self.stages.append(message.stage)
        self.render_steps()

    def on_server_ready(self, message: ServerReady) -> None:
        self.follow_log()
        self.lines["server"] = ("✓", f"ready at {message.server.endpoint}")
        self.render_steps()
        self.app.show_dashboard(message.server)

    def on_start_failed(self, message: StartFailed) -> None:
        self.failed = message.error
        self.app.start_failed = True
        row = next((r for r, (mark, _) in self.lines.items() if mark == "…"), "server")
        self.lines[row] = ("✗", "failed")
        self.render_steps()
        self.sub_title = "start failed"
        self.query_one("#bar", ProgressBar).display = False
        self.query_one("#error", Static).update(Text(f"{message.error}\nPress q to quit.", style="bold"))
        if message.log_path is not None:
            self.show_log_at_error(Path(message.log_path))

    # ---- rendering --------------------------------------------------------------------

    def render_steps(self) -> None:
        text = Text()
        for row, (mark, line) in self.lines.items():
            style = {"✓": "green", "✗": "bold red", "…": "yellow"}.get(mark, "dim")
            text.append(f" {mark} ", style=style)
            text.append(f"{row:<8} ", style="bold")
            text.append(line + "\n")
        text.append("   stages   ", style="bold")
        reached = set(self.stages)
        last = max((STAGE_NAMES.index(s) for s in reached if s in STAGE_NAMES), default=-1)
        for i, name in enumerate(STAGE_NAMES):
            mark, style = ("✓", "green") if name in reached else (("–", "dim") if i < last else ("·", "dim"))
            text.append(f"{mark} {name}  ", style=style)
        if self.started_at is not None and self.failed is None and self.lines["server"][0] == "…":
            text.append(f"({time.monotonic() - self.started_at:.0f} s)", style="dim")
        self.query_one("#steps", Static).update(text)

    def follow_log(self) -> None:
        if self.tail is None or self.failed is not None:
            return
        lines = self.tail.read_new()
        if lines:
            self.query_one("#log", RichLog).write("\n".join(lines))
        if self.lines["server"][0] == "…":
            self.render_steps()

    def show_log_at_error(self, log_path: Path) -> None:
        """The whole log, its error line (launch.error_line) marked, scrolled so that line is in view."""
        try:
            lines = [printable(line) for line in log_path.read_text(errors="replace").splitlines()]
        except OSError as e:
            lines = [f"(cannot read {log_path}: {e})"]
        self.error_at = error_index(lines, log_path)
        log = self.query_one("#log", RichLog)
        log.clear()
        for i, line in enumerate(lines):
            log.write(Text(line, style="bold white on red" if i == self.error_at else ""))
        log.border_title = f"vLLM log: {log_path.name}" + (
            f", error at line {self.error_at + 1}" if self.error_at is not None else ""
        )
        if self.error_at is not None:
            log.auto_scroll = False
            self.call_after_refresh(log.scroll_to, y=max(0, self.error_at - CONTEXT_LINES), animate=False)
