"""`python -m hftrain launch --preset zero3 ...`: the same as the `hftrain` command."""

from hftrain.cli import main

main()
