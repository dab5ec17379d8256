"""The `bigmoe` command: a thin shell over the pipeline steps.

Every error the user can act on is one line on stderr and a non-zero exit code;
no traceback reaches the terminal.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from bigmoe import exit_codes
from bigmoe.cli.options import finite, header_text, plan_options, utf8
from bigmoe.errors import BigmoeError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bigmoe")
def cli() -> None:
    """Run Mixture-of-Experts LLMs bigger than your GPU, through vLLM."""


@cli.command()
@click.argument("model")
@click.option("--yes", "-y", is_flag=True, help="Headless: accept the plan and run without the TUI.")
@click.option(
    "--prompt",
    default=None,
    callback=utf8,
    help="Send one chat request, print the answer with TTFT and TPOT, then stop.",
)
@click.option(
    "--max-tokens",
    default=64,
    show_default=True,
    type=click.IntRange(1, 1 << 20),
    help="Tokens to generate for --prompt.",
)
@click.option(
    "--api-key",
    default=None,
    envvar="BIGMOE_API_KEY",
    show_envvar=True,
    callback=header_text,
    help="Require this API key (it reaches vLLM by environment, never on a command line; printed lines mask it).",
)
@plan_options
@click.option("--json", "as_json", is_flag=True, help="With --yes: progress as JSON lines.")
@click.option(
    "--start-timeout",
    default=900.0,
    show_default=True,
    type=click.FloatRange(1),
    callback=finite,
    help="Seconds to wait for the server to be ready.",
)
def run(model: str, yes: bool, as_json: bool, **options) -> None:
    """Plan, fetch, prepare and serve MODEL (a preset name such as tiny-moe); `bigmoe plan` with the same
    options prints the plan and the exact vLLM command this runs."""
    from bigmoe import headless
    from bigmoe.run import RunOptions

    opts = RunOptions(model=model, **options)
    if yes or not sys.stdin.isatty() or not sys.stdout.isatty():
        sys.exit(headless.run(opts, as_json=as_json))
    if os.environ.get("TERM", "") in ("", "dumb"):
        raise click.UsageError("this terminal (TERM=dumb or unset) cannot show the TUI; add --yes to run without it")
    from bigmoe.serve.preflight import exposure_warning
    from bigmoe.tui.app import run_tui

    if warning := exposure_warning(opts.host, opts.api_key):
        click.echo(f"bigmoe: warning: {warning}", err=True)
    sys.exit(run_tui(opts))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per server.")
def ps(as_json: bool) -> None:
    """List every running bigmoe server: serving (it answers /health) or starting (records of servers that are
    gone are removed)."""
    from bigmoe.serve import client, records

    now = time.time()
    rows = [
        {
            "name": info.name,
            "pid": info.pid,
            "endpoint": info.endpoint,
            "served_name": info.served_name,
            "state": "serving" if client.answers_health(info.endpoint) else "starting",
            "up_s": round(now - info.started, 1),
            "model_path": info.model_path,
            "log": info.log,
        }
        for info in records.live()
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no bigmoe server is running")
    for row in rows:
        fields = (row["name"], f"pid {row['pid']}", row["endpoint"], row["state"], f"up {row['up_s']:.0f} s")
        click.echo("\t".join((*fields, f"log {row['log']}")))


@cli.command()
@click.argument("target", required=False)
@click.option("--all", "stop_all", is_flag=True, help="Stop every running bigmoe server.")
def stop(target: str | None, stop_all: bool) -> None:
    """Stop the server TARGET names (model name, port or pid; optional when only one runs), or all of them.

    SIGTERM to its process group, a wait for every process (children included), then SIGKILL."""
    from bigmoe.serve import launch, records

    if stop_all and target:
        raise click.UsageError("name a server or give --all, not both")
    infos = records.live() if stop_all else [records.one(target)]
    if not infos:
        click.echo("no bigmoe server is running")
    for info in infos:
        launch.stop(launch.Server.of(info))
        click.echo(f"stopped {info.name} (pid {info.pid}, port {info.port})")


@cli.command()
@click.argument("target", required=False)
@click.option(
    "--lines", "-n", default=50, show_default=True, type=click.IntRange(0), help="Lines from the end (0 = all)."
)
@click.option(
    "--follow", "-f", is_flag=True, help="Then print each line as the server writes it, until it exits (Ctrl-C ends)."
)
def logs(target: str | None, lines: int, follow: bool) -> None:
    """Print the end of a server's log: the running one TARGET names (model name, port or pid), else the
    last run's log for that model or port, also after the server has exited."""
    from bigmoe.serve import log_follow, records

    path = records.last_log(target)
    owner = records.log_owner(path) if follow else None
    end = log_follow.read_log(path)
    # A line still being written is shown now only where nothing will finish it; a follow prints it once whole.
    shown = end.lines + ([end.partial] if end.partial and owner is None else [])
    for line in shown[-lines:] if lines else shown:
        click.echo(line)
    if owner is not None:
        log_follow.follow(path, end.offset, lambda: records.process_of(owner) is not None, click.echo)


def _add_optional_commands() -> None:
    from bigmoe.cli.plan import list_presets, plan, probe
    from bigmoe.cli.pull import pull
    from bigmoe.cli.store import list_command, rm_command
    from bigmoe.cli.verify import verify_command

    for command in (probe, plan, pull, verify_command, list_presets, list_command, rm_command):
        cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    _add_optional_commands()
    if not (sys.argv[1:] if argv is None else argv):  # plain `bigmoe`: the help, not an error
        click.echo(cli.get_help(click.Context(cli, info_name="bigmoe")))
        return
    try:
        cli.main(args=argv, prog_name="bigmoe", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"bigmoe: {e.format_message()} (see '{e.ctx.command_path if e.ctx else 'bigmoe'} --help')", err=True)
        sys.exit(exit_codes.USAGE)
    except click.Abort:
        click.echo("bigmoe: interrupted", err=True)
        sys.exit(exit_codes.INTERRUPTED)
    except click.ClickException as e:
        click.echo(f"bigmoe: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except BigmoeError as e:
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(e.exit_code)
    except ValueError as e:  # PresetError, SettingsError
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(exit_codes.ERROR)
    except KeyboardInterrupt:
        click.echo("bigmoe: interrupted", err=True)
        sys.exit(exit_codes.INTERRUPTED)


if __name__ == "__main__":  # python -m bigmoe.cli.commands
    main()
