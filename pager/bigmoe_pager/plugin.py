"""vLLM `general_plugins` entry points.

vLLM calls these in every process it starts (API server, engine core, workers),
so each is idempotent, imports vLLM lazily and does nothing unless the bigmoe
settings enable it.
"""

from __future__ import annotations

import functools
import logging
import os

from bigmoe_pager.settings import PagerSettings, unknown_variables

log = logging.getLogger("vllm.bigmoe_pager")  # under vLLM's logger so its handler shows our lines

SUPPORTED_VLLM = ("0.25", "0.32", "0.33")

_done: set[str] = set()


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one the plugin was built and tested for."""


def check_vllm_version(version: str) -> None:
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        raise UnsupportedVllm(
            f"bigmoe: vLLM {version} is not supported; the pager supports vLLM "
            + ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
        )


def _installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


@functools.cache
def process_settings() -> PagerSettings:
    """This process's settings: read from the environment once, at the first entry point vLLM calls."""
    for line in unknown_variables(os.environ):
        log.warning("bigmoe: %s", line)
    return PagerSettings.from_env()


def register_experts() -> None:
    """Entry point `bigmoe_experts`: swap vLLM's RoutedExperts for the paged one."""
    if "experts" in _done:
        return
    settings = process_settings()
    if not settings.enabled and settings.route_replay is None:
        return
    check_vllm_version(_installed_vllm_version())
    from bigmoe_pager.adapters.vllm import experts

    if settings.enabled:
        experts.install(settings)
    else:
        experts.install_replay_only(settings)
    _done.add("experts")


def register_ngram() -> None:
    """Entry point `bigmoe_ngram`: serve the Qwen4Exp n-gram table from SSD."""
    if "ngram" in _done:
        return
    settings = process_settings()
    if not settings.ngram:
        return
    check_vllm_version(_installed_vllm_version())
    from bigmoe_pager.adapters.vllm import ngram

    ngram.install(settings)
    _done.add("ngram")
