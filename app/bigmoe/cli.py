"""The `bigmoe` command: a thin shell over the pipeline steps.

Every error the user can act on is one line on stderr and a non-zero exit code;
no traceback reaches the terminal.
"""

from __future__ import annotations

import sys
import time

import click

from bigmoe.errors import BigmoeError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bigmoe")
def cli() -> None:
    """Run Mixture-of-Experts LLMs bigger than your GPU, through vLLM."""


@cli.command()
@click.argument("model")
@click.option("--yes", "-y", is_flag=True, help="Headless: accept the plan and run without the TUI.")
@click.option("--prompt", default=None, help="Send one chat request, print the answer with TTFT and TPOT, then stop.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1, 1 << 20), help="Tokens to generate for --prompt.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port of the API.")
@click.option("--api-key", default=None, help="Require this API key (passed to vLLM).")
@click.option("--model-dir", type=click.Path(file_okay=False), default=None, help="Use this checkpoint directory instead of fetching.")
@click.option("--vram-slots", type=click.IntRange(1), default=None, help="VRAM expert slots per layer (beats the plan).")
@click.option("--ram-slots", type=click.IntRange(1), default=None, help="Pinned RAM expert slots per layer (beats the plan).")
@click.option("--compress", type=click.Choice(["on", "off", "auto"]), default=None, help="Lossless FP8 codec for the SSD tier's paging file (records are expanded as they enter RAM).")
@click.option("--paging-dir", type=click.Path(file_okay=False), default=None, help="Directory of the SSD tier's paging file.")
@click.option("--context", type=click.IntRange(128), default=None, help="Context length (tokens).")
@click.option("--force", is_flag=True, help="Launch a plan the estimator refused.")
@click.option("--cuda-graphs/--eager", default=True, show_default=True, help="CUDA: the device-driven pager with decode in CUDA graphs, or the host-driven one in eager mode.")
@click.option("--prefill-buffer/--no-prefill-buffer", default=None, help="CUDA, device-driven pager: prefill over a VRAM buffer of one whole layer's experts (default: when VRAM allows).")
@click.option("--json", "as_json", is_flag=True, help="With --yes: progress as JSON lines.")
@click.option("--start-timeout", default=900.0, show_default=True, type=click.FloatRange(1), help="Seconds to wait for the server to be ready.")
def run(model: str, yes: bool, as_json: bool, **options) -> None:
    """Plan, fetch, prepare and serve MODEL (a preset name such as tiny-moe)."""
    from bigmoe import headless
    from bigmoe.pipeline import RunOptions

    opts = RunOptions(model=model, **options)
    if yes or not sys.stdin.isatty() or not sys.stdout.isatty():
        sys.exit(headless.run(opts, as_json=as_json))
    from bigmoe.tui.app import run_tui

    sys.exit(run_tui(opts))


@cli.command()
def ps() -> None:
    """List running bigmoe servers."""
    from bigmoe import launch

    infos = launch.running()
    if not infos:
        click.echo("no bigmoe server is running")
        return
    for info in infos:
        up = time.time() - info.started
        click.echo(f"{info.name}\tpid {info.pid}\t{info.endpoint}\tup {up:.0f} s\tlog {info.log}")


@cli.command()
@click.argument("model", required=False)
def stop(model: str | None) -> None:
    """Stop a running server (SIGTERM to its process group, then SIGKILL)."""
    from bigmoe import launch

    server = launch.find(model)
    launch.stop(server)
    click.echo(f"stopped {server.info.name} (pid {server.info.pid})")


@cli.command()
@click.argument("model", required=False)
@click.option("--lines", "-n", default=50, show_default=True, type=click.IntRange(0), help="Lines from the end.")
def logs(model: str | None, lines: int) -> None:
    """Print the end of a running server's log."""
    from bigmoe import launch
    from pathlib import Path

    server = launch.find(model)
    text = Path(server.info.log).read_text(errors="replace").splitlines()
    click.echo("\n".join(text[-lines:] if lines else text))


def _add_optional_commands() -> None:
    from bigmoe.cli_plan import plan, probe
    from bigmoe.cli_pull import pull

    for command in (probe, plan, pull):
        cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    _add_optional_commands()
    try:
        cli.main(args=argv, prog_name="bigmoe", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"bigmoe: {e.format_message()} (see 'bigmoe {e.ctx.command.name if e.ctx else ''} --help')", err=True)
        sys.exit(EXIT_USAGE)
    except click.Abort:
        click.echo("bigmoe: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as e:
        click.echo(f"bigmoe: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except BigmoeError as e:
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(e.exit_code)
    except ValueError as e:  # PresetError, SettingsError
        click.echo(f"bigmoe: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("bigmoe: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
