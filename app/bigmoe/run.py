"""run: the one step sequence of `bigmoe run`, which both shells consume:

    probe -> plan -> model (fetch or make) -> prepare -> launch -> ready -> watch (until ended)

headless.py (`--yes`) prints each step's events as lines; the TUI (tui/worker.py) posts them to its
screens, with the plan screen between plan and model. Each step reports through `say(event, fields)`
and is one field of Steps, so tests put fakes in their place. The shells add only what is theirs:
headless its signal handling and stats lines, the TUI its screens and its quit button.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bigmoe import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.plan import build
from bigmoe.plan.inputs import Overrides
from bigmoe.serve import launch, prepare, records
from bigmoe.serve.client import chat
from bigmoe.serve.watch import Watcher

Progress = Callable[[str, dict], None]
"""Called with (event, fields) as a step advances; the shells render it."""


@dataclass
class RunOptions:
    """What the person asked `bigmoe run` for."""

    model: str
    """Preset name (or a preset TOML path, or a checkpoint directory)."""
    prompt: str | None = None
    """One chat request to send once the server is ready; then stop."""
    max_tokens: int = 64
    """Tokens to generate for the prompt."""
    host: str = "127.0.0.1"
    """Address the server binds."""
    port: int = 8000
    """Port of the OpenAI-compatible API."""
    api_key: str | None = None
    """API key vLLM requires, if any; it reaches vLLM as VLLM_API_KEY in its environment, never on its command line."""
    model_dir: str | None = None
    """Checkpoint directory to serve instead of fetching or making one."""
    paging_dir: str | None = None
    """Directory of the paging file (None = bigmoe's cache)."""
    vram_slots: int | None = None
    """VRAM expert slots per layer, beating the plan."""
    ram_slots: int | None = None
    """RAM expert slots per layer, beating the plan."""
    compress: str | None = None
    """Codec on/off/auto, beating the plan."""
    context: int | None = None
    """Context length, beating the plan."""
    force: bool = False
    """Launch a plan the estimator refused."""
    cuda_graphs: bool = True
    """On CUDA: the device-driven pager with decode in CUDA graphs (False: host-driven, eager)."""
    prefill_buffer: bool | None = None
    """On CUDA, device-driven: reserve a whole-layer VRAM buffer for prefill (None = the plan decides)."""
    speculative_tokens: int = 0
    """Draft tokens per step from the model's MTP head (bigmoe run --speculative-tokens); 0 = off."""
    vram_gib: float | None = None
    """Plan for this much VRAM (GiB) instead of the probed GPU's."""
    ram_gib: float | None = None
    """Plan for this much RAM (GiB) instead of the probed amount."""
    start_timeout: float = 900.0
    """Seconds to wait for /health."""

    def overrides(self) -> Overrides:
        """What these options state to the planner (the same as `bigmoe plan` with the same options)."""
        return build.stated(**{name: getattr(self, name) for name in PLAN_FIELDS})


PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Overrides) if f.name in RunOptions.__dataclass_fields__)
"""RunOptions fields the planner reads (each an Overrides field of the same name)."""


class PlanRefused(BigmoeError):
    """The estimator refused the plan and --force was not given."""

    exit_code = exit_codes.PLAN_REFUSED


# ---- the steps -------------------------------------------------------------------------------


def load_preset(opts: RunOptions):
    """The preset MODEL names; a checkpoint directory as MODEL is also the directory served (--model-dir)."""
    preset, opts.model_dir = build.load(opts.model, opts.model_dir)
    return preset


def probe_machine(preset, opts: RunOptions):
    """The machine, with the disks that will hold the model and the paging file judged."""
    return build.probe_for(preset, opts.overrides())


def make_plan(hardware, preset, opts: RunOptions):
    """The plan, built exactly as `bigmoe plan` builds it from the same options."""
    return build.build(hardware, preset, opts.overrides())


def obtain_model(preset, the_plan, opts: RunOptions, say: Progress) -> Path:
    """The checkpoint directory to serve (given, made locally, or fetched), checked before vLLM sees it."""
    from bigmoe.model.obtain import obtain
    from bigmoe.serve.preflight import preflight

    path = obtain(preset, the_plan.expert_dtype, opts.model_dir, say)
    preflight(the_plan, path, opts.host, opts.port, preset.synthetic, opts.model)  # settings, shards, port, disk
    return path


def start_server(preset, the_plan, model_path: Path, opts: RunOptions) -> launch.Server:
    """Start vLLM with the plan's command exactly as `bigmoe plan` prints it (the plan made again when the
    checkpoint landed where no plan could name it before); the API key goes in its environment."""
    from bigmoe.serve.preflight import require_vllm

    require_vllm()
    the_plan = plan_for_checkpoint(the_plan, preset, model_path, opts)
    info = records.RunInfo(
        name=preset.name,
        pid=0,
        host=opts.host,
        port=opts.port,
        log=str(records.log_name(preset.name, opts.port, time.strftime("%Y%m%d-%H%M%S"))),
        model_path=str(model_path),
        served_name=preset.name,
        started=time.time(),
    )
    secrets = {"VLLM_API_KEY": opts.api_key} if opts.api_key else {}
    return launch.start(list(the_plan.argv), dict(the_plan.env), info, secrets)


def plan_for_checkpoint(the_plan, preset, model_path: Path, opts: RunOptions):
    """The plan whose command serves `model_path`: `the_plan` when it was made for it, else the plan made
    again now that the checkpoint is on disk (a download lands where no plan could name it before)."""
    if Path(the_plan.model_path) == Path(model_path):
        return the_plan
    again = make_plan(the_plan.hardware, preset, dataclasses.replace(opts, model_dir=str(model_path)))
    refuse_unless_forced(again, opts, " once the checkpoint was read")
    return again


def refuse_unless_forced(the_plan, opts: RunOptions, when: str = "") -> None:
    """PlanRefused when the plan was refused and --force was not given."""
    if the_plan.refusals and not opts.force:
        raise PlanRefused(f"plan refused{when}: {the_plan.refusal} (rerun with --force to launch anyway)")


@dataclass
class Steps:
    """One callable per step; each defaults to the real one (the TUI's tests put fakes in their place)."""

    load_preset: Callable[[RunOptions], Any] = load_preset
    """RunOptions -> Preset."""
    probe_machine: Callable[[Any, RunOptions], Any] = probe_machine
    """(Preset, RunOptions) -> Hardware."""
    make_plan: Callable[..., Any] = make_plan
    """(Hardware, Preset, RunOptions) -> Plan; raises PlanError for overrides that make no sense."""
    obtain_model: Callable[..., Any] = obtain_model
    """(Preset, Plan, RunOptions, say) -> checkpoint Path."""
    prepare: Callable[..., Any] = prepare.prepare
    """(Plan, model Path, say) -> paging file Path or None."""
    start_server: Callable[..., launch.Server] = start_server
    """(Preset, Plan, model Path, RunOptions) -> Server, returning at once."""
    wait_ready: Callable[..., None] = launch.wait_ready
    """(Server, timeout_s, on_stage) -> None once /health answers; LaunchError otherwise."""
    stop: Callable[[launch.Server], None] = launch.stop
    """Server -> None: SIGTERM to its group, then SIGKILL; removes its runfile."""
    watcher: Callable[[str], Any] = Watcher
    """endpoint -> an object whose poll() returns a watch.Window."""
    chat: Callable[..., Any] = chat
    """(endpoint, model, prompt, max_tokens, api_key=) -> ChatResult."""


# ---- the sequence ----------------------------------------------------------------------------

NO_PAGING_FILE = {"none": "there is no SSD tier", "checkpoint": "the SSD tier reads the checkpoint in place"}
"""Why a plan needs no paging file, by its ssd_source."""


def plan(steps: Steps, preset, opts: RunOptions, say: Progress):
    """probe -> plan. PlanRefused when the plan is refused without --force (a forced one says so)."""
    hardware = steps.probe_machine(preset, opts)
    say("probe", hardware.summary())
    the_plan = steps.make_plan(hardware, preset, opts)
    say("plan", the_plan.summary())
    refuse_unless_forced(the_plan, opts)
    if the_plan.refusals:
        say("plan", {"forced": True, "refusal": the_plan.refusal})
    return the_plan


def model_ready(steps: Steps, preset, the_plan, opts: RunOptions, say: Progress) -> Path:
    """model -> prepare: the checkpoint on disk and checked, the paging file (when the plan has one) built."""
    model_path = Path(steps.obtain_model(preset, the_plan, opts, say))
    say("model", {"state": "ready", "path": str(model_path)})
    if steps.prepare(the_plan, model_path, say) is None:
        say("prepare", {"state": "not needed", "why": NO_PAGING_FILE.get(the_plan.ssd_source, the_plan.ssd_source)})
    return model_path


def launch_server(steps: Steps, preset, the_plan, model_path: Path, opts: RunOptions, say: Progress):
    """launch: vLLM started (not yet ready); its record exists, so `bigmoe ps` and `bigmoe stop` find it."""
    server = steps.start_server(preset, the_plan, model_path, opts)
    say("launch", {"pid": server.info.pid, "log": server.info.log, "command": shlex.join(server.command)})
    return server


def ready(steps: Steps, server, opts: RunOptions, say: Progress) -> None:
    """ready: each start-up stage as the log shows it, then /health answered (LaunchError when it never does)."""
    try:
        steps.wait_ready(server, opts.start_timeout, lambda stage: say("stage", {"stage": stage}))
    except launch.LaunchError as e:
        e.exit_code = exit_codes.START_FAILED
        raise
    endpoint, name = server.endpoint, server.info.served_name
    say("ready", {"endpoint": endpoint, "model": name, "curl": curl_line(endpoint, name, opts.api_key)})


STOPPED_ELSEWHERE = "the server was stopped from another shell (bigmoe stop)"
"""What ended() says when `bigmoe stop` stopped the server."""


def ended(server) -> str | None:
    """watch: None while the server's process runs; else why it ended, STOPPED_ELSEWHERE when `bigmoe stop`
    stopped it, otherwise its exit code and the first error line of its log."""
    from bigmoe.serve.vllm_log import exit_reason

    if server.proc is None or server.proc.poll() is None:
        return None
    if records.stopped_elsewhere(server.runfile):
        return STOPPED_ELSEWHERE
    return exit_reason(server.proc.returncode, Path(server.info.log), " while serving")


def curl_line(endpoint: str, model: str, api_key: str | None) -> str:
    """A request to paste; the key itself is never printed (the line reads it from $BIGMOE_API_KEY)."""
    import json

    auth = ' -H "Authorization: Bearer $BIGMOE_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32})
    return f"curl -s {endpoint}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
