"""The recipe's groups, one module per concern: each declares its fields (a dataclass mixin) and `problems(recipe)`,
the rules judged from the recipe alone. `config.Recipe` composes the mixins into one flat, typed schema and
`config.validate` gathers every group's problems, so every problem is still reported at once.

These modules import nothing of hftrain but `paths` (the recipe is passed in and read by field name): config
imports them, so they must not import config, nor anything that does (torch, the data pipeline, the backends);
the concern's own package re-exports its `problems` next to its code (e.g. `hftrain.objectives.problems`).
"""

from __future__ import annotations

import os
from dataclasses import field
from typing import Any

# loss_type values of objective grpo (objectives and grpo groups)
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo")


DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow")  # what a local data file ends with


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`)."""
    return (path.startswith((".", "/", "~")) or path.count("/") > 1 or path.lower().endswith(DATA_SUFFIXES)
            or os.path.exists(path))


def recipe_field(default: Any, help: str, *, group: str, choices: tuple | None = None, **kw) -> Any:
    """A recipe field: default, help text (shown by --help), group heading, allowed values."""
    meta = {"help": help, "group": group, "choices": choices}
    if isinstance(default, (list, dict)):  # mutable defaults: a fresh copy per Recipe
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
