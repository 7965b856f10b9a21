"""CPython internals hftrain uses (checked on CPython 3.11 by the test suite; the same functions with the same meaning
are in CPython 3.10 to 3.13: Lib/threading.py's `_shutdown`, Modules/atexitmodule.c's `_run_exitfuncs`).

- leaving a distributed process without interpreter teardown (`exit_without_teardown`, parallel/launch.py has why):
  what Python's own exit runs first (`threading._shutdown`: executors' exit hooks, then joining non-daemon threads),
  the atexit handlers (`atexit._run_exitfuncs`), then `os._exit`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from hftrain.compat import Use

CHECKED = ">=3.10,<3.14"

EXIT = Use("python", CHECKED, "ending a distributed process without interpreter teardown")


def require_exit_without_teardown() -> None:
    """Stop before any work on an interpreter whose exit sequence was not checked (`exit_without_teardown` runs at
    the end of a run, too late for a clear error)."""
    EXIT.require()


def exit_without_teardown(code: int) -> NoReturn:
    """Finish what Python's exit would, in its order (threads, atexit handlers, the standard streams), and end the
    process with `code` without tearing the interpreter down."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
