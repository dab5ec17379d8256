"""The pipeline steps the TUI calls, gathered in one object so tests can put fakes in their place.

The defaults are the real steps of bigmoe.run (the same ones `--yes` runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from bigmoe import run as pipeline
from bigmoe.serve import launch, prepare
from bigmoe.serve.client import chat
from bigmoe.serve.watch import Watcher


@dataclass
class Steps:
    """One callable per step; each has the signature of the real function it defaults to."""

    load_preset: Callable[[pipeline.RunOptions], Any] = pipeline.load_preset
    """RunOptions -> Preset."""
    probe_machine: Callable[[Any, pipeline.RunOptions], Any] = pipeline.probe_machine
    """(Preset, RunOptions) -> Hardware."""
    make_plan: Callable[..., Any] = pipeline.make_plan
    """(Hardware, Preset, RunOptions) -> Plan; raises PlanError for overrides that make no sense."""
    obtain_model: Callable[..., Any] = pipeline.obtain_model
    """(Preset, Plan, RunOptions, progress) -> checkpoint Path."""
    prepare: Callable[..., Any] = prepare.prepare
    """(Plan, model Path, progress) -> paging file Path or None."""
    start_server: Callable[..., launch.Server] = pipeline.start_server
    """(Preset, Plan, model Path, RunOptions) -> Server, returning at once."""
    wait_ready: Callable[..., None] = launch.wait_ready
    """(Server, timeout_s, on_stage) -> None once /health answers; LaunchError otherwise."""
    stop: Callable[[launch.Server], None] = launch.stop
    """Server -> None: SIGTERM to its group, then SIGKILL; removes its runfile."""
    watcher: Callable[[str], Any] = Watcher
    """endpoint -> an object whose poll() returns a watch.Window."""
    chat: Callable[..., Any] = chat
    """(endpoint, model, prompt, max_tokens, api_key=) -> ChatResult."""
