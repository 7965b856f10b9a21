"""Reward functions shipped as examples (recipes/tiny-grpo.yaml, recipes/tiny-vlm-grpo.yaml, docs/grpo.md), with TRL's
signature."""

from __future__ import annotations

import re

VOWELS = set("aeiouAEIOU")


def _text(completion) -> str:
    """A completion's text: a string for text prompts, [{"role": "assistant", "content": ...}] for chat prompts."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def vowel_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The share of a completion's characters that are vowels (0 for an empty completion): a reward a random tiny
    model learns within a few dozen steps, which is what the CI-sized recipe needs to show the reward rising."""
    texts = [_text(c) for c in completions]
    return [sum(ch in VOWELS for ch in t) / len(t) if t else 0.0 for t in texts]


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


QUESTION = re.compile(r"What is (-?\d+) ([-+*]) (-?\d+)\?")


def call_matches_question(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The share of the question's a, op and b ("What is a op b?" in the prompt's last message) that the
    completion's first tool call passes as its arguments (0 without a call): partial credit for using the tool as
    asked, which a tiny model taught the call format can improve on before it gets final answers right."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        asked = QUESTION.search(prompt[-1]["content"] if isinstance(prompt, list) else prompt)
        calls = [c for m in (completion if isinstance(completion, list) else [])
                 for c in (m.get("tool_calls") or [])]
        if asked is None or not calls:
            rewards.append(0.0)
            continue
        arguments = calls[0].get("function", calls[0]).get("arguments") or {}
        wanted = {"a": int(asked.group(1)), "op": asked.group(2), "b": int(asked.group(3))}
        rewards.append(sum(arguments.get(k) == v for k, v in wanted.items()) / 3 if isinstance(arguments, dict)
                       else 0.0)
    return rewards


def answered_from_tool(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """0.5 when the completion's first tool call ran without error (its `tool` message is not TRL's
    `{'error': ...}`), plus 0.5 when its last assistant turn states that call's result; 0 without a call: a reward
    for choosing the tool and answering from it, which a tiny model learns in a few dozen steps (the choice is its
    first tokens) where copying the question's numbers is beyond it."""
    rewards = []
    for completion in completions:
        messages = completion if isinstance(completion, list) else []
        results = [m.get("content") or "" for m in messages if m.get("role") == "tool"]
        if not results or results[0].startswith("{'error'"):
            rewards.append(0.0)
            continue
        turns = [m for m in messages if m.get("role") == "assistant"]
        last = (turns[-1].get("content") or "") if turns and messages[-1].get("role") == "assistant" else ""
        rewards.append(0.5 + 0.5 * (results[0] in re.findall(r"-?\d+", last)))
    return rewards


COLOURS = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}


def shape_colour(image) -> str:
    """The name in COLOURS nearest the mean of an image's coloured pixels (those that are not white, grey or black),
    or "" when it has none."""
    pixels = [p for p in image.convert("RGB").getdata() if max(p) - min(p) > 60]
    if not pixels:
        return ""
    mean = [sum(channel) / len(pixels) for channel in zip(*pixels)]
    return min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(mean, COLOURS[name])))


def colour_letters(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """For prompts with an image (recipes/tiny-vlm-grpo.yaml): the share of the completion's characters that are
    letters of the name of the shape's colour, read from the pixels of the prompt's first image (each image part of
    the prompt holds its image, as TRL hands prompts to reward functions); 0 for an empty completion or a prompt
    without an image. A reward that depends on the image and that a random tiny model can still raise within a few
    dozen steps (every colour's name shares its e)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        images = [part["image"] for message in (prompt if isinstance(prompt, list) else [])
                  for part in (message.get("content") if isinstance(message.get("content"), list) else [])
                  if part.get("type") == "image" and part.get("image") is not None]
        text = _text(completion)
        if not images or not text:
            rewards.append(0.0)
            continue
        letters = set(shape_colour(images[0]))
        rewards.append(sum(ch.lower() in letters for ch in text) / len(text))
    return rewards
