"""`bigmoe pull MODEL`: download a model from the Hugging Face Hub and check it is whole.

Output: plain lines (or JSON lines with --json: events "plan", "progress", "ready",
"error"). Errors are one line on stderr, never a traceback; the exit codes are those of
bigmoe.exit_codes (README, "Exit codes"): 8 when the files do not fit on the disk, 5 when a downloaded file
did not match the Hub's hash, 6 for no such repo or revision, 7 when the Hub could not be reached.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import click

from bigmoe import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.model import fetch
from bigmoe.units import size_text


@click.command()
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit (default: the preset's, else main).")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="huggingface_hub cache directory (default: HF_HUB_CACHE).",
)
@click.option("--dry-run", is_flag=True, help="List and measure only: exit 0 if it fits, 8 if not.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of text lines.")
def pull(model: str, revision: str | None, cache_dir: str | None, dry_run: bool, as_json: bool) -> None:
    """Download MODEL (a preset name such as qwen3.8-flash-next, or Org/Name) from the Hub.

    Running it again resumes; the model is ready only once every file's hash matches.
    HF_TOKEN and HF_ENDPOINT are honoured.
    """
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its retry warnings are multi-line; our progress lines say it
    out = Lines(as_json)
    try:
        plan = fetch.dry_run(model, revision, cache_dir)
        out.plan(plan)
        if dry_run:
            sys.exit(0 if plan.fits else fetch.EXIT_NO_SPACE)
        path = fetch.fetch(plan, out.progress)
        out.ready(path)
    except BigmoeError as e:
        out.error(str(e), e.exit_code)
    except ValueError as e:  # PresetError: unknown or malformed preset (the table's ERROR, as in plan and run)
        out.error(str(e), exit_codes.ERROR)
    except KeyboardInterrupt:
        out.error("interrupted; run the same command again to resume", fetch.EXIT_CANCELLED)


class Lines:
    """Prints plan, progress (at most one line per `every_s` per phase) and outcome."""

    def __init__(self, as_json: bool, every_s: float | None = None):
        self.as_json = as_json
        self.every_s = every_s if every_s is not None else (1.0 if as_json else 2.0)
        self._last: tuple[str, float] = ("", 0.0)

    def plan(self, plan: fetch.FetchPlan) -> None:
        if self.as_json:
            return self._json("plan", plan.summary())
        state = "ready" if plan.ready else f"{_size(plan.bytes_to_download)} to download"
        where = f"{_size(plan.free_bytes)} free in {plan.cache_dir}"
        offline = " (offline: from the ready marker)" if plan.offline else ""
        click.echo(
            f"{plan.repo_id}@{plan.revision} (commit {plan.commit[:12]}): {len(plan.files)} files, "
            f"{_size(plan.bytes_total)}; {state}, {where}{offline}"
        )
        if not plan.fits:
            click.echo(
                f"does not fit: {_size(plan.shortfall_bytes)} short (keeping {_size(plan.headroom_bytes)} headroom)"
            )

    def progress(self, p: fetch.FetchProgress) -> None:
        now = time.monotonic()
        phase, last = self._last
        if p.phase == phase and p.phase != "ready" and now - last < self.every_s:
            return
        self._last = (p.phase, now)
        if self.as_json:
            return self._json("progress", p.as_dict())
        if p.phase == "ready":
            return
        share = 100.0 * p.bytes_done / p.bytes_total if p.bytes_total else 100.0
        eta = f"ETA {_duration(p.eta_s)}" if p.eta_s is not None else "ETA --"
        click.echo(
            f"{p.phase:8s} {p.files_done}/{p.files_total} files  {_size(p.bytes_done)} / "
            f"{_size(p.bytes_total)}  {share:5.1f}%  {_size(int(p.speed_bps))}/s  {eta}"
        )

    def ready(self, path) -> None:
        if self.as_json:
            return self._json("ready", {"path": str(path)})
        click.echo(f"ready {path}")

    def error(self, message: str, code: int) -> None:
        if self.as_json:
            self._json("error", {"message": message, "exit_code": code})
        click.echo(f"bigmoe: {message}", err=True)
        sys.exit(code)

    def _json(self, event: str, fields: dict) -> None:
        click.echo(json.dumps({"event": event, "time": round(time.time(), 3), **fields}))


_size = partial(size_text, digits=2, smallest="B")
"""Sizes as pull prints them: two decimals, down to plain bytes."""


def _duration(s: float) -> str:
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
