"""The run's JSON-lines files (metrics.jsonl, completions.jsonl, rollouts.jsonl, eval_rollouts.jsonl): one JSON
object per line, appended as the run goes. A resumed run (or one overwriting an earlier run in its output_dir)
continues each file from its checkpoint: `keep_through` drops the rows written after it, and a line cut short by a
crash with it."""

from __future__ import annotations

import json
from pathlib import Path


def _value(line: str, key: str) -> int | None:
    """`key` of a row, or None for a line that is not a whole row (cut short by a crash)."""
    try:
        return json.loads(line)[key]
    except (ValueError, KeyError, TypeError):
        return None


def keep_through(path: Path, last: int, key: str = "step") -> None:
    """Rewrite `path` with only its whole rows whose `key` is at most `last` (nothing when the file is absent)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if (value := _value(line, key)) is not None and value <= last]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
