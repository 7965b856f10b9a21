"""A tool shipped as an example of tool calling (recipes/tiny-tools.yaml, docs/grpo.md): a calculator the model calls
(its reward: hftrain.rl.example_rewards.final_answer)."""

from __future__ import annotations

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
