"""The `bigmoe` command line: click commands only (the steps they run live in run.py and below)."""


def main(argv: list[str] | None = None) -> None:
    """The `bigmoe` console script (imported lazily: `import bigmoe.cli.x` costs no click import)."""
    from bigmoe.cli.commands import main as run_main

    run_main(argv)
