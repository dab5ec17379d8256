"""Snapshots of the plan screen and the dashboard at 120x40, compared with the SVGs committed in
tests/snapshots/. Everything on screen is fixed data: a stated machine (no probe), the real
planner, and the fake pipeline's server, /metrics windows and chat answer (tui_fakes); no clock
is shown. After a deliberate change of the screens, rewrite them with BIGMOE_UPDATE_SNAPSHOTS=1
and look at the new SVGs before committing them."""

from __future__ import annotations

import html
import os
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
from bigmoe import run as sequence
from bigmoe.model import presets
from bigmoe.tui.app import BigmoeApp
from bigmoe.tui.dashboard import Dashboard
from test_tui_flow import SIZE, drive, planned, until
from textual.widgets import Footer
from textual.widgets._footer import FooterKey
from tui_fakes import HOME, WINDOWS, FakePipeline, cpu_machine, gpu_machine

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
UPDATE = os.environ.get("BIGMOE_UPDATE_SNAPSHOTS") == "1"


@pytest.fixture(autouse=True)
def fixed_dirs(monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", HOME)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", "/home/user/.cache/huggingface/hub")
    # The vLLM command line starts with this environment's Python: a checkout's own path, whose length moved the
    # plan screen's wrapping (and its scroll bar) between a clone and another.
    monkeypatch.setattr(sys, "executable", "/home/user/bigmoe/.venv/bin/python")


def in_svg(text: str) -> str:
    """`text` as Rich writes it into an SVG screenshot (within one style run)."""
    return html.escape(text).replace(" ", "&#160;")


def matches_snapshot(svg: str, name: str, tmp_path: Path) -> None:
    path = SNAPSHOTS / f"{name}.svg"
    if UPDATE:
        path.write_text(svg)
    if not path.exists():
        raise AssertionError(f"no snapshot {path}; make it with BIGMOE_UPDATE_SNAPSHOTS=1 and review it")
    if path.read_text() != svg:
        got = tmp_path / f"{name}.svg"
        got.write_text(svg)
        raise AssertionError(
            f"{name} differs from {path}; this run's screen is {got} "
            f"(BIGMOE_UPDATE_SNAPSHOTS=1 rewrites the snapshot if the change is meant)"
        )


def footer_keys_shown(screen) -> bool:
    """Whether the screen's footer holds a key for each shown binding: Textual rebuilds the footer
    after a focus change (remove, then mount), and a screenshot between the two has an empty footer."""
    shown = {binding.action for _, binding, _, _ in screen.active_bindings.values() if binding.show}
    keys = screen.query_one(Footer).query(FooterKey)
    return {key.action for key in keys} == shown


async def settled_screenshot(pilot, timeout_s: float = 5.0) -> str:
    """The screen once two screenshots 20 ms apart agree and the footer is whole; a loaded CI worker can
    leave a footer rebuild pending across one pause."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        await pilot.pause(0.02)
        shot = pilot.app.export_screenshot(title="bigmoe")
        if shot == last and footer_keys_shown(pilot.app.screen):
            return shot
        if time.monotonic() > deadline:
            raise AssertionError("the screen did not settle within 5 s (footer rebuilding or content changing)")
        last = shot


def screenshot_twice(make_app, scenario) -> list[str]:
    """Two independent runs of the same scenario, each ending in a settled screenshot."""
    shots = []

    async def shoot(pilot):
        await scenario(pilot)
        pilot.app.set_focus(None)
        shots.append(await settled_screenshot(pilot))

    for _ in range(2):
        drive(make_app(), shoot)
    return shots


def test_plan_screen_snapshot(tmp_path):
    """The reference job on the reference desktop: qwen3.8-flash-next on an RTX 4090 with 64 GiB."""
    fake = FakePipeline(tmp_path, gpu_machine())

    def make_app():
        opts = sequence.RunOptions(model="qwen3.8-flash-next", paging_dir="/srv/paging")
        return BigmoeApp(presets.load("qwen3.8-flash-next"), opts, fake.steps(), poll_s=3600)

    shots = screenshot_twice(make_app, planned)
    assert shots[0] == shots[1], "the plan screen must render the same twice"
    for text in ("NVIDIA GeForce RTX 4090", "Safe to launch", "VRAM slots", "paging dir", "/srv/paging"):
        assert in_svg(text) in shots[0], text
    matches_snapshot(shots[0], "plan_screen", tmp_path)


def test_dashboard_snapshot(tmp_path):
    """tiny-moe with 6 VRAM and 10 RAM slots per layer, after every fake window and one chat answer."""
    fake = FakePipeline(tmp_path, cpu_machine(24))

    def make_app():
        fake.tmp = Path(tmp_path)
        opts = sequence.RunOptions(model="tiny-moe", port=8123, vram_slots=6, ram_slots=10)
        return BigmoeApp(presets.load("tiny-moe"), opts, fake.steps(), poll_s=3600)

    async def serve_and_chat(pilot):
        await planned(pilot)
        await pilot.press("l")
        await until(pilot, lambda: isinstance(pilot.app.screen, Dashboard) and pilot.app.screen.live)
        dash = pilot.app.screen
        for _ in WINDOWS:
            await until(pilot, lambda: not dash.polling)
            dash.action_poll()
        await until(pilot, lambda: not dash.polling)
        await pilot.press("c", *"Tell me about the sea.", "enter")
        await until(pilot, lambda: dash.query_one("#chat").last_result is not None and not dash.polling)

    shots = screenshot_twice(make_app, serve_and_chat)
    assert shots[0] == shots[1], "the dashboard must render the same twice"
    for text in ("TPOT 10.00 ms", "tok/s 87.0", "hit rate per tier", "curl -s http://127.0.0.1:8123", "TTFT 41 ms"):
        assert in_svg(text) in shots[0], text
    matches_snapshot(shots[0], "dashboard", tmp_path)
