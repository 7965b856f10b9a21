"""Check that the installed versions are exactly those a constraints file names (local labels such as +cpu aside).

    python scripts/check_stack.py constraints/lower.txt

`make test-lower` installs constraints/lower.txt's floors, then hftrain with no constraint, as into a user's
environment that already holds that stack; this fails, naming each package, if pip moved any of them, i.e. if
pyproject.toml's ranges do not admit their own floors.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path


def required(path: Path) -> dict[str, str]:
    """name -> version of each `name==version` line."""
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if match := re.fullmatch(r"\s*([A-Za-z0-9_.-]+)==([^\s#;]+)\s*(#.*)?", line):
            found[match.group(1)] = match.group(2)
    return found


def moved(pins: dict[str, str]) -> list[str]:
    problems = []
    for name, version in pins.items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed (wanted {version})")
            continue
        if installed.split("+")[0] != version:
            problems.append(f"{name}: {installed} installed, {version} wanted")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    pins = required(Path(argv[0]))
    if problems := moved(pins):
        print(f"{argv[0]}: pip changed the stack it names: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"{argv[0]}: all {len(pins)} packages at the versions it names")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
