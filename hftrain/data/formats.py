"""Dataset formats: detection from the columns, validation, and conversion to one of three shapes.

| format            | columns (after `dataset_columns` renames)          | becomes             |
| ----------------- | -------------------------------------------------- | ------------------- |
| text              | `text` (dataset_text_field)                        | text                |
| prompt_completion | `prompt`, `completion` (strings or message lists)  | prompt + completion |
| alpaca            | `instruction`, `output`, optional `input`, `system`| messages            |
| messages          | `messages` (dataset_messages_field): [{role, content}] | messages        |
| sharegpt          | `conversations`: [{from, value}] (human/gpt/system) | messages           |
| preference        | `chosen`, `rejected`, optional `prompt` (strings or message lists) | prompt + chosen + rejected |
| unpaired          | `prompt`, `completion`, `label` (bool, desirable or not): kto's | prompt + completion + label |

Preference pairs with an explicit prompt have a `prompt` column; conversational pairs may instead hold two whole
conversations whose shared leading messages are the prompt (TRL's implicit prompt).

Every example is checked before it is tokenized; a bad one raises HftrainError naming the example.
"""

from __future__ import annotations

import difflib
from typing import Any

from hftrain.errors import HftrainError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def required_columns(fmt: str, text_field: str, messages_field: str) -> tuple[str, ...]:
    return {"text": (text_field,), "prompt_completion": ("prompt", "completion"),
            "alpaca": ("instruction", "output"), "messages": (messages_field,),
            "sharegpt": ("conversations",), "preference": ("chosen", "rejected"),
            "unpaired": ("prompt", "completion", "label")}[fmt]


def check_fields(example: dict, fmt: str, text_field: str, messages_field: str, where: object) -> None:
    """Refuse a row without one of its format's columns. datasets gives a key missing from one line of a file the
    other rows have the value None (hftrain's stream reader leaves it out): without this, the row was refused for
    the type of a value it never had ("messages must be a non-empty list ... got NoneType")."""
    needs = required_columns(fmt, text_field, messages_field)
    for column in needs:
        if example.get(column) is None:
            option = {text_field: f"; dataset_text_field names the column that holds the text (now {text_field!r})",
                      messages_field: "; dataset_messages_field names the column that holds the messages (now "
                                      f"{messages_field!r})"}.get(column, "") if fmt in ("text", "messages") else ""
            raise missing_field(example, column, f"format {fmt} needs {', '.join(needs)}", needs, where, option)


def missing_field(example: dict, column: str, why: str, needs: tuple[str, ...], where: object,
                  option: str = "") -> HftrainError:
    """The error for a row without `column`: the row's place, the field, `why` it is needed, the fields the row has,
    and how to map another name to it (dataset_columns, suggesting the row's field closest to the name; `option`:
    a format's own field option)."""
    has = [key for key, value in example.items() if value is not None]
    others = [key for key in has if key not in needs]
    like = difflib.get_close_matches(column, others, n=1, cutoff=0.5) or others[:1]
    rename = f"{{{like[0]}: {column}}}" if like else f"{{your_column: {column}}}"
    return HftrainError(f"{where}: the row has no {column!r} field (or it is null): {why}; it has "
                        f"{', '.join(repr(key) for key in has) or 'no field with a value'}. Add the field to that row, "
                        f"or rename a column with dataset_columns (a dataset_mixture entry's columns), e.g. "
                        f"{rename}{option}")


def detect_format(columns: list[str], explicit: str, text_field: str, messages_field: str, name: str,
                  objective: str = "sft") -> str:
    """The format named by `explicit`, or the first whose columns are all present (most specific first). Unpaired
    feedback is looked for only when the objective trains on it (kto): SFT data may carry a label column."""
    order = [explicit] if explicit != "auto" else ["unpaired"] * (objective == "kto") + [
        "preference", "messages", "sharegpt", "prompt_completion", "alpaca", "text"]
    for fmt in order:
        if all(c in columns for c in required_columns(fmt, text_field, messages_field)):
            return fmt
    expected = "; ".join(f"{f}: {', '.join(required_columns(f, text_field, messages_field))}" for f in order)
    what = f"format {explicit!r}" if explicit != "auto" else "any known format"
    half = [c for c in ("chosen", "rejected") if c in columns]
    pair = (f"; a preference pair (dpo, simpo, orpo, reward) needs both a chosen and a rejected column, this one has "
            f"only {half[0]}" if len(half) == 1 and explicit in ("auto", "preference") else "")
    raise HftrainError(
        f"dataset {name!r} has columns {columns}, which do not match {what} (expected columns - {expected}){pair}; "
        "rename columns with dataset_columns, or set dataset_format"
    )


def check_messages(messages: Any, where: str) -> list[dict]:
    """Validated OpenAI-style messages, or HftrainError saying what is wrong and where."""
    if not isinstance(messages, list) or not messages:
        raise HftrainError(f"{where}: messages must be a non-empty list of {{role, content}} objects, got "
                           f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise HftrainError(f"{where}: message {i} has role {role!r}; roles must be one of {', '.join(ROLES)} "
                               "(ShareGPT data uses from/value: set dataset_format sharegpt)")
        if not isinstance(m.get("content"), str):
            raise HftrainError(f"{where}: message {i} ({m['role']}) has content of type "
                               f"{type(m.get('content')).__name__}, not a string"
                               + (" (a list of parts is TRL's vision format: image chats train an image-text model, "
                                  "one that AutoModelForImageTextToText loads; see docs/vision.md)"
                                  if isinstance(m.get("content"), list) else ""))
    if not any(m["role"] == "assistant" for m in messages):
        raise HftrainError(f"{where}: the conversation has no assistant message, so nothing can be trained")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt_to_messages(turns: Any, where: str) -> list[dict]:
    if not isinstance(turns, list):
        raise HftrainError(f"{where}: conversations must be a list of {{from, value}} objects")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES:
            who = t.get("from") if isinstance(t, dict) else t
            raise HftrainError(f"{where}: turn {i} is from {who!r}; ShareGPT roles are "
                               f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")})
    return messages


def _alpaca_to_messages(example: dict) -> list[dict]:
    """Instruction (+ input) as the user turn, output as the assistant turn, optional system column."""
    instruction, extra = example["instruction"], example.get("input") or ""
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    """Leading messages both conversations share (TRL's implicit prompt)."""
    return next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))


def preference_to_canonical(example: dict, where: str) -> dict:
    """{"prompt": str|messages, "chosen": same kind, "rejected": same kind}. An identical pair is kept (the
    tokenizer drops and counts it); an empty completion or a pair of mixed kinds is refused."""
    check_fields(example, "preference", "text", "messages", where)
    chosen, rejected, prompt = example["chosen"], example["rejected"], example.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            raise missing_field(example, "prompt", "string pairs need a prompt column (a string), hftrain does not "
                                "guess where the prompt ends in plain text", ("prompt", "chosen", "rejected"), where)
        if not isinstance(prompt, str):
            raise HftrainError(f"{where}: string pairs need a prompt column (a string): hftrain does not guess where "
                               "the prompt ends in plain text; conversational pairs may leave it out")
        if not chosen or not rejected:
            raise HftrainError(f"{where}: the {'chosen' if not chosen else 'rejected'} completion is empty")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise HftrainError(f"{where}: chosen and rejected must both be strings or both be message lists")
    if prompt is None:  # implicit prompt: the shared leading messages
        shared = _shared_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if not isinstance(prompt, list) or not prompt:
        raise HftrainError(f"{where}: a conversational pair needs a prompt of at least one message (a prompt column "
                           "of messages, or conversations that share their first messages)")
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if completion:
            if not isinstance(completion[0], dict) or completion[0].get("role") != "assistant":
                role = completion[0].get("role") if isinstance(completion[0], dict) else completion[0]
                raise HftrainError(f"{where}: the {name} completion starts with a {role} message; a completion is "
                                   "the assistant's answer to the prompt")
            check_messages(prompt + completion, f"{where} ({name})")
    return {"prompt": check_messages(prompt + [{"role": "assistant", "content": ""}], where)[:-1],
            "chosen": chosen, "rejected": rejected}


def unpaired_to_canonical(example: dict, where: str) -> dict:
    """{"prompt": str|messages, "completion": same kind, "label": bool}: one completion rated desirable (true) or
    undesirable (false), TRL's unpaired preference format."""
    check_fields(example, "unpaired", "text", "messages", where)
    label = example["label"]
    if not isinstance(label, bool):
        raise HftrainError(f"{where}: label must be true (a desirable completion) or false (an undesirable one), got "
                           f"{label!r:.60}")
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise HftrainError(f"{where}: the completion is empty, so nothing can be rated")
    elif isinstance(prompt, list) and isinstance(completion, list) and prompt and completion:
        if not isinstance(completion[0], dict) or completion[0].get("role") != "assistant":
            role = completion[0].get("role") if isinstance(completion[0], dict) else completion[0]
            raise HftrainError(f"{where}: the completion starts with a {role} message; a completion is the "
                               "assistant's answer to the prompt")
        check_messages(prompt + completion, where)
    else:
        raise HftrainError(f"{where}: prompt and completion must both be strings or both be non-empty message lists")
    return {"prompt": prompt, "completion": completion, "label": label}


def to_canonical(example: dict, fmt: str, text_field: str, messages_field: str, where: str) -> dict:
    """One of {"text": str}, {"prompt": str|messages, "completion": str|messages}, {"messages": messages}, a
    preference pair {"prompt", "chosen", "rejected"} or unpaired feedback {"prompt", "completion", "label"}."""
    if fmt == "preference":
        return preference_to_canonical(example, where)
    if fmt == "unpaired":
        return unpaired_to_canonical(example, where)
    check_fields(example, fmt, text_field, messages_field, where)
    if fmt == "text":
        text = example[text_field]
        if not isinstance(text, str) or not text:
            raise HftrainError(f"{where}: column {text_field!r} must hold non-empty text, got {text!r:.60}")
        return {"text": text}
    if fmt == "prompt_completion":
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise HftrainError(f"{where}: the completion is empty, so nothing can be trained")
            return {"prompt": prompt, "completion": completion}
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt/completion
            check_messages(prompt + completion, where)
            return {"prompt": prompt, "completion": completion}
        raise HftrainError(f"{where}: prompt and completion must both be strings or both be message lists")
    if fmt == "alpaca":
        if not all(isinstance(example.get(k) or "", str) for k in ("instruction", "input", "output", "system")):
            raise HftrainError(f"{where}: instruction, input, output and system must be strings")
        return {"messages": check_messages(_alpaca_to_messages(example), where)}
    if fmt == "sharegpt":
        return {"messages": check_messages(_sharegpt_to_messages(example["conversations"], where), where)}
    return {"messages": check_messages(example[messages_field], where)}
