"""preflight: what would make vLLM fail 10-50 s into its start-up, checked in well under a second
before it starts: the pager settings (the plugin's own parser, over the environment vLLM will get
and the BIGMOE_SETTINGS file), the checkpoint's shards against their safetensors headers and sizes,
that it has a tokenizer, the port, and disk space for a paging file still to be built. Each problem is one
line that names its cause and what fixes it.
"""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import os
import shutil
from pathlib import Path

from bigmoe.errors import BigmoeError
from bigmoe.model.shard_check import checkpoint_problems
from bigmoe.paths import nearest_dir
from bigmoe.units import size_text

PAGING_HEADROOM_BYTES = 1 << 30
"""Free space left on the paging file's disk after it is built (logs, filesystem metadata)."""


class PreflightError(BigmoeError):
    """vLLM would fail to start; the message is one line with the cause and the fix."""


def preflight(the_plan, model_path: Path, host: str, port: int, synthetic: bool = False, model: str = "") -> None:
    """Raise PreflightError with the first problem found (in the order a fix is cheapest to try)."""
    for check in (
        lambda: settings_problem(the_plan.env, the_plan),
        lambda: shards_problem(Path(model_path), synthetic, model),
        lambda: tokenizer_problem(Path(model_path)),
        lambda: port_problem(host, port),
        lambda: paging_space_problem(the_plan),
    ):
        why = check()
        if why:
            raise PreflightError(why)


def settings_problem(plan_env: dict[str, str], the_plan=None, environ: dict[str, str] | None = None) -> str | None:
    """The pager settings vLLM's processes will read (this environment, then the plan's variables on top),
    parsed by the plugin's own PagerSettings.from_env; with a plan, its slots checked per layer too."""
    from bigmoe_pager.settings import PagerSettings, SettingsError

    env = {**(os.environ if environ is None else environ), **plan_env}
    try:
        settings = PagerSettings.from_env(env)
        if the_plan is not None and the_plan.pager:
            for layer in range(the_plan.layers):
                settings.slots_for(layer, the_plan.layers, the_plan.experts)
    except SettingsError as e:
        file = env.get("BIGMOE_SETTINGS")
        where = f" (BIGMOE_SETTINGS={file})" if file and file not in str(e) else ""
        return f"pager settings{where}: {e}"
    return None


def shards_problem(model_path: Path, synthetic: bool = False, model: str = "") -> str | None:
    """The first safetensors shard that is not whole by its header (and what fixes it)."""
    if not model_path.is_dir():
        return None  # a hub id vLLM resolves itself; fetch has checked the files
    problems = checkpoint_problems(model_path)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    if synthetic and _made_by_bigmoe(model_path):
        fix = f"delete {model_path} and run again: bigmoe makes it anew"
    elif model and "/snapshots/" in str(model_path):
        fix = f"run: bigmoe verify {model} (it removes damaged files), then bigmoe pull {model}"
    else:
        fix = "copy or download the checkpoint again"
    return f"checkpoint shard {problems[0]}{more}; {fix}"


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Files one of which every tokenizer transformers loads has (a fast tokenizer, SentencePiece, BPE or WordPiece
vocabulary; a tokenizer_config.json may name any other kind)."""


def tokenizer_problem(model_path: Path) -> str | None:
    """A checkpoint directory without any tokenizer file: vLLM would load every weight, then fail on it."""
    if not model_path.is_dir() or any((model_path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (
        f"{model_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
        "copy the model's tokenizer files beside its config.json"
    )


def port_problem(host: str, port: int) -> str | None:
    from bigmoe.serve.launch import bind_error

    error = bind_error(host, port)
    if error is None:
        return None
    if error.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use (another server? see bigmoe ps); pick another with --port"
    if error.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges this user lacks; pick one from 1024 up with --port"
    return (
        f"--host {host!r} cannot be bound here ({error.strerror or error}); "
        "give an address of this machine, such as 127.0.0.1 or 0.0.0.0"
    )


def paging_space_problem(the_plan) -> str | None:
    """Whether the disk of a paging file still to be built has room for it (a file already there, and what a dead
    build left, count as free)."""
    if the_plan.ssd_source != "paging file" or not the_plan.paging_file:
        return None
    if getattr(the_plan, "forced", False):
        return None  # the plan's disk table judged this disk too, and --force accepted its refusal
    path = Path(the_plan.paging_file)
    need = paging_file_bytes(the_plan) + PAGING_HEADROOM_BYTES
    from bigmoe.serve.prepare import stale_partials

    reclaimed = [p for p in [path, *stale_partials(path)] if p.is_file()]  # the build replaces or removes them
    free = shutil.disk_usage(nearest_dir(path.parent)).free + sum(p.stat().st_size for p in reclaimed)
    if free >= need:
        return None
    return (
        f"the paging file {path} needs up to {size_text(need - PAGING_HEADROOM_BYTES, 2, 'MiB')} "
        f"plus {size_text(PAGING_HEADROOM_BYTES, 2, 'MiB')} "
        f"headroom, but its disk has {size_text(free, 2, 'MiB')} free; free space or pass --paging-dir on another disk"
    )


def paging_file_bytes(the_plan) -> int:
    """Upper bound of a paging file's size: every record raw, each padded to a 4 KiB block, plus header and index."""
    record = -(-the_plan.expert_bytes // 4096) * 4096
    return the_plan.layers * the_plan.experts * (record + 4096) + (1 << 20)


def _made_by_bigmoe(model_path: Path) -> bool:
    """Whether the checkpoint is one bigmoe made in its own cache (not a --model-dir it was given)."""
    from bigmoe.paths import models_dir

    return model_path.resolve().is_relative_to(models_dir().resolve())


class VllmMissing(BigmoeError):
    """vLLM is not importable in this environment."""


def require_vllm() -> None:
    """VllmMissing, with the install command, when this Python cannot import vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise VllmMissing(
            "vLLM is not installed in this Python environment; run installer/install.sh "
            "(or pip install 'bigmoe[cpu]' / 'bigmoe[cuda]')"
        )


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the API is reachable beyond this machine and needs no key; None otherwise."""
    if api_key:
        return None
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any address
    return (
        f"--host {host} serves the API beyond this machine without --api-key: anyone who can reach it can use "
        "the model; add --api-key (or set BIGMOE_API_KEY)"
    )
