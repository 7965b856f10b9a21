"""Reward functions of objective grpo: loaded from the recipe's `reward_funcs` (a dotted import path
`pkg.module.func` or `path/to/file.py:func`), checked before any heavy work, and called with TRL's signature
`f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`.

A conversational prompt (a list of messages) gets its completion as `[{"role": "assistant", "content": text}]`, a
text prompt as the text, as TRL does. None means "no reward from this function for this completion" (NaN in the
advantages' nan-sums); every other value must be a real number, one per completion.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hftrain.errors import HftrainError

CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")


@dataclass
class RewardFunction:
    spec: str  # as the recipe wrote it
    name: str  # the function's __name__: the rollouts' and metrics' key (rewards/<name>/mean)
    func: Callable


def load_object(spec: str) -> Callable:
    """The object `spec` names (pkg.module.name or path/to/file.py:name); ImportError / AttributeError / OSError say
    what is missing."""
    if ":" in spec:
        path, _, attr = spec.rpartition(":")
        file = Path(path).expanduser()
        if not file.is_file():
            raise OSError(f"no file {file}")
        module_name = f"hftrain_reward_{abs(hash(str(file.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module  # dataclasses and pickling inside the file look their module up here
        loader.loader.exec_module(module)
    else:
        module_path, _, attr = spec.rpartition(".")
        if not module_path:
            raise ImportError("a dotted path needs a module and a function name, e.g. my_rewards.length_reward")
        module = importlib.import_module(module_path)
    return getattr(module, attr)


def signature_problem(func: Callable, columns: Sequence[str] | None) -> str | None:
    """Why `func` cannot be called as TRL calls reward functions with these dataset columns, or None. `columns`
    None: the columns are not known yet, only TRL's three arguments are checked (a function may require a
    column by name)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None  # a builtin or C function: trust it, its first call is checked
    try:
        names = (*CALL_ARGUMENTS, *(columns or ()))
        (signature.bind_partial if columns is None else signature.bind)(**{name: [] for name in names})
    except TypeError as exc:
        return f"it cannot take the keyword arguments {', '.join(names)} ({exc}); define it as f(prompts, " \
               "completions, completion_ids, **kwargs)"
    return None


def load_reward_functions(specs: Sequence[str]) -> tuple[list[RewardFunction], list[str]]:
    """(the loaded functions, every problem found): each spec imported and checked for TRL's three arguments."""
    funcs, problems = [], []
    for spec in specs:
        try:
            func = load_object(spec)
        except Exception as exc:  # noqa: BLE001 - any failure of user code while importing is reported the same way
            problems.append(f"reward_funcs entry {spec!r} does not load ({type(exc).__name__}: {exc}); give a dotted "
                            "import path pkg.module.func or path/to/file.py:func")
            continue
        if not callable(func):
            problems.append(f"reward_funcs entry {spec!r} is a {type(func).__name__}, not a function")
            continue
        problem = signature_problem(func, None)
        if problem:
            problems.append(f"reward_funcs entry {spec!r}: {problem}")
            continue
        funcs.append(RewardFunction(spec, getattr(func, "__name__", spec.rpartition(".")[2]), func))
    names = [f.name for f in funcs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"reward_funcs has two functions named {name!r}: their metrics and rollout columns would "
                        "collide; rename one")
    return funcs, problems


def column_problems(funcs: Sequence[RewardFunction], columns: Sequence[str]) -> list[str]:
    """Problems of calling the functions with the dataset's other columns (known once the data is loaded)."""
    problems = []
    for f in funcs:
        problem = signature_problem(f.func, columns)
        if problem:
            problems.append(f"reward function {f.spec!r} with the dataset's columns: {problem}")
    return problems


class RewardFailure(HftrainError):
    """A reward function returned something that is not one number (or None) per completion."""


def score(funcs: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> torch.Tensor:
    """[completions, functions] float32 rewards, NaN where a function returned None."""
    out = torch.full((len(completions), len(funcs)), math.nan, dtype=torch.float32)
    for k, f in enumerate(funcs):
        try:
            values = f.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:  # noqa: BLE001 - user code: every failure stops the run the same way, named
            raise RewardFailure(f"reward function {f.spec!r} raised {type(exc).__name__}: {exc}") from exc
        try:
            values = list(values)
        except TypeError:
            raise RewardFailure(f"reward function {f.spec!r} returned a {type(values).__name__}, not a list of "
                                f"{len(completions)} numbers (one per completion; None for no reward)") from None
        if len(values) != len(completions):
            raise RewardFailure(f"reward function {f.spec!r} returned {len(values)} rewards for {len(completions)} "
                                "completions; it must return exactly one per completion (None for no reward)")
        for i, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardFailure(f"reward function {f.spec!r} returned {value!r} for completion {i}: rewards must "
                                    "be finite numbers, or None for no reward")
            out[i, k] = float(value)
    return out
