"""A fake pipeline for the TUI's unit tests: vLLM cannot start in a unit test, so the steps that
make a model, start, watch, chat with and stop a server are fakes that record what they were
asked; presets and the planner are the real ones, on fixed machines (no probing)."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from bigmoe import run as sequence
from bigmoe.machine.hardware import Disk, Gpu, Hardware
from bigmoe.run import Steps
from bigmoe.serve import launch
from bigmoe.serve.client import ChatResult
from bigmoe.serve.watch import Window

GIB = 1 << 30
HOME = "/home/user/.cache/bigmoe"
"""BIGMOE_HOME the tests plan with (never created: the fakes write under tmp_path)."""


def fixed_disk(path: str = "/") -> Disk:
    return Disk(
        path=path,
        device="nvme0n1",
        kind="nvme",
        kind_basis="sysfs: rotational 0, nvme transport",
        mount_point="/",
        filesystem="ext4",
        windows_drive=False,
        free_bytes=900 * GIB,
        o_direct=True,
        o_direct_basis="an aligned 4 KiB read returned the file's bytes",
    )


def cpu_machine(ram_gib: int) -> Hardware:
    """A machine without a GPU and `ram_gib` GiB of RAM (3 GiB is too little for tiny-moe's plan)."""
    return Hardware(
        gpus=(),
        ram_total_bytes=ram_gib * GIB,
        ram_available_bytes=(ram_gib - 1) * GIB,
        ram_stated=False,
        cpu_cores=8,
        cpu_amx=False,
        wsl2=False,
        wsl2_basis="no microsoft in /proc/version",
        memlock_bytes=None,
        disks=(fixed_disk(),),
    )


def gpu_machine() -> Hardware:
    """An RTX 4090 with 64 GiB of RAM and an NVMe SSD: the reference desktop."""
    gpu = Gpu(0, "NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB, "8.9", 4, 16)
    return Hardware(
        gpus=(gpu,),
        ram_total_bytes=64 * GIB,
        ram_available_bytes=58 * GIB,
        ram_stated=False,
        cpu_cores=16,
        cpu_amx=False,
        wsl2=False,
        wsl2_basis="no microsoft in /proc/version",
        memlock_bytes=None,
        disks=(fixed_disk(),),
    )


def window(tpot_ms: float | None, tok_s: float, vram: float, ram: float, layers: int = 4) -> Window:
    """A fixed /metrics window with per-layer hit rates spread around the tier's rate."""
    per_layer = {
        tier: {str(l): max(0.0, min(1.0, rate + 0.04 * (l - 1.5))) for l in range(layers)}
        for tier, rate in (("vram", vram), ("ram", ram))
    }
    return Window(
        seconds=2.0,
        tpot_ms=tpot_ms,
        ttft_ms=None if tpot_ms is None else 41.0,
        tokens_per_s=tok_s,
        hit_rate={"vram": vram, "ram": ram},
        layer_hit_rate=per_layer,
    )


WINDOWS = [window(None, 0.0, 0.5, 0.8)] + [
    window(9.0 + (i % 5), 80.0 + 7 * (i % 4), 0.62 + 0.01 * i, 0.9) for i in range(12)
]
"""What the fake watcher reports, poll after poll (the first window made no tokens)."""


class FakeWatcher:
    """A fake of watch.Watcher: hands out WINDOWS in order, then the busy ones again and again."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.windows = itertools.chain(WINDOWS, itertools.cycle(WINDOWS[1:]))

    def poll(self) -> Window:
        return next(self.windows)


START_LOG = [
    "INFO vLLM API server version 0.32.0",
    "INFO Loading weights took 0.1 s",
    "INFO CPU KV cache size: 2048 tokens",
    "INFO Application startup complete.",
    'INFO:     127.0.0.1:50000 - "GET /metrics HTTP/1.1" 200 OK',
]
CRASH_LOG = [f"INFO filler line {i}" for i in range(60)] + [
    "Traceback (most recent call last):",
    '  File "vllm/engine.py", line 1, in start',
    "RuntimeError: fake crash: not enough memory for the KV cache",
    "INFO shutting down",
]


@dataclass
class FakePipeline:
    """A fake of the steps that need a model on disk and a vLLM server."""

    tmp: Path
    """Where the fake model, log and runfile go."""
    hardware: Hardware
    """What probe_machine answers."""
    crash: bool = False
    """wait_ready writes CRASH_LOG and raises LaunchError instead of reaching "serving"."""
    hang: bool = False
    """wait_ready blocks until stop() is called, then raises LaunchError as for an exited server."""
    calls: list[str] = field(default_factory=list)
    """Steps called, in order."""
    plans: list = field(default_factory=list)
    """Plans handed to start_server."""
    stopped: list[int] = field(default_factory=list)
    """pids stop() was called for."""
    prompts: list[str] = field(default_factory=list)
    """Prompts chat() was asked."""
    _stopped: threading.Event = field(default_factory=threading.Event)

    def steps(self) -> Steps:
        return Steps(
            probe_machine=self.probe_machine,
            obtain_model=self.obtain_model,
            prepare=self.prepare,
            start_server=self.start_server,
            wait_ready=self.wait_ready,
            stop=self.stop,
            watcher=FakeWatcher,
            chat=self.chat,
        )

    def probe_machine(self, preset, opts):
        self.calls.append("probe")
        return self.hardware

    def obtain_model(self, preset, plan, opts, progress):
        self.calls.append("model")
        progress("model", {"state": "making", "name": preset.name, "dtype": plan.expert_dtype})
        path = self.tmp / "model"
        path.mkdir(exist_ok=True)
        return path

    def prepare(self, plan, model_path, progress):
        self.calls.append("prepare")
        return None

    def start_server(self, preset, plan, model_path, opts) -> launch.Server:
        self.calls.append("start")
        self.plans.append(plan)
        info = launch.RunInfo(
            name=preset.name,
            pid=4242,
            host=opts.host,
            port=opts.port,
            log=str(self.tmp / "vllm.log"),
            model_path=str(model_path),
            served_name=preset.name,
            started=0.0,
        )
        Path(info.log).write_text("$ vllm serve (fake)\n")
        runfile = self.tmp / "run.json"
        runfile.write_text(json.dumps({"pid": info.pid}))
        return launch.Server(info, None, runfile)

    def wait_ready(self, server, timeout_s, on_stage):
        self.calls.append("wait")
        if self.hang:
            on_stage("engine")
            if not self._stopped.wait(timeout=20):
                raise AssertionError("the fake server was never stopped")
            raise launch.LaunchError("vLLM exited with code -15 during start-up")
        lines = CRASH_LOG if self.crash else START_LOG
        with open(server.info.log, "a") as f:
            f.write("\n".join(lines) + "\n")
        if self.crash:
            raise launch.LaunchError(
                f"vLLM exited with code 1 during start-up: {launch.error_line(Path(server.info.log))}"
            )
        for stage in launch.stages_in(Path(server.info.log)):
            on_stage(stage)

    def stop(self, server):
        self.calls.append("stop")
        self._stopped.set()
        self.stopped.append(server.info.pid)
        server.runfile.unlink(missing_ok=True)

    def chat(self, endpoint, model, prompt, max_tokens, api_key=None):
        self.calls.append("chat")
        self.prompts.append(prompt)
        return ChatResult(text="The sea is wide and deep.", tokens=7, ttft_ms=41.0, tpot_ms=12.5)


def options(**changes) -> sequence.RunOptions:
    return sequence.RunOptions(model="tiny-moe", port=8123, **changes)
