"""`bigmoe run --yes`: the pipeline with plain progress lines (or JSON lines). Never imports Textual."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import httpx

from bigmoe import launch, pipeline
from bigmoe.client import chat
from bigmoe.errors import BigmoeError
from bigmoe.prepare import prepare

EXIT_OK = 0
EXIT_REFUSED = 3  # the plan was refused (rerun with --force to override)
EXIT_START_FAILED = 4  # the server did not come up


class PlanRefused(BigmoeError):
    exit_code = EXIT_REFUSED


class Printer:
    """Renders progress events as human lines or JSON lines on stdout."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def __call__(self, event: str, fields: dict) -> None:
        if self.as_json:
            print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)
            return
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"[{event}] {text}", flush=True)


def run(opts: pipeline.RunOptions, as_json: bool = False) -> int:
    say = Printer(as_json)
    preset = pipeline.load_preset(opts)
    hardware = pipeline.probe_machine(preset, opts)
    say("probe", hardware.summary())
    the_plan = pipeline.make_plan(hardware, preset, opts)
    say("plan", the_plan.summary())
    if the_plan.refusal:
        if not opts.force:
            raise PlanRefused(f"plan refused: {the_plan.refusal} (rerun with --force to launch anyway)")
        say("plan", {"forced": True, "refusal": the_plan.refusal})
    model_path = pipeline.obtain_model(preset, the_plan, opts, say)
    prepare(the_plan, model_path, say)
    server = pipeline.start_server(preset, the_plan, model_path, opts)
    say("launch", {"pid": server.info.pid, "log": server.info.log})
    try:
        try:
            launch.wait_ready(server, opts.start_timeout, on_stage=lambda s: say("stage", {"stage": s}))
        except launch.LaunchError as e:
            e.exit_code = EXIT_START_FAILED
            raise
        say("ready", {"endpoint": server.endpoint, "model": preset.name, "curl": curl_line(server.endpoint, preset.name, opts.api_key)})
        if opts.prompt is not None:
            result = chat(server.endpoint, preset.name, opts.prompt, opts.max_tokens, api_key=opts.api_key)
            timing = {"tokens": result.tokens, "ttft_ms": round(result.ttft_ms, 2), "tpot_ms": round(result.tpot_ms, 3)}
            if as_json:
                say("answer", {"text": result.text, **timing})
            else:
                print(result.text)
                print(f"TTFT {result.ttft_ms:.1f} ms, TPOT {result.tpot_ms:.2f} ms ({result.tokens} tokens)", flush=True)
            return EXIT_OK
        serve_until_interrupted(server, say)
        return EXIT_OK
    finally:
        launch.stop(server)
        say("stopped", {"pid": server.info.pid})


def serve_until_interrupted(server: launch.Server, say: Printer, every_s: float = 10.0) -> None:
    """Print windowed stats until Ctrl-C, SIGTERM, or `bigmoe stop` from another shell."""
    from bigmoe.watch import Watcher

    watcher = Watcher(server.endpoint)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while server.proc.poll() is None:
            time.sleep(every_s)
            if server.proc.poll() is None:
                try:
                    say("stats", watcher.poll().summary())
                except httpx.HTTPError as e:
                    say("stats", {"error": f"/metrics did not answer: {e}"})
        if not server.runfile.exists():
            say("stopped", {"by": "bigmoe stop"})
            return
        raise launch.LaunchError(f"vLLM exited with code {server.proc.returncode}: {launch.error_line(Path(server.info.log))}")
    except KeyboardInterrupt:
        say("interrupted", {})
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def curl_line(endpoint: str, model: str, api_key: str | None) -> str:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32})
    return f"curl -s {endpoint}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(pipeline.RunOptions(model=sys.argv[1]), as_json=False))
