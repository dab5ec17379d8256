"""`bigmoe verify MODEL`: check a downloaded checkpoint again, byte for byte (the check: model/verify.py).
A bad file is named on one line and removed, so `bigmoe pull MODEL` downloads it again; the exit code is then 5.
"""

from __future__ import annotations

import sys

import click

from bigmoe import exit_codes
from bigmoe.errors import BigmoeError
from bigmoe.model import fetch
from bigmoe.model.verify import verify


@click.command("verify")
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit (default: the one downloaded).")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="huggingface_hub cache directory (default: HF_HUB_CACHE).",
)
@click.option(
    "--keep", is_flag=True, help="Leave bad files in place (default: remove them so pull fetches them again)."
)
def verify_command(model: str, revision: str | None, cache_dir: str | None, keep: bool) -> None:
    """Check a downloaded MODEL against the Hub's hashes (sha256 / git blob id) and its safetensors headers."""
    try:
        verdict = verify(model, revision, cache_dir, remove_bad=not keep)
    except BigmoeError as e:
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(e.exit_code)
    except ValueError as e:  # PresetError (the table's ERROR, as in plan and run)
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(exit_codes.ERROR)
    where = f"{verdict.repo_id}@{verdict.commit[:12]}"
    if not verdict.bad:
        click.echo(f"ok: {verdict.files} files of {where} match {verdict.source} and their safetensors headers")
        return
    for f, why in verdict.bad:
        click.echo(f"bad: {verdict.snapshot / f.path}: {why}")
    fix = (
        f"they were removed; run: bigmoe pull {model}"
        if not keep
        else f"rerun without --keep to remove them, then: bigmoe pull {model}"
    )
    click.echo(f"bigmoe: {len(verdict.bad)} of {verdict.files} files of {where} are damaged; {fix}", err=True)
    sys.exit(fetch.EXIT_NOT_READY)
