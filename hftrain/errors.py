"""User-facing errors: one paragraph on stderr, a non-zero exit, no library traceback."""

import gc
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class HftrainError(Exception):
    """A problem the user can fix (bad recipe, missing file, unsupported combination).

    The message is shown as-is, as one paragraph; it names the field or file and what to do.
    """

    exit_code = 2
    same_in_every_process = False  # set by `same_in_every_process()`: see `report_and_exit`


class ConfigError(HftrainError):
    """Every problem found, reported together, under what they are problems of: "invalid <source>, N problems:
    (1) ... (2) ...". `groups` adds problems of other sources, reported after, one source after another (a typo on
    the command line is the command line's, not the recipe file's). A group whose source is None holds problems
    that are not of the recipe or the command line and say so themselves (a model that cannot be loaded: "cannot
    load model 'x': ..."): they are reported first, as they are, with no "invalid ..." before them."""

    def __init__(self, problems: Iterable[str] = (), source: str | None = "recipe", *,
                 groups: Iterable[tuple[str | None, list[str]]] = ()):
        merged: dict[str | None, list[str]] = {}
        for name, found in [(source, list(problems)), *groups]:
            if found:
                merged.setdefault(name, []).extend(found)
        self.groups = sorted(merged.items(), key=lambda group: group[0] is not None)  # source None first
        self.problems = [problem for _, found in self.groups for problem in found]
        super().__init__("; ".join(_group_text(name, found) for name, found in self.groups))


def _group_text(source: str | None, problems: list[str]) -> str:
    if source is None:
        return "; ".join(problems)
    numbered = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return f"invalid {source}, {len(problems)} {'problem' if len(problems) == 1 else 'problems'}: {numbered}"


# How long a process that is not its machine's first waits, after an error every process meets alike, for the
# launcher to stop it once the first process has reported the error and exited; past that it reports it itself.
ALIKE_WAIT_SECONDS = 60


@contextmanager
def same_in_every_process() -> Iterator[None]:
    """Mark the HftrainErrors raised inside as ones that every process of a machine meets alike, because they come
    from what all of them read (the recipe, the launch preset, the machine), not from a process's own share."""
    try:
        yield
    except HftrainError as error:
        error.same_in_every_process = True
        raise


def report_and_exit(error: HftrainError) -> None:
    """Print `error` as one wrapped paragraph on stderr and exit with its code.

    An error that every process meets alike is printed by each machine's first process (LOCAL_RANK 0) only: the
    others wait, silent, for the launcher, which stops every process once one has exited with an error (torchrun);
    a process still running after ALIKE_WAIT_SECONDS (its first process did not fail) reports the error itself."""
    if error.same_in_every_process and os.environ.get("LOCAL_RANK", "0") != "0":
        time.sleep(ALIKE_WAIT_SECONDS)
    text = textwrap.fill(f"hftrain: error: {error}", width=100, break_on_hyphens=False, break_long_words=False)
    print(text, file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (libraries' messages go on for pages), or its class name; without
    its closing period, since hftrain's sentence goes on after it ("cannot load model 'x': <first line>. Give ...")."""
    text = str(exc).strip()
    line = text.splitlines()[0].rstrip() if text else ""
    return line.rstrip(".") or line or type(exc).__name__


def run_tool(function: Callable[..., T], *args, **kwargs) -> T:
    """The console tools' `main`: run `function`, turning an HftrainError into one paragraph and its exit code.

    What the imports built (torch, transformers: millions of objects) lives as long as the process, so it is frozen
    out of the garbage collector first: neither the collections during the run nor the interpreter's exit walk it
    again (the exit alone took ~3 s of CPU per process)."""
    gc.freeze()
    try:
        return function(*args, **kwargs)
    except HftrainError as error:
        report_and_exit(error)
    except BrokenPipeError:
        # The reader went away (`hftrain presets | head`): what it read is all it wanted. Point stdout at devnull so
        # the interpreter's final flush cannot raise again, and exit as a tool killed by SIGPIPE does (128 + 13).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
