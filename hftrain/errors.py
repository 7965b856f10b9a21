"""User-facing errors: one paragraph on stderr, a non-zero exit, no library traceback."""

import sys
import textwrap
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HftrainError(Exception):
    """A problem the user can fix (bad recipe, missing file, unsupported combination).

    The message is shown as-is, as one paragraph; it names the field or file and what to do.
    """

    exit_code = 2


class ConfigError(HftrainError):
    """Every problem found in a recipe, reported together."""

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = list(problems)
        numbered = " ".join(f"({i}) {p}" for i, p in enumerate(self.problems, 1))
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid {source}, {len(self.problems)} {noun}: {numbered}")


def report_and_exit(error: HftrainError) -> None:
    """Print `error` as one wrapped paragraph on stderr and exit with its code."""
    text = textwrap.fill(f"hftrain: error: {error}", width=100, break_on_hyphens=False, break_long_words=False)
    print(text, file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (libraries' messages go on for pages), or its class name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def run_tool(function: Callable[..., T], *args, **kwargs) -> T:
    """The console tools' `main`: run `function`, turning an HftrainError into one paragraph and its exit code."""
    try:
        return function(*args, **kwargs)
    except HftrainError as error:
        report_and_exit(error)
