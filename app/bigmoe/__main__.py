"""`python -m bigmoe`: the `bigmoe` command without its console script."""

from bigmoe.cli.commands import main

main()
