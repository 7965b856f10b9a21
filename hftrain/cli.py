"""`hftrain finetune ...` and `hftrain merge ...` (the console script installed with the package).

`hftrain finetune` runs one process; multi-process runs go through `accelerate launch hftrain/finetune.py`.
"""

from __future__ import annotations

import sys

COMMANDS = ("finetune", "merge")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: hftrain {{{','.join(COMMANDS)}}} [--help | arguments]", file=sys.stderr)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    if command == "finetune":
        from hftrain.finetune import main as finetune

        finetune(rest)
    else:
        from hftrain.merge import main as merge

        merge(rest, prog="hftrain merge")


if __name__ == "__main__":
    main()
