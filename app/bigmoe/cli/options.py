"""The options `bigmoe run` and `bigmoe plan` share, defined once: what the person may state to the planner
(plan.inputs.Overrides has one field per option, same name)."""

from __future__ import annotations

import math
from typing import Callable

import click

from bigmoe.plan.inputs import MIN_CONTEXT

GIB = click.FloatRange(min=0, min_open=True)
"""A size in GiB: positive."""


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """An option callback: a usage error for nan and inf, which every FloatRange lets through."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def utf8(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An option callback: a usage error for text with bytes that are not UTF-8 (the shell passed them as they are)."""
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise click.BadParameter("it holds bytes that are not UTF-8 text", ctx, param) from None
    return value


def header_text(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An option callback for what travels in an HTTP header (the API key): printable ASCII only."""
    if value is not None and not (value.isascii() and value.isprintable()):
        raise click.BadParameter("use printable ASCII characters only (it is sent in an HTTP header)", ctx, param)
    return value


PLAN_OPTIONS: tuple[Callable, ...] = (
    click.option(
        "--model-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Serve (and plan for) this checkpoint directory instead of fetching or making one.",
    ),
    click.option(
        "--paging-dir", type=click.Path(file_okay=False), default=None, help="Directory of the SSD tier's paging file."
    ),
    click.option("--host", default="127.0.0.1", show_default=True, help="Address the server binds."),
    click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port of the API."),
    click.option(
        "--vram-gib",
        type=GIB,
        default=None,
        help="Plan as if the GPU had this much VRAM (GiB): fewer VRAM slots, the same command.",
    ),
    click.option(
        "--ram-gib",
        type=GIB,
        default=None,
        help="Plan as if the machine had this much RAM (GiB): fewer RAM slots, more read from SSD.",
    ),
    click.option("--context", type=click.IntRange(MIN_CONTEXT), default=None, help="Context length (tokens)."),
    click.option(
        "--vram-slots", type=click.IntRange(1), default=None, help="VRAM expert slots per layer (beats the plan)."
    ),
    click.option(
        "--ram-slots", type=click.IntRange(1), default=None, help="Pinned RAM expert slots per layer (beats the plan)."
    ),
    click.option(
        "--compress",
        type=click.Choice(["on", "off", "auto"]),
        default=None,
        help="Lossless FP8 codec for the SSD tier's paging file (records are expanded as they enter RAM).",
    ),
    click.option("--force", is_flag=True, help="Accept a refused plan (the refusal stays recorded)."),
    click.option(
        "--cuda-graphs/--eager",
        default=True,
        show_default=True,
        help="CUDA: the device-driven pager with decode in CUDA graphs, or the host-driven one in eager mode.",
    ),
    click.option(
        "--prefill-buffer/--no-prefill-buffer",
        default=None,
        help=(
            "CUDA, device-driven pager: prefill over a VRAM buffer of one whole layer's experts "
            "(default: when VRAM allows)."
        ),
    ),
    click.option(
        "--speculative-tokens",
        type=click.IntRange(0, 3),
        default=0,
        show_default=True,
        help="Speculative decoding with the model's MTP head: draft tokens per step (0 = off).",
    ),
)
"""Each becomes a keyword argument named as the Overrides field it sets."""


def plan_options(command: Callable) -> Callable:
    """Add the shared planner options to a click command (listed in PLAN_OPTIONS' order)."""
    for option in reversed(PLAN_OPTIONS):
        command = option(command)
    return command
