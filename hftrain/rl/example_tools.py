"""A tool and a reward shipped as examples of tool calling (recipes/tiny-tools.yaml, docs/grpo.md): a calculator the
model calls, and a reward for the final answer."""

from __future__ import annotations

import re

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculator(a: int, op: str, b: int) -> int:
    """Compute a op b.

    Args:
        a: The left operand.
        op: One of +, - and *.
        b: The right operand.
    """
    if op not in OPERATIONS:
        raise ValueError(f"unknown operation {op!r}; use one of + - *")
    return OPERATIONS[op](int(a), int(b))


def final_answer(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1 when the completion's last assistant turn states the row's `answer` (its first number), else 0; a text
    completion is read whole."""
    rewards = []
    for completion, expected in zip(completions, answer):
        if isinstance(completion, str):
            text = completion
        else:
            turns = [m for m in completion if m.get("role") == "assistant"]
            text = turns[-1].get("content") or "" if turns else ""
        found = re.search(r"-?\d+", text)
        rewards.append(float(found is not None and int(found.group()) == int(expected)))
    return rewards
