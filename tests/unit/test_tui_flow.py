"""The TUI's screen flow under Textual's pilot, with the fake pipeline of tui_fakes (no vLLM here):
plan edits re-plan, bad fields and refused plans do not launch without the person's say-so, the
dashboard shows what the (fake) watcher and chat return, and q stops the server exactly once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from bigmoe.exit_codes import START_FAILED as EXIT_START_FAILED
from bigmoe.model import presets
from bigmoe.tui.app import BigmoeApp
from bigmoe.tui.dashboard import Dashboard
from bigmoe.tui.force_screen import ForceScreen
from bigmoe.tui.plan_screen import PlanScreen
from bigmoe.tui.progress_screen import ProgressScreen
from tui_fakes import CRASH_LOG, HOME, FakePipeline, cpu_machine, options

SIZE = (120, 40)


@pytest.fixture(autouse=True)
def fixed_home(monkeypatch):
    monkeypatch.setenv("BIGMOE_HOME", HOME)


def drive(app: BigmoeApp, scenario) -> None:
    """Run the app headless at SIZE and play `scenario(pilot)` against it."""

    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(asyncio.wait_for(main(), timeout=30))


async def until(pilot, condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for the app (screen: {type(pilot.app.screen).__name__})")
        await pilot.pause(0.02)


async def planned(pilot) -> PlanScreen:
    """The plan screen once its plan answers the form as it is."""
    await until(pilot, lambda: isinstance(pilot.app.screen, PlanScreen) and not pilot.app.screen.stale)
    await pilot.pause()  # let the layout settle before clicking by position
    return pilot.app.screen


async def launched(pilot) -> Dashboard:
    """Launch from the plan screen ("l") and wait for the live dashboard."""
    await pilot.press("l")
    await until(pilot, lambda: isinstance(pilot.app.screen, Dashboard) and pilot.app.screen.live)
    return pilot.app.screen


async def type_into(pilot, field: str, text: str) -> None:
    await pilot.click(f"#{field}")
    await pilot.press(*text)
    await pilot.press("enter")


def make_app(fake: FakePipeline, **opts) -> BigmoeApp:
    return BigmoeApp(presets.load("tiny-moe"), options(**opts), fake.steps(), poll_s=3600)


@pytest.fixture
def roomy(tmp_path):
    return FakePipeline(tmp_path, cpu_machine(24))


@pytest.fixture
def cramped(tmp_path):
    """tiny-moe's plans are refused on this machine (out of memory)."""
    return FakePipeline(tmp_path, cpu_machine(3))


def test_edited_slots_replan_and_launch_with_the_edits(roomy):
    seen = {}

    async def scenario(pilot):
        screen = await planned(pilot)
        seen["before"] = (screen.plan.vram_slots, screen.plan.ram_slots, screen.plan.pager)
        await type_into(pilot, "vram_slots", "6")
        await type_into(pilot, "ram_slots", "10")
        screen = await planned(pilot)
        seen["after"] = (screen.plan.vram_slots, screen.plan.ram_slots, screen.plan.pager)
        seen["reason"] = screen.plan.reasons["vram_slots"]
        await launched(pilot)

    app = make_app(roomy)
    drive(app, scenario)
    assert seen["before"] == (8, 12, True)  # the tiny-moe demo pages by default (its preset's [plan])
    assert seen["after"] == (6, 10, True)
    assert "--vram-slots" in seen["reason"]
    assert [p.vram_slots for p in roomy.plans] == [6] and roomy.plans[0].ram_slots == 10
    assert roomy.calls == ["probe", "model", "prepare", "start", "wait"]


@pytest.mark.parametrize(
    "field,text,message",
    [
        ("vram_slots", "six", "VRAM slots: 'six' is not a positive whole number"),
        ("context", "0", "context: '0' is not a positive whole number"),
        ("vram_slots", "2", "--vram-slots 2 must be between top-k 4"),
        ("ram_slots", "99", "--ram-slots 99 must be between top-k 4"),
    ],
)
def test_bad_field_is_explained_and_blocks_launch(roomy, field, text, message):
    seen = {}

    async def scenario(pilot):
        await planned(pilot)
        await type_into(pilot, field, text)
        await pilot.pause(0.2)
        screen = pilot.app.screen
        seen["status"] = str(screen.query_one("#status").render())
        seen["disabled"] = screen.query_one("#launch").disabled
        await pilot.press("l")
        await pilot.pause(0.2)
        seen["screen"] = type(pilot.app.screen)

    drive(make_app(roomy), scenario)
    assert message in seen["status"]
    assert seen["disabled"] and seen["screen"] is PlanScreen
    assert "start" not in roomy.calls


@pytest.mark.parametrize("answer,launched", [("escape", False), ("f", True)])
def test_refused_plan_launches_only_when_forced(cramped, answer, launched):
    seen = {}

    async def scenario(pilot):
        screen = await planned(pilot)
        seen["refusals"] = screen.plan.refusals
        seen["status"] = str(screen.query_one("#status").render())
        await pilot.press("l")
        await until(pilot, lambda: isinstance(pilot.app.screen, ForceScreen))
        await pilot.press(answer)
        if launched:
            await until(pilot, lambda: isinstance(pilot.app.screen, Dashboard) and pilot.app.screen.live)
        else:
            await pilot.pause(0.2)
        seen["screen"] = type(pilot.app.screen)

    drive(make_app(cramped), scenario)
    assert seen["refusals"] and "out of memory" in seen["refusals"][0]
    assert "Refused" in seen["status"]
    if launched:
        assert seen["screen"] is Dashboard
        assert len(cramped.plans) == 1 and cramped.plans[0].forced and cramped.plans[0].refusals
    else:
        assert seen["screen"] is PlanScreen and cramped.plans == []


def test_new_paging_dir_is_probed_and_planned(roomy):
    seen = {}

    async def scenario(pilot):
        await planned(pilot)
        probes = roomy.calls.count("probe")
        screen = pilot.app.screen
        await pilot.click("#compress")  # opens the list: auto, on, off
        await pilot.press("down", "enter")
        seen["select"] = screen.query_one("#compress").value
        await type_into(pilot, "paging_dir", "/data/pages")
        screen = await planned(pilot)
        seen["probes"] = roomy.calls.count("probe") - probes
        seen["paging_file"] = screen.plan.paging_file
        seen["compress"] = screen.plan.compress

    drive(make_app(roomy, vram_slots=6, ram_slots=10), scenario)
    assert seen["select"] == "on" and seen["compress"] is True
    assert seen["paging_file"].startswith("/data/pages/")
    assert seen["probes"] >= 1


@pytest.mark.parametrize(
    "quit_on,keys", [("plan", "q"), ("plan", "ctrl+q"), ("plan", "#quit"), ("dashboard", "q"), ("dashboard", "ctrl+q")]
)
def test_quitting_stops_a_started_server_once_and_exits_zero(roomy, quit_on, keys):
    async def scenario(pilot):
        await planned(pilot)
        if quit_on == "dashboard":
            await launched(pilot)
        if keys.startswith("#"):
            await pilot.click(keys)
        else:
            await pilot.press(keys)
        await until(pilot, lambda: pilot.app._exit, timeout_s=5)

    app = make_app(roomy)
    drive(app, scenario)
    assert app.return_code == 0
    assert roomy.stopped == ([4242] if quit_on == "dashboard" else [])
    assert roomy.calls.count("probe") == 1, "the machine is probed once for one pair of directories"


def test_q_while_the_server_starts_stops_it_and_exits_zero(roomy):
    roomy.hang = True

    async def scenario(pilot):
        await planned(pilot)
        await pilot.press("l")
        await until(pilot, lambda: isinstance(pilot.app.screen, ProgressScreen) and "engine" in pilot.app.screen.stages)
        await pilot.press("q")
        await until(pilot, lambda: pilot.app._exit)

    app = make_app(roomy)
    drive(app, scenario)
    assert roomy.stopped == [4242]
    assert app.return_code == 0 and not app.start_failed, "a start the person cut short is not a failed start"


def test_crash_during_start_shows_the_log_at_the_error_line(roomy):
    roomy.crash = True
    seen = {}

    async def scenario(pilot):
        await planned(pilot)
        await pilot.press("l")
        await until(pilot, lambda: isinstance(pilot.app.screen, ProgressScreen) and pilot.app.screen.failed is not None)
        await pilot.pause(0.2)
        screen = pilot.app.screen
        seen["failed"] = screen.failed
        seen["error_at"] = screen.error_at
        log = screen.query_one("#log")
        seen["view"] = (log.scroll_y, log.scroll_y + log.scrollable_content_region.height)
        await pilot.press("q")
        await until(pilot, lambda: pilot.app._exit)

    app = make_app(roomy)
    drive(app, scenario)
    error = "RuntimeError: fake crash: not enough memory for the KV cache"
    assert error in seen["failed"]
    lines = ["$ vllm serve (fake)", *CRASH_LOG]
    assert seen["error_at"] == lines.index(error)
    assert seen["view"][0] <= seen["error_at"] < seen["view"][1], "the error line must be in view"
    assert seen["view"][0] > 0, "a long log is scrolled to the error, not left at its top"
    assert roomy.stopped == [4242], "a failed start stops its server once, and q does not stop it again"
    assert app.return_code == EXIT_START_FAILED


def test_dashboard_shows_polled_speed_hit_rates_and_a_chat_answer(roomy):
    seen = {}

    async def scenario(pilot):
        await planned(pilot)
        dash = await launched(pilot)
        for _ in range(4):
            await until(pilot, lambda: not dash.polling)
            dash.action_poll()
        await until(pilot, lambda: not dash.polling)
        await pilot.press("c")
        await pilot.press(*"quiet sea")  # q typed into the chat box is text, not quit
        await pilot.press("enter")
        await until(pilot, lambda: dash.query_one("#chat").last_result is not None)
        await pilot.press("escape")
        seen["history"] = dash.history
        seen["answer"] = str(dash.query_one("#answer").render())
        seen["timing"] = str(dash.query_one("#timing").render())
        seen["tpot_title"] = dash.query_one("#tpot-panel").border_title
        seen["sparkline"] = list(dash.query_one("#tpot").data)
        seen["log"] = [str(line.text) for line in dash.query_one("#log").lines]

    drive(make_app(roomy, vram_slots=6, ram_slots=10), scenario)
    h = seen["history"]
    assert h.last_tpot_ms and h.last_tpot_ms > 0
    assert seen["sparkline"] == h.tpot_ms and len(h.tpot_ms) >= 3
    assert f"TPOT {h.last_tpot_ms:.2f} ms" in seen["tpot_title"]
    assert set(h.tier_hit) == {"vram", "ram"} and set(h.layer_hit["vram"]) == {"0", "1", "2", "3"}
    assert roomy.prompts == ["quiet sea"]
    assert "The sea is wide and deep." in seen["answer"]
    assert seen["timing"] == "TTFT 41 ms, TPOT 12.50 ms, 7 tokens"
    assert any("Application startup complete" in line for line in seen["log"])
    assert not any("GET /metrics" in line for line in seen["log"]), "the dashboard's own polls are not shown"


@pytest.mark.parametrize(
    "how,shown,code",
    [
        ("bigmoe stop", "stopped from another shell", 0),
        ("crash", "RuntimeError: engine died (vLLM exited with code 3 while serving", 1),
    ],
)
def test_server_gone_while_serving_is_shown_and_sets_the_exit_code(roomy, how, shown, code):
    seen = {}

    async def scenario(pilot):
        await planned(pilot)
        dash = await launched(pilot)
        await until(pilot, lambda: not dash.polling)
        if how == "crash":  # a real process that exits with code 3 stands in for the server's
            with open(dash.server.info.log, "a") as f:
                f.write("RuntimeError: engine died\n")
            dash.server.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
            dash.server.proc.wait()
        else:
            dash.server.runfile.unlink()
        dash.action_poll()
        await until(pilot, lambda: dash.gone is not None)
        seen["status"] = str(dash.query_one("#status").render())
        await pilot.press("q")
        await until(pilot, lambda: pilot.app._exit)

    app = make_app(roomy)
    drive(app, scenario)
    assert shown in seen["status"]
    assert app.return_code == code
