"""Screen 3: the live server. TPOT and tok/s sparklines, hit rate per tier, per-layer residency and
hit rate, the endpoint with a curl line, a chat box, and the vLLM log. q stops the server (app)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, RichLog, Sparkline, Static

from bigmoe.tui.chat import ChatBox
from bigmoe.tui.dashboard_view import (
    History,
    endpoint_text,
    layers_table,
    log_lines_to_show,
    rate_title,
    speed_title,
    tiers_table,
)
from bigmoe.tui.logtail import LogTail
from bigmoe.tui.messages import ChatAnswered, StatsPolled
from bigmoe.tui.worker import Session, poll


class Dashboard(Screen):
    BINDINGS = [
        Binding("q", "app.quit", "Quit (stops the server)"),
        Binding("c", "chat", "Chat"),
        Binding("escape", "leave_chat", "Leave chat"),
        Binding("r", "poll", "Refresh now"),
    ]
    AUTO_FOCUS = ""  # q must quit at once; c (or a click) enters the chat box, esc leaves it
    DEFAULT_CSS = """
    Dashboard #endpoint { height: auto; padding: 0 1; }
    Dashboard #charts { height: 7; }
    Dashboard .panel { border: round $primary; border-title-align: left; }
    Dashboard .chart { width: 1fr; }
    Dashboard Sparkline { height: 1fr; }
    Dashboard #tiers { width: 1fr; }
    Dashboard #middle { height: 11; }
    Dashboard #layers { width: 1fr; }
    Dashboard ChatBox { width: 1fr; }
    Dashboard #status { height: auto; padding: 0 1; }
    Dashboard RichLog { height: 1fr; }
    """

    def __init__(self, session: Session, server, plan, poll_s: float):
        super().__init__()
        self.session = session
        self.server = server
        self.plan = plan
        self.poll_s = poll_s
        self.history = History()
        self.watcher = session.steps.watcher(server.endpoint)
        self.tail = LogTail(Path(server.info.log))
        self.polling = False
        self.gone: str | None = None
        self.crashed = False
        self.live = False
        """True once mounted: its widgets exist and polling has begun."""

    def compose(self) -> ComposeResult:
        info = self.server.info
        yield Header()
        yield Static(
            endpoint_text(self.server.endpoint, info.served_name, info.pid, self.plan, self.session.opts.api_key),
            id="endpoint",
        )
        with Horizontal(id="charts"):
            with Vertical(id="tpot-panel", classes="panel chart"):
                yield Sparkline([], id="tpot")
            with Vertical(id="rate-panel", classes="panel chart"):
                yield Sparkline([], id="rate")
            yield Static(id="tiers", classes="panel")
        with Horizontal(id="middle"):
            yield Static(id="layers", classes="panel")
            yield ChatBox(id="chat")
        yield Static("", id="status")
        log = RichLog(id="log", classes="panel", wrap=False, highlight=False, markup=False, max_lines=2000)
        log.border_title = f"vLLM log ({Path(info.log).name})"
        yield log
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"bigmoe {self.session.preset.name}"
        self.sub_title = "serving"
        self.query_one("#tiers").border_title = "hit rate per tier"
        self.query_one("#layers").border_title = "per layer: hit rate (slots/experts)"
        self.show_history()
        self.set_interval(self.poll_s, self.action_poll)
        self.action_poll()
        self.live = True

    # ---- polling ----------------------------------------------------------------------

    def action_poll(self) -> None:
        if self.polling or self.gone is not None or self.session.quitting:
            return
        self.polling = True
        self.run_worker(
            partial(poll, self.watcher, self.server, self.tail, self.post_message),
            thread=True,
            group="poll",
            name="poll",
        )

    def on_stats_polled(self, message: StatsPolled) -> None:
        self.polling = False
        shown = log_lines_to_show(message.log_lines)
        if shown:
            self.query_one("#log", RichLog).write("\n".join(shown))
        if message.window is not None:
            self.history.add(message.window)
            self.show_history()
        status = self.query_one("#status", Static)
        if message.exited is not None:
            self.gone = message.exited
            self.crashed = self.server.runfile.exists()  # `bigmoe stop` removes it; a crash leaves it
            self.sub_title = "server gone"
            status.update(Text(message.exited + "  (q quits)", style="bold red"))
        else:
            status.update(Text(message.error, style="yellow") if message.error else "")

    def show_history(self) -> None:
        h = self.history
        self.query_one("#tpot", Sparkline).data = list(h.tpot_ms)
        self.query_one("#rate", Sparkline).data = list(h.tokens_per_s)
        self.query_one("#tpot-panel").border_title = speed_title(h)
        self.query_one("#rate-panel").border_title = rate_title(h)
        self.query_one("#tiers", Static).update(tiers_table(h, self.plan))
        self.query_one("#layers", Static).update(layers_table(h, self.plan))

    # ---- chat -------------------------------------------------------------------------

    def action_chat(self) -> None:
        self.query_one("#prompt").focus()

    def action_leave_chat(self) -> None:
        self.set_focus(None)

    def on_chat_box_send(self, message: ChatBox.Send) -> None:
        self.run_worker(
            partial(self.session.chat, message.prompt, self.post_message), thread=True, group="chat", name="chat"
        )

    def on_chat_answered(self, message: ChatAnswered) -> None:
        chat = self.query_one(ChatBox)
        if message.result is not None:
            chat.show_answer(message.result)
            self.action_poll()  # the answer's tokens are in /metrics now
        else:
            chat.show_error(message.error)
