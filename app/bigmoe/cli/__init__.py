"""The `bigmoe` command line: click commands only (the steps they run live in run.py and below).

`main` is imported lazily so that `bigmoe.cli.exit_codes`, which every layer reads, costs no click import."""


def main(argv: list[str] | None = None) -> None:
    """The `bigmoe` console script."""
    from bigmoe.cli.commands import main as run_main

    run_main(argv)
