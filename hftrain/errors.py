"""User-facing errors: one paragraph on stderr, a non-zero exit, no library traceback."""

import sys
import textwrap


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
