"""`python -m bigmoe.cli`: the `bigmoe` command without its console script."""

from bigmoe.cli.commands import main

main()
