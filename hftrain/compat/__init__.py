"""Every use of a library's private API, one module per library, each gated by the versions it was checked on.

hftrain reaches past a few libraries' public APIs where they offer no public way (torch's pipelining lowering, the
partial load of a pipeline stage inside transformers' loader, CPython's exit sequence, ...). Each such use lives in
`hftrain.compat.<library>` as a small function whose docstring says what it relies on, and calls `require` with the
versions it was checked on (run by the test suite, or read in the library's source where the docstring says so).
Outside them the use stops with one paragraph naming the feature, the checked versions, the installed one and the
install that fixes it, instead of an AttributeError deep inside a run or, worse, different numbers. Nothing is checked
at import: a run that never uses pipeline evaluation never asks which torch schedules it would need.

pyproject.toml declares each such library's range with the same upper bound (tests/unit/test_versions.py holds
them equal), so that what pip resolves runs. Updating a library: read the new version's source for these uses, run
the suite on it, fix what moved, and widen the module's `CHECKED` range and pyproject.toml's together.
tests/unit/test_compat.py checks that no module outside hftrain/compat imports a
private name or reads a private attribute of a library.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hftrain.errors import HftrainError


@functools.cache
def installed_version(library: str) -> str | None:
    """The installed version of a distribution (`python` for the interpreter), None when it is not installed."""
    if library == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def within(library: str, versions: str) -> bool:
    """Whether the installed `library` is in `versions` (a PEP 440 specifier; local labels such as +cpu ignored)."""
    installed = installed_version(library)
    return installed is not None and Version(installed).public in SpecifierSet(versions)


@dataclass(frozen=True)
class Use:
    """One use of a library's internals: the library (its distribution name, or "python"), the versions it was
    checked on (a PEP 440 specifier) and what hftrain does with it, in a few words. The compat function calls
    `require()` before it touches them; the preflight asks every use a recipe will make for its `problem()` first,
    so that a run stops before any weight loads."""

    library: str
    versions: str
    what: str

    def problem(self) -> str | None:
        """None within the checked versions, else the one-paragraph reason."""
        return None if within(self.library, self.versions) else outside(self.library, self.versions, self.what)

    def require(self) -> None:
        if (problem := self.problem()) is not None:
            raise HftrainError(problem)


def require(library: str, versions: str, use: str) -> None:
    """Stop with a clear error unless the installed `library` is within `versions`, the versions on which `use` (what
    hftrain does with the library's internals, in a few words) was checked."""
    Use(library, versions, use).require()


def outside(library: str, versions: str, use: str) -> str:
    """The reason `use` cannot run with the installed `library`, and the install that fixes it. pyproject.toml
    declares the same range (tests/unit/test_versions.py), so only an environment changed after hftrain was installed
    (an upgrade, a --no-deps install) gets here."""
    installed = installed_version(library) or "none"
    if library == "python":
        fix = f"run hftrain with a Python in that range (python{versions})"
    else:
        fix = f"pip install '{library}{versions}', the range this hftrain declares"
    return (f"{use} relies on {library} internals that this hftrain ({installed_version('hftrain') or 'source'}) "
            f"was checked with on {library}{versions}, and {library} {installed} is installed: {fix}")
