"""`bigmoe list` and `bigmoe rm MODEL`: what bigmoe keeps on disk for each model, and taking it away
(model/store.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from bigmoe.model import store
from bigmoe.units import size_text

KINDS = {"download": "download", "made": "made", "paging": "paging file"}
"""--only's choices, and the kind each names."""

cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="huggingface_hub cache directory (default: HF_HUB_CACHE).",
)
paging_dir_option = click.option(
    "--paging-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory of the paging files (default: bigmoe's, as `bigmoe run` uses without --paging-dir).",
)


def _held(cache_dir: Path | None, paging_dir: Path | None) -> list[store.Held]:
    from huggingface_hub.constants import HF_HUB_CACHE

    from bigmoe.plan.inputs import default_paging_dir

    return store.held(Path(cache_dir or HF_HUB_CACHE), Path(paging_dir or default_paging_dir()))


def _line(item: store.Held, ports: list[int]) -> str:
    size = size_text(item.bytes, smallest="MiB")
    used = f"  (read by the server on port {', '.join(map(str, ports))})" if ports else ""
    return f"{item.model:<22} {item.kind:<12} {size:>10}  {item.state:<11} {item.path}{used}"


@click.command("list")
@cache_dir_option
@paging_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per item.")
def list_command(cache_dir: Path | None, paging_dir: Path | None, as_json: bool) -> None:
    """List what bigmoe keeps on disk for each model: downloads, made checkpoints and paging files, with their size."""
    from bigmoe.serve import records

    items, servers = _held(cache_dir, paging_dir), records.live()
    ports = {i.path: [s.port for s in store.used_by(i, servers)] for i in items}
    if as_json:
        rows = [
            {
                "model": i.model,
                "kind": i.kind,
                "path": str(i.path),
                "bytes": i.bytes,
                "state": i.state,
                "ports": ports[i.path],
            }
            for i in items
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    if not items:
        click.echo("bigmoe keeps no model on disk")
        return
    for item in items:
        click.echo(_line(item, ports[item.path]))
    click.echo(f"{'total':<35} {size_text(sum(i.bytes for i in items), smallest='MiB'):>10}")


def _removable(model: str, only: str | None, cache_dir: Path | None, paging_dir: Path | None) -> list[store.Held]:
    """MODEL's items that `rm` would take (of kind `only`), or a StoreError: nothing kept, or some in use."""
    from bigmoe.serve import records

    items = store.of_model(_held(cache_dir, paging_dir), model)
    if building := [i for i in items if i.state == "building"]:  # the build reads the model's checkpoint
        raise store.StoreError(
            f"a running bigmoe is building {building[0].path.name} from {items[0].model}'s checkpoint; "
            "stop that run first"
        )
    if only is not None:
        items = [i for i in items if i.kind == KINDS[only]]
        if not items:
            raise store.StoreError(f"no {KINDS[only]} is kept for {model}")
    if writing := [i for i in items if i.state == "downloading"]:  # store.remove's lock would refuse it too
        raise store.StoreError(
            f"{store.writer(writing[0])} is writing {writing[0].repo_id}; wait for it to finish, or stop it first"
        )
    servers = records.live()
    if serving := [s for item in items for s in store.used_by(item, servers)]:
        raise store.StoreError(
            f"a server reads {items[0].model}'s files (pid {serving[0].pid}, port {serving[0].port}); stop it "
            f"first: bigmoe stop {serving[0].port}"
        )
    return items


@click.command("rm")
@click.argument("model")
@click.option(
    "--only",
    type=click.Choice(sorted(KINDS)),
    default=None,
    help="Remove only the download, the made checkpoint or the paging files (default: all of them).",
)
@click.option("--yes", "-y", is_flag=True, help="Remove without asking.")
@cache_dir_option
@paging_dir_option
def rm_command(model: str, only: str | None, yes: bool, cache_dir: Path | None, paging_dir: Path | None) -> None:
    """Remove what bigmoe keeps on disk for MODEL (a preset name or Org/Name): `bigmoe list` shows it.

    A download goes from the hub cache for every tool that shares it; `bigmoe pull` or `bigmoe run` fetches it
    again. Refused while a server of MODEL runs, while a run builds one of its paging files, or while another
    bigmoe downloads it."""
    items = _removable(model, only, cache_dir, paging_dir)
    for item in items:
        click.echo(_line(item, []))
    total = size_text(sum(i.bytes for i in items), smallest="MiB")
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(f"removing {total} needs a terminal to confirm, or --yes")
        if not click.confirm(f"remove these ({total})?"):
            raise store.StoreError("nothing removed")
        # Asked again: a run may have started building or serving while the question stood; never more than shown
        shown = {i.path for i in items}
        items = [i for i in _removable(model, only, cache_dir, paging_dir) if i.path in shown]
    store.remove(items)
    click.echo(f"removed {len(items)} item(s), {total}")
