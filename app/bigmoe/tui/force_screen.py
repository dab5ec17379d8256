"""The explicit confirmation a refused plan needs before it is launched (the TUI's --force)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ForceScreen(ModalScreen[bool]):
    """Shows why the plan was refused; dismisses with True only on "Launch anyway" (or f)."""

    BINDINGS = [Binding("f", "force", "Launch anyway"), Binding("escape,n", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ForceScreen { align: center middle; }
    ForceScreen > Vertical { width: 80; height: auto; border: thick $error; background: $surface; padding: 1 2; }
    ForceScreen #refusals { margin-bottom: 1; }
    ForceScreen Horizontal { height: auto; }
    ForceScreen Button { margin-right: 2; }
    """

    def __init__(self, refusals: tuple[str, ...]):
        super().__init__()
        self.refusals = refusals

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("[b]The estimator refused this plan:[/b]")
            yield Static("\n".join(f"- {r}" for r in self.refusals), id="refusals", markup=False)
            yield Static("Launching it anyway may run out of memory or disk. Launch anyway?")
            with Horizontal():
                yield Button("Launch anyway (f)", id="force", variant="error")
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "force")

    def action_force(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)
