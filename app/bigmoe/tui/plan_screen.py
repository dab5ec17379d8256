"""Screen 1: the machine and the plan before anything loads, with the choices a person may change.

Every edit re-plans (in a worker thread, since a new directory means probing its disk); the plan
on the right shows every number with its reason, and refusals on top. Launch (l) starts the run;
a refused plan needs the explicit confirmation of ForceScreen."""

from __future__ import annotations

import dataclasses
from functools import partial

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static

from bigmoe.errors import BigmoeError
from bigmoe.tui.force_screen import ForceScreen
from bigmoe.tui.messages import PlanMade
from bigmoe.tui.plan_view import machine_lines, plan_renderable
from bigmoe.tui.worker import Session, one_line

NUMBER_FIELDS = {"vram_slots": "VRAM slots", "ram_slots": "RAM slots", "context": "context"}
"""Form fields that hold a whole number (blank = planned) and their labels."""
PATH_FIELDS = {
    "model_dir": ("model dir", "blank: fetch or make it"),
    "paging_dir": ("paging dir", "blank: bigmoe's cache"),
}
"""Form fields that hold a directory (blank = default): label and placeholder."""
COMPRESS_OPTIONS = [("auto (planned)", "auto"), ("on", "on"), ("off", "off")]


def read_form(texts: dict[str, str], compress: str) -> tuple[dict, list[str]]:
    """The form's text as RunOptions edits, and one line per field that is not valid."""
    edits: dict = {"compress": None if compress == "auto" else compress}
    errors = []
    for name, label in NUMBER_FIELDS.items():
        text = texts.get(name, "").strip()
        if not text:
            edits[name] = None
        elif text.isdigit() and int(text) > 0:
            edits[name] = int(text)
        else:
            errors.append(f"{label}: {text!r} is not a positive whole number")
    for name in PATH_FIELDS:
        edits[name] = texts.get(name, "").strip() or None
    return edits, errors


class PlanScreen(Screen):
    BINDINGS = [
        Binding("l", "launch", "Launch"),
        Binding("q", "app.quit", "Quit"),
        Binding("escape", "leave_field", "Leave field"),
    ]
    AUTO_FOCUS = ""  # keys l and q work at once; a click (or tab) enters a field, enter or esc leaves it
    DEFAULT_CSS = """
    PlanScreen #left { width: 42; padding: 0 1; }
    PlanScreen #machine { height: 7; }  /* fixed, so the form does not move when the probe answers */
    PlanScreen #form { grid-size: 2; grid-columns: 12 1fr; grid-rows: 1; grid-gutter: 0 0; height: auto; }
    PlanScreen #form Label { padding: 0 0; }
    PlanScreen #status { height: auto; margin: 1 0; }
    PlanScreen #buttons { height: auto; }
    PlanScreen #buttons Button { margin-right: 1; }
    PlanScreen #plan-scroll { border-left: solid $primary; padding: 0 1; }
    """

    def __init__(self, session: Session):
        super().__init__()
        self.session = session
        self.generation = 0
        self.answered = -1
        self.hardware = None
        self.plan = None
        self.plan_error: str | None = None
        self.form_errors: list[str] = []
        self.edits: dict = {}

    def compose(self) -> ComposeResult:
        opts = self.session.opts
        yield Header()
        with Horizontal():
            with Vertical(id="left"):
                yield Static("Probing the machine...", id="machine")
                yield Static("[b]Your choices[/b] (blank = as planned)")
                with Grid(id="form"):
                    for name, label in NUMBER_FIELDS.items():
                        value = getattr(opts, name)
                        yield Label(label)
                        yield Input("" if value is None else str(value), placeholder="planned", id=name, compact=True)
                    yield Label("compress")
                    yield Select(
                        COMPRESS_OPTIONS, value=opts.compress or "auto", allow_blank=False, id="compress", compact=True
                    )
                    for name, (label, placeholder) in PATH_FIELDS.items():
                        yield Label(label)
                        yield Input(getattr(opts, name) or "", placeholder=placeholder, id=name, compact=True)
                yield Static("", id="status")
                with Horizontal(id="buttons"):
                    yield Button("Launch (l)", id="launch", variant="success", disabled=True)
                    yield Button("Quit (q)", id="quit")
            with VerticalScroll(id="plan-scroll"):
                yield Static("Planning...", id="plan")
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"bigmoe {self.session.preset.name}"
        self.sub_title = "machine and plan"
        self.replan()

    # ---- re-plan on every edit --------------------------------------------------------

    @on(Input.Changed)
    @on(Select.Changed)
    def replan(self) -> None:
        texts = {name: self.query_one(f"#{name}", Input).value for name in (*NUMBER_FIELDS, *PATH_FIELDS)}
        compress = self.query_one("#compress", Select).value
        self.edits, self.form_errors = read_form(texts, str(compress))
        self.generation += 1
        if self.form_errors:
            self.show_status()
            return
        self.run_worker(
            partial(self.session.replan, dict(self.edits), self.generation, self.post_message),
            thread=True,
            group="plan",
            name="replan",
        )
        self.show_status()

    @on(Input.Submitted)
    def action_leave_field(self) -> None:
        self.set_focus(None)

    def on_plan_made(self, message: PlanMade) -> None:
        if message.generation != self.generation:
            return  # answers an older edit
        self.answered = message.generation
        self.hardware, self.plan, self.plan_error = message.hardware, message.plan, message.error
        if message.hardware is not None:
            self.query_one("#machine", Static).update(machine_lines(message.hardware))
        plan_view = self.query_one("#plan", Static)
        plan_view.update(
            plan_renderable(message.plan) if message.plan is not None else f"[b red]No plan:[/] {message.error}"
        )
        self.show_status()

    @property
    def stale(self) -> bool:
        """True while the shown plan does not answer the form as it is now."""
        return self.answered != self.generation

    def show_status(self) -> None:
        status = self.query_one("#status", Static)
        launch = self.query_one("#launch", Button)
        if self.form_errors:
            status.update("[b red]" + "\n".join(self.form_errors) + "[/]")
        elif self.plan_error is not None and self.plan is None:
            status.update(f"[b red]{self.plan_error}[/]")
        elif self.plan is not None and self.plan.refusals:
            status.update("[b red]Refused[/] (launching needs confirmation)")
        elif self.plan is not None:
            status.update("[green]Ready to launch[/]")
        launch.disabled = bool(self.form_errors) or self.plan is None

    # ---- launch -----------------------------------------------------------------------

    @on(Button.Pressed, "#launch")
    def action_launch(self) -> None:
        if self.form_errors or self.plan is None:
            self.notify("There is no valid plan to launch; fix the fields marked in red.", severity="error")
            return
        if self.stale:
            self.notify("Still re-planning; press l again in a moment.")
            return
        if self.plan.refusals and not self.plan.forced:
            self.app.push_screen(ForceScreen(self.plan.refusals), self._forced)
            return
        self.app.start_run(self.plan, self.session.options_with(self.edits))

    def _forced(self, confirmed: bool | None) -> None:
        if not confirmed:
            self.notify("Not launched: the plan stays refused.")
            return
        opts = dataclasses.replace(self.session.options_with(self.edits), force=True)
        try:
            forced_plan = self.session.steps.make_plan(self.session.hardware_for(opts), self.session.preset, opts)
        except (BigmoeError, ValueError, OSError) as e:  # the same plan was made a moment ago; show whatever changed
            self.notify(one_line(e), severity="error")
            return
        self.app.start_run(forced_plan, opts)

    @on(Button.Pressed, "#quit")
    def quit_pressed(self) -> None:
        self.app.action_quit()
