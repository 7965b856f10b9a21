"""python -m hftrain.estimate"""

from hftrain.estimate.cli import main

main()
