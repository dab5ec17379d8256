"""A small chat box on the dashboard: one prompt at a time, the answer with its TTFT and TPOT."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Static

from bigmoe.tui.text import printable


class ChatBox(Vertical):
    """Input for a prompt; posts ChatBox.Send, and shows what `show_answer`/`show_error` are given."""

    DEFAULT_CSS = """
    ChatBox { border: round $primary; border-title-align: left; }
    ChatBox #answer-scroll { height: 1fr; }
    ChatBox #timing { height: 1; color: $text-muted; }
    """

    class Send(Message):
        """The person asked something."""

        def __init__(self, prompt: str):
            super().__init__()
            self.prompt = prompt
            """The text typed."""

    def __init__(self, id: str | None = None):
        super().__init__(id=id)
        self.border_title = "chat (enter sends)"
        self.busy = False
        self.prompt = ""
        self.last_result = None

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Ask the model something", id="prompt", compact=True)
        with VerticalScroll(id="answer-scroll"):
            yield Static("", id="answer")
        yield Static("", id="timing")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        prompt = event.value.strip()
        if not prompt or self.busy:
            return
        self.busy = True
        self.prompt = prompt
        self.query_one("#prompt", Input).value = ""
        self.query_one("#answer", Static).update(Text(f"> {prompt}", style="bold"))
        self.query_one("#timing", Static).update("waiting for the answer...")
        self.post_message(self.Send(prompt))

    def show_answer(self, result) -> None:
        self.busy = False
        self.last_result = result
        self.query_one("#answer", Static).update(
            Text.assemble((f"> {self.prompt}\n", "bold"), printable(result.text.strip()))
        )
        self.query_one("#timing", Static).update(
            f"TTFT {result.ttft_ms:.0f} ms, TPOT {result.tpot_ms:.2f} ms, {result.tokens} tokens"
        )

    def show_error(self, error: str) -> None:
        self.busy = False
        self.query_one("#timing", Static).update(Text(printable(error), style="bold red"))
