"""The TUI end to end against real vLLM (CPU build) with the tiny model, driven by Textual's pilot:
the plan edited (6 VRAM and 10 RAM slots of tiny-moe's 16 experts per layer) and launched, the
dashboard live (non-zero TPOT once the chat box has an answer), then q stops the server and
leaves no process of its group behind.

BIGMOE_TUI_SCREENSHOT=PATH also saves the dashboard's SVG there (docs/img/dashboard.svg is made so)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from bigmoe.model import presets
from bigmoe.run import RunOptions
from bigmoe.serve import launch
from bigmoe.tui.app import BigmoeApp
from bigmoe.tui.dashboard import Dashboard
from bigmoe.tui.plan_screen import PlanScreen

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="real vLLM (installer/install.sh) is needed for e2e tests")

PROMPTS = ("Tell me about the sea.", "And about rivers?", "Name a mountain.")
START_S = 240.0
"""Most seconds for the tiny model to be made and vLLM CPU to answer /health on a loaded machine."""


async def until(pilot, condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f} s waiting for {what} (screen: {type(pilot.app.screen).__name__})"
            )
        await pilot.pause(0.1)


async def type_into(pilot, field: str, text: str) -> None:
    await pilot.click(f"#{field}")
    await pilot.press(*text, "enter")


def group_members(pgid: int) -> list[str]:
    """'pid state name' of every process in the group (zombies included)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name, rest = (entry / "stat").read_text().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            if int(fields[2]) == pgid:
                out.append(f"{entry.name} {fields[0]} {name.split('(', 1)[1]}")
    return out


def group_gone(pgid: int, wait_s: float = 0.0) -> bool:
    """True once no process of the group exists; waits up to wait_s for init to reap the
    engine processes the server's exit orphaned (they die with it but linger as zombies briefly)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def test_tui_plans_launches_chats_and_quits_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", str(tmp_path / "home"))
    port = launch.free_port()
    opts = RunOptions(model="tiny-moe", port=port, max_tokens=24, start_timeout=START_S)
    app = BigmoeApp(presets.load("tiny-moe"), opts, poll_s=1.0)
    seen: dict = {}

    async def scenario(pilot):
        await until(
            pilot,
            lambda: isinstance(pilot.app.screen, PlanScreen) and pilot.app.screen.plan is not None,
            60,
            "the first plan",
        )
        await pilot.pause()
        await type_into(pilot, "vram_slots", "6")
        await type_into(pilot, "ram_slots", "10")
        plan_screen = pilot.app.screen
        await until(
            pilot,
            lambda: not plan_screen.stale and plan_screen.plan is not None and plan_screen.plan.ram_slots == 10,
            30,
            "the re-plan",
        )
        seen["plan"] = plan_screen.plan
        await pilot.press("l")
        await until(
            pilot,
            lambda: isinstance(pilot.app.screen, Dashboard) and pilot.app.screen.live or pilot.app.start_failed,
            START_S + 10,
            "the dashboard",
        )
        assert not pilot.app.start_failed, f"the server did not start: {pilot.app.screen.failed}"
        dash = pilot.app.screen
        seen["pid"], seen["info"] = dash.server.info.pid, dash.server.info
        seen["runfile"] = dash.server.runfile
        chat = dash.query_one("#chat")
        await pilot.press("c")
        for prompt in PROMPTS:  # a few answers, a poll apart, so the sparklines have a history
            windows, before = len(dash.history.tokens_per_s), chat.last_result
            await pilot.press(*prompt, "enter")
            await until(pilot, lambda: not chat.busy, 120, f"the answer to {prompt!r}")
            assert chat.last_result is not before, f"the chat failed: {dash.query_one('#timing').render()}"
            await until(pilot, lambda: len(dash.history.tokens_per_s) >= windows + 2, 30, "two more polls")
        seen["answer"] = chat.last_result
        await pilot.press("escape")
        await until(
            pilot,
            lambda: (dash.history.last_tpot_ms or 0) > 0 and dash.history.tier_hit,
            30,
            "a window with TPOT and hit rates",
        )
        await pilot.pause(0.5)
        seen["history"] = dash.history
        seen["log"] = [str(line.text) for line in dash.query_one("#log").lines]
        svg = pilot.app.export_screenshot(title="bigmoe")
        (tmp_path / "dashboard.svg").write_text(svg)
        if os.environ.get("BIGMOE_TUI_SCREENSHOT"):
            Path(os.environ["BIGMOE_TUI_SCREENSHOT"]).write_text(svg)
        await pilot.press("q")
        await until(pilot, lambda: pilot.app._exit, 60, "the app to stop the server and exit")

    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            await scenario(pilot)

    try:
        asyncio.run(main())
    finally:
        alive = "pid" in seen and [m for m in group_members(seen["pid"]) if m.split()[1] != "Z"]
        if alive:  # a failed run must not leave vLLM behind; the assertions below still fail it
            launch.kill(launch.Server.of(seen["info"]))

    plan = seen["plan"]
    assert (plan.vram_slots, plan.ram_slots, plan.pager) == (6, 10, True)
    assert seen["answer"] is not None and seen["answer"].text.strip()
    assert seen["answer"].ttft_ms > 0 and seen["answer"].tpot_ms > 0
    history = seen["history"]
    assert history.last_tpot_ms > 0 and history.tpot_ms
    assert 0 < history.tier_hit["vram"] <= 1
    assert any("Application startup complete" in line or "Uvicorn running" in line for line in seen["log"])
    assert app.return_code == 0
    left = [] if group_gone(seen["pid"], wait_s=15) else group_members(seen["pid"])
    assert not left, f"q must leave no process of the server's group: {left}"
    assert not seen["runfile"].exists()
    assert launch.port_free("127.0.0.1", port)
