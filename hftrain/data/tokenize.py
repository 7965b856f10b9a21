"""Tokenization with exact loss masks, truncation policy and per-dataset statistics.

Masks never come from searching marker strings. For chat data the conversation is rendered with
the chat template prefix by prefix: the characters between "everything before this assistant turn
plus the generation prompt" and "everything through this turn" are that turn's answer and its
end-of-turn token; the fast tokenizer's character offsets then mark exactly those tokens.
Prompt/completion strings are tokenized separately (the prompt as at inference, then the
completion and EOS), so the boundary is exact too.

Labels are aligned with input_ids (the loss shifts them) and the first label of every example is
-100: it is never a target, so `(labels != -100).sum()` counts the predicted tokens exactly, also
when examples are packed together.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hftrain.data.formats import to_canonical
from hftrain.errors import HftrainError

IGNORE_INDEX = -100
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DataSpec:
    """The recipe fields that change tokenized data (and so key the tokenization cache)."""

    text_field: str
    messages_field: str
    assistant_only_loss: bool
    completion_only_loss: bool
    max_length: int
    overlong_examples: str

    @classmethod
    def from_recipe(cls, recipe) -> DataSpec:
        return cls(recipe.dataset_text_field, recipe.dataset_messages_field, recipe.assistant_only_loss,
                   recipe.completion_only_loss, recipe.max_length, recipe.overlong_examples)


def prepare_chat_template(tokenizer, chat_template_path: str | None, needs_chat: bool) -> str | None:
    """Install the chat template to use; returns a note when the ChatML fallback changed the tokenizer.

    The fallback adds <|im_start|>/<|im_end|> as special tokens (the model's embeddings must then be
    resized: model.fit_embeddings_to_tokenizer) and makes <|im_end|> the EOS token, so a model trained
    on it stops generating at the end of its turn.
    """
    if chat_template_path:
        tokenizer.chat_template = Path(chat_template_path).read_text(encoding="utf-8")
        return None
    if not needs_chat or tokenizer.chat_template:
        return None
    added = tokenizer.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS)})
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.eos_token = CHATML_TOKENS[1]
    return (f"the tokenizer has no chat template: using ChatML with {added} added special token(s) and "
            f"EOS = {CHATML_TOKENS[1]}")


def assistant_char_spans(tokenizer, messages: list[dict], first_trained: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and [start, end) character spans of assistant turns from `first_trained` on.

    A span runs from the end of the prompt rendered with `add_generation_prompt=True` to the end of the
    conversation rendered through that turn, trailing whitespace excluded: the answer and the
    template's end-of-turn token. An assistant message that opens the conversation answers nothing
    and is context, not trained.
    """
    render = tokenizer.apply_chat_template
    full = render(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < max(first_trained, 1):
            continue
        prompt = render(messages[:i], tokenize=False, add_generation_prompt=True)
        through = render(messages[: i + 1], tokenize=False)
        if not (full.startswith(prompt) and full.startswith(through) and len(through.rstrip()) > len(prompt)):
            raise HftrainError(
                "the chat template does not render conversations prefix by prefix (a later turn changes earlier "
                "text, as templates that strip reasoning from past turns do), so assistant tokens cannot be located "
                "exactly; set chat_template_path to a template that does, or assistant_only_loss=false"
            )
        spans.append((len(prompt), len(through.rstrip())))
    return full, spans


def _encode_chat(tokenizer, messages: list[dict], first_trained: int, trained_only_spans: bool):
    if trained_only_spans:
        text, spans = assistant_char_spans(tokenizer, messages, first_trained)
    else:  # every token is trained: no turn needs locating (and any template works)
        text, spans = tokenizer.apply_chat_template(messages, tokenize=False), []
    # The template already holds BOS if the model wants one: adding special tokens again would double it.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if trained_only_spans:
        # A token is trained when it holds any character of a turn: a prompt ending in a space ("Assistant: ")
        # lets BPE merge that space into the answer's first token, which must still be trained.
        trained = [any(start < e and end > s for s, e in spans) for start, end in offsets]
    else:
        trained = [True] * len(offsets)
    turn_ends = [sum(start < e for start, _ in offsets) for _, e in spans]  # token index after each turn
    return enc["input_ids"], trained, turn_ends


def encode(canonical: dict, tokenizer, spec: DataSpec) -> tuple[list[int], list[bool], list[int]]:
    """(token ids, trained flag per token, token indices where a trained turn ends) for one canonical example."""
    eos = tokenizer.eos_token_id
    if "text" in canonical:
        ids = tokenizer(canonical["text"], add_special_tokens=True)["input_ids"]
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids, [True] * len(ids), []
    if "messages" in canonical:
        return _encode_chat(tokenizer, canonical["messages"], 0, spec.assistant_only_loss)
    prompt, completion = canonical["prompt"], canonical["completion"]
    if isinstance(prompt, list):  # conversational: train the completion's assistant turns
        return _encode_chat(tokenizer, prompt + completion, len(prompt) if spec.completion_only_loss else 0,
                            spec.completion_only_loss or spec.assistant_only_loss)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    trained = [not spec.completion_only_loss] * len(prompt_ids) + [True] * len(completion_ids)
    return prompt_ids + completion_ids, trained, [len(prompt_ids) + len(completion_ids)]


def tokenize_example(example: dict, index: int, tokenizer, spec: DataSpec, fmt: str, name: str) -> dict:
    """input_ids + labels for one raw example, after truncation, with bookkeeping counts."""
    canonical = to_canonical(example, fmt, spec.text_field, spec.messages_field, f"{name} example {index}")
    ids, trained, turn_ends = encode(canonical, tokenizer, spec)
    num_tokens, dropped = len(ids), ""
    if num_tokens > spec.max_length:
        if spec.overlong_examples == "drop":
            ids, trained, dropped = ids[:1], [False], "overlong"
        else:
            # Prefer ending at a complete trained turn (its EOS included) over cutting one in the middle.
            fitting = [end for end in turn_ends if end <= spec.max_length]
            cut = fitting[-1] if fitting else spec.max_length
            ids, trained = ids[:cut], trained[:cut]
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, trained)]
    labels[0] = IGNORE_INDEX
    num_trained = sum(label != IGNORE_INDEX for label in labels)
    if not dropped and num_trained == 0:
        dropped = "no_trained_tokens"
    return {"input_ids": ids, "labels": labels, "num_trained": num_trained, "num_tokens": num_tokens,
            "num_truncated": 0 if dropped else num_tokens - len(ids), "dropped": dropped}


def _fingerprint(raw, tokenizer, spec: DataSpec, fmt: str) -> str:
    """Cache key: raw data, tokenizer (vocab, special tokens, chat template), spec, format and this code."""
    backend = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    parts = [raw._fingerprint, backend, str(tokenizer.chat_template), str(tokenizer.all_special_tokens),
             json.dumps(asdict(spec), sort_keys=True), fmt, inspect.getsource(inspect.getmodule(_fingerprint)),
             inspect.getsource(to_canonical)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def tokenize_dataset(raw, tokenizer, spec: DataSpec, fmt: str, name: str, num_proc: int | None = None):
    """(tokenized examples that have trained tokens, statistics). Cached by `datasets` under a content key."""
    key = _fingerprint(raw, tokenizer, spec, fmt)
    tokenized = raw.map(
        tokenize_example, with_indices=True, remove_columns=raw.column_names, num_proc=num_proc,
        fn_kwargs={"tokenizer": tokenizer, "spec": spec, "fmt": fmt, "name": name},
        new_fingerprint=key, desc=f"tokenizing {name}",
    )
    kept = tokenized.filter(lambda d: d == "", input_columns="dropped", new_fingerprint=key + "-kept",
                            desc=f"dropping untrainable {name}")
    dropped = tokenized["dropped"]
    stats = {
        "format": fmt,
        "examples": len(kept),
        "dropped_overlong": dropped.count("overlong"),
        "dropped_untrainable": dropped.count("no_trained_tokens"),
        "truncated_examples": sum(n > 0 for n in tokenized["num_truncated"]),
        "truncated_tokens": int(sum(tokenized["num_truncated"])),
        "tokens": int(sum(len(ids) for ids in kept["input_ids"])),
        "trained_tokens": int(sum(kept["num_trained"])),
    }
    if len(tokenized) and not len(kept):
        raise HftrainError(
            f"every example of {name} ({len(tokenized)}) has no trained token after masking and truncation to "
            f"max_length={spec.max_length} ({stats['dropped_overlong']} over-long, {stats['dropped_untrainable']} "
            "fully masked); check that assistant turns / completions exist and that the chat template marks them, "
            "or raise max_length"
        )
    return kept.select_columns(["input_ids", "labels"]), stats
