"""Tokenization with exact loss masks, truncation policy and per-dataset statistics.

Masks never come from searching marker strings. For chat data the conversation is rendered with
the chat template prefix by prefix: the characters between "everything before this assistant turn
plus the generation prompt" and "everything through this turn" are that turn's answer and its
end-of-turn token; the fast tokenizer's character offsets then mark exactly those tokens. A template
that closes only the whole conversation (Phi-3's final EOS) is located the same way, token by token.
Templates that rewrite earlier turns (Qwen3 and DeepSeek-R1 strip past reasoning) use their own
{% generation %} mask when they have one, or else follow `train_on_turns`: `all` expands a
conversation into one example per assistant turn, each rendered as the model sees it when it writes
that turn; `last` trains the final turn only.

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
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hftrain.compat.datasets import fingerprint
from hftrain.data.formats import preference_to_canonical, to_canonical
from hftrain.data.origin import ROW_COLUMN, RowOrigin
from hftrain.errors import HftrainError

IGNORE_INDEX = -100
ROW_COLUMNS = ("input_ids", "labels", "num_trained", "num_tokens", "num_truncated", "dropped", "method",
               "extra_tokens")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
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
    train_on_turns: str = "all"
    max_prompt_length: int | None = None  # preference pairs only
    max_completion_length: int | None = None
    pair_margins: bool = False  # objective reward: keep the pairs' optional `margin` column

    @classmethod
    def from_recipe(cls, recipe) -> DataSpec:
        return cls(recipe.dataset_text_field, recipe.dataset_messages_field, recipe.assistant_only_loss,
                   recipe.completion_only_loss, recipe.max_length, recipe.overlong_examples, recipe.train_on_turns,
                   recipe.max_prompt_length, recipe.max_completion_length, recipe.objective == "reward")


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


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _not_located(what: str) -> HftrainError:
    return HftrainError(
        f"the chat template does not render conversations prefix by prefix: {what}, so assistant tokens cannot be "
        "located exactly. Set chat_template_path to a template that renders the prompt as a prefix of the answer "
        "(or one with {% generation %} markers), or assistant_only_loss=false to train every token"
    )


def _closing_suffix_end(tokenizer, full: str, through: str) -> int | None:
    """Where a turn ends in `full` when `through` is a prefix of `full` plus text that only closes a conversation.

    Phi-3's template appends EOS after the last message only: "everything through this turn" then ends in EOS
    where the whole conversation goes on with the next turn. Compared token by token (markers are single
    tokens, so the next turn's marker never half-matches the EOS), the tokens that follow the shared ones must
    be the very tokens the whole conversation ends with. Returns the character end of the shared tokens.
    """
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    full_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ids = tokenizer(through, add_special_tokens=False)["input_ids"]
    shared = next((k for k, (a, b) in enumerate(zip(ids, full_ids)) if a != b), min(len(ids), len(full_ids)))
    tail = ids[shared:]
    if not shared or not tail or len(full_ids) - len(tail) < shared or full_ids[len(full_ids) - len(tail):] != tail:
        return None
    return offsets[shared - 1][1]


PROBE_TURN = {"role": "user", "content": "?"}


def _final_turn_end(tokenizer, messages: list[dict], through: str, start: int) -> int:
    """Where the final turn's own text ends in `through` (the whole rendering), before a closing suffix.

    Phi-3 ends every conversation with EOS after the last turn's <|end|>; the model stops at <|end|> at
    inference, so the final turn is trained like the others. The suffix is what the conversation also ends
    with when one more (probe) turn follows; a template that renders the turn differently once it is no
    longer last (Qwen3 drops its reasoning) has no such suffix, and the whole rendering is the turn's.
    """
    try:
        longer = _render(tokenizer, [*messages, PROBE_TURN])
    except Exception:  # noqa: BLE001 - a template that refuses the probe simply has no closing suffix to find
        return len(through)
    end = _closing_suffix_end(tokenizer, longer, through)
    return end if end is not None and end > start else len(through)


def _turn_span(tokenizer, messages: list[dict], i: int, full: str) -> tuple[int, int] | None:
    """[start, end) characters of assistant turn i in `full`, or None when the template hides where it is.

    The turn runs from the end of the prompt rendered with `add_generation_prompt=True` to the end of the
    conversation rendered through that turn (less a closing suffix, see above), trailing whitespace excluded.
    """
    prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
    if not full.startswith(prompt):
        return None
    through = _render(tokenizer, messages[: i + 1])
    if through == full and i == len(messages) - 1:
        end = _final_turn_end(tokenizer, messages, through, len(prompt))
    else:
        end = len(through) if full.startswith(through) else _closing_suffix_end(tokenizer, full, through)
    if end is None:
        return None
    end = len(full[:end].rstrip())
    return (len(prompt), end) if end > len(prompt) else None


def _trained_turns(messages: list[dict], first_trained: int) -> list[int]:
    """Assistant turns to train. One that opens the conversation answers nothing: it is context."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= max(first_trained, 1)]


def assistant_char_spans(tokenizer, messages: list[dict], first_trained: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and [start, end) character spans of assistant turns from `first_trained` on.

    Raises HftrainError when a turn cannot be located in the whole rendering (see `_turn_span`).
    """
    full = _render(tokenizer, messages)
    spans = [_turn_span(tokenizer, messages, i, full) for i in _trained_turns(messages, first_trained)]
    if None in spans:
        raise _not_located("a later turn changes earlier text, as templates that strip reasoning from past turns do")
    return full, spans


def _encode_spans(tokenizer, text: str, spans: list[tuple[int, int]]):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    # A token is trained when it holds any character of a turn: a prompt ending in a space ("Assistant: ")
    # lets BPE merge that space into the answer's first token, which must still be trained.
    trained = [any(start < e and end > s for s, e in spans) for start, end in offsets]
    turn_ends = [sum(start < e for start, _ in offsets) for _, e in spans]  # token index after each turn
    return enc["input_ids"], trained, turn_ends


def _encode_generation_marked(tokenizer, messages: list[dict], full: str, first_trained: int):
    """The template's own {% generation %} mask, from the first trained turn on (its prompt must be a prefix)."""
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    turns = _trained_turns(messages, first_trained)
    prompt = _render(tokenizer, messages[: turns[0]], add_generation_prompt=True) if turns else full
    if not full.startswith(prompt):
        raise _not_located("the prompt of the first trained turn is not a prefix of the whole conversation")
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    trained = [bool(keep) and end > len(prompt) for keep, (_, end) in zip(out["assistant_masks"], offsets)]
    turn_ends = [k + 1 for k, keep in enumerate(trained) if keep and (k + 1 == len(trained) or not trained[k + 1])]
    return out["input_ids"], trained, turn_ends


def _encode_chat(tokenizer, messages: list[dict], first_trained: int, assistant_only: bool, train_on_turns: str):
    """(mask method, encodings): one encoding per example the conversation becomes.

    Methods, in order: `prefix` (one example; turns located by rendering prefixes, a closing suffix allowed),
    `generation` (one example; the template's {% generation %} mask), `expanded` (train_on_turns=all: one
    example per trained turn, each the conversation through that turn as the model sees it then), `last`
    (train_on_turns=last: the conversation through its final trained turn, that turn trained).
    """
    if not assistant_only:  # every token is trained: no turn needs locating (and any template works)
        ids = tokenizer(_render(tokenizer, messages), add_special_tokens=False)["input_ids"]
        return "all tokens", [(ids, [True] * len(ids), [])]
    turns = _trained_turns(messages, first_trained)
    if train_on_turns == "last" and turns:
        messages, turns = messages[: turns[-1] + 1], turns[-1:]
    full = _render(tokenizer, messages)
    spans = [_turn_span(tokenizer, messages, i, full) for i in turns]
    if None not in spans:
        return "prefix" if train_on_turns == "all" else "last", [_encode_spans(tokenizer, full, spans)]
    if train_on_turns == "last":
        raise _not_located("the prompt of the final assistant turn is not a prefix of the conversation through it")
    if GENERATION_MARKER.search(str(tokenizer.chat_template)):
        return "generation", [_encode_generation_marked(tokenizer, messages, full, first_trained)]
    encodings = []
    for i in turns:
        through = _render(tokenizer, messages[: i + 1])
        span = _turn_span(tokenizer, messages[: i + 1], i, through)
        if span is None:
            raise _not_located(f"even the prompt of assistant turn {i} is not a prefix of the conversation through it")
        encodings.append(_encode_spans(tokenizer, through, [span]))
    return "expanded", encodings


def encode(canonical: dict, tokenizer, spec: DataSpec) -> tuple[str, list[tuple[list[int], list[bool], list[int]]]]:
    """(mask method, [(token ids, trained flag per token, token indices where a trained turn ends)]).

    One canonical example gives one encoding, or one per assistant turn when it is expanded.
    """
    eos = tokenizer.eos_token_id
    if "text" in canonical:
        ids = tokenizer(canonical["text"], add_special_tokens=True)["input_ids"]
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return "all tokens", [(ids, [True] * len(ids), [])]
    if "messages" in canonical:
        return _encode_chat(tokenizer, canonical["messages"], 0, spec.assistant_only_loss, spec.train_on_turns)
    prompt, completion = canonical["prompt"], canonical["completion"]
    if isinstance(prompt, list):  # conversational: train the completion's assistant turns
        return _encode_chat(tokenizer, prompt + completion, len(prompt) if spec.completion_only_loss else 0,
                            spec.completion_only_loss or spec.assistant_only_loss, spec.train_on_turns)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    trained = [not spec.completion_only_loss] * len(prompt_ids) + [True] * len(completion_ids)
    method = "completion" if spec.completion_only_loss else "all tokens"
    return method, [(prompt_ids + completion_ids, trained, [len(prompt_ids) + len(completion_ids)])]


def _row(ids: list[int], trained: list[bool], turn_ends: list[int], spec: DataSpec) -> dict:
    """input_ids + labels of one encoding after truncation, with bookkeeping counts."""
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


def tokenize_rows(example: dict, index: int, tokenizer, spec: DataSpec, fmt: str, name: str,
                  where: object = None) -> list[dict]:
    """The training rows of one raw example (several when a conversation is expanded), with their mask method.
    A problem names the example as `where` (e.g. its file and line: `origin.Where`), by default `name example index`.

    `method` and `extra_tokens` are on the first row only (so statistics count raw examples): how the mask was
    found, and what expanding cost, the tokens of all rows less the longest one.
    """
    where = f"{name} example {index}" if where is None else where
    canonical = to_canonical(example, fmt, spec.text_field, spec.messages_field, where)
    method, encodings = encode(canonical, tokenizer, spec)
    rows = [{**_row(*encoding, spec), "method": "", "extra_tokens": 0} for encoding in encodings]
    rows[0]["method"] = method
    rows[0]["extra_tokens"] = sum(len(ids) for ids, _, _ in encodings) - max(len(ids) for ids, _, _ in encodings)
    return rows


def tokenize_example(example: dict, index: int, tokenizer, spec: DataSpec, fmt: str, name: str) -> dict:
    """The one row of an example that is not expanded (raises ValueError for one that is)."""
    (row,) = tokenize_rows(example, index, tokenizer, spec, fmt, name)
    return row


PAIR_COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "num_trained", "num_tokens",
                "num_truncated", "dropped", "method", "extra_tokens")


def _pair_side(ids: list[int], trained: list[bool], spec: DataSpec) -> tuple[list[int], list[int], int, str]:
    """(input_ids, labels, prompt tokens, dropped reason) of one completion after the pair truncation policy:
    the prompt keeps its last max_prompt_length tokens, the completion its first max_completion_length, then
    prompt + completion is cut to max_length from the end (or dropped with overlong_examples=drop)."""
    prompt = trained.index(True) if True in trained else len(ids)
    if spec.max_prompt_length is not None and prompt > spec.max_prompt_length:
        cut = prompt - spec.max_prompt_length
        ids, trained, prompt = ids[cut:], trained[cut:], spec.max_prompt_length
    if spec.max_completion_length is not None:
        ids, trained = ids[:prompt + spec.max_completion_length], trained[:prompt + spec.max_completion_length]
    dropped = ""
    if len(ids) > spec.max_length:
        if spec.overlong_examples == "drop" or prompt >= spec.max_length:
            dropped = "overlong"
        ids, trained = ids[:spec.max_length], trained[:spec.max_length]
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, trained)]
    labels[0] = IGNORE_INDEX
    if not dropped and all(label == IGNORE_INDEX for label in labels):
        dropped = "no_trained_tokens"
    return ids, labels, prompt, dropped


def tokenize_pair(example: dict, index: int, tokenizer, spec: DataSpec, name: str, where: object = None) -> dict:
    """One preference pair as two rows that share the prompt: chosen (input_ids, labels) and rejected
    (rejected_input_ids, rejected_labels), each completion's tokens located as SFT completions are.

    A template that renders the prompt differently before the two completions is refused; an identical pair, one
    without a completion token or one whose prompt fills max_length is dropped (and counted).
    """
    where = f"{name} example {index}" if where is None else where
    pair = to_canonical(example, "preference", spec.text_field, spec.messages_field, where)
    completion_spec = replace(spec, completion_only_loss=True, assistant_only_loss=True, train_on_turns="all")
    sides, methods, lengths = [], [], []
    for key in ("chosen", "rejected"):
        if not pair[key]:  # an implicit-prompt conversation with nothing after the shared messages
            sides.append(([tokenizer.eos_token_id or 0], [IGNORE_INDEX], 1, "no_trained_tokens"))
            lengths.append(1)
            continue
        method, encodings = encode({"prompt": pair["prompt"], "completion": pair[key]}, tokenizer, completion_spec)
        if len(encodings) != 1:
            raise HftrainError(f"{where}: the {key} completion has several assistant turns that the chat template "
                               "renders differently once followed by another turn; give one-turn completions")
        ids, trained, _ = encodings[0]
        methods.append(method)
        lengths.append(len(ids))
        sides.append(_pair_side(ids, trained, spec))
    (c_ids, c_labels, c_prompt, c_drop), (r_ids, r_labels, r_prompt, r_drop) = sides
    if not (c_drop or r_drop) and c_ids[:c_prompt] != r_ids[:r_prompt]:
        raise HftrainError(
            f"{where}: the prompt tokens differ between the chosen and the rejected rendering (the chat template "
            "or the tokenizer changes the prompt depending on the answer), so the pair would not compare two answers "
            "to one prompt; fix the template (chat_template_path) or the data"
        )
    dropped = c_drop or r_drop or ("identical" if c_ids == r_ids else "")
    return {"input_ids": c_ids, "labels": c_labels, "rejected_input_ids": r_ids, "rejected_labels": r_labels,
            "num_trained": sum(x != IGNORE_INDEX for x in c_labels + r_labels), "num_tokens": max(lengths),
            "num_truncated": 0 if dropped else sum(lengths) - len(c_ids) - len(r_ids), "dropped": dropped,
            "method": methods[0] if methods else "", "extra_tokens": 0}


UNPAIRED_COLUMNS = ("input_ids", "labels", "desirable", "prompt_length", "num_trained", "num_tokens",
                    "num_truncated", "dropped", "method", "extra_tokens")


def tokenize_unpaired(example: dict, index: int, tokenizer, spec: DataSpec, name: str, where: object = None) -> dict:
    """One rated completion (kto) as one row: input_ids, labels (the completion's tokens, located as SFT completions
    are), `desirable` (the label) and `prompt_length`, where the completion starts (kto pairs this row's prompt
    with another row's completion for its KL reference point). Truncation as a preference pair's side."""
    where = f"{name} example {index}" if where is None else where
    row = to_canonical(example, "unpaired", spec.text_field, spec.messages_field, where)
    completion_spec = replace(spec, completion_only_loss=True, assistant_only_loss=True, train_on_turns="all")
    method, encodings = encode({"prompt": row["prompt"], "completion": row["completion"]}, tokenizer,
                               completion_spec)
    if len(encodings) != 1:
        raise HftrainError(f"{where}: the completion has several assistant turns that the chat template renders "
                           "differently once followed by another turn; give one-turn completions")
    ids, trained, _ = encodings[0]
    kept, labels, prompt, dropped = _pair_side(ids, trained, spec)
    return {"input_ids": kept, "labels": labels, "desirable": row["label"], "prompt_length": prompt,
            "num_trained": sum(x != IGNORE_INDEX for x in labels), "num_tokens": len(ids),
            "num_truncated": 0 if dropped else len(ids) - len(kept), "dropped": dropped, "method": method,
            "extra_tokens": 0}


MARGIN_COLUMN = "margin"


def pair_margin(example: dict, where: object) -> float:
    """A pair's `margin` (how far the chosen reward should exceed the rejected one: objective reward), a number."""
    value = example[MARGIN_COLUMN]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise HftrainError(f"{where}: margin must be a number (how far the chosen reward should exceed the rejected "
                           f"one), got {value!r}")
    return float(value)


def _examples(batch, indices: list[int], name: str, origin: RowOrigin | None) -> list[tuple[dict, int, object]]:
    """(example, index, where) of a batch of raw rows: a row numbered by load_datasets (ROW_COLUMN) is named by its
    origin (file and line), whatever its position now."""
    batch = dict(batch)
    numbers = batch.pop(ROW_COLUMN, None)
    examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
    places = [origin.where(n) for n in numbers] if numbers is not None and origin is not None else \
        [f"{name} example {i}" for i in indices]
    return list(zip(examples, indices, places))


def _tokenize_pairs_batch(batch: dict, indices: list[int], tokenizer, spec: DataSpec, fmt: str, name: str,
                          origin: RowOrigin | None) -> dict:
    examples = _examples(batch, indices, name, origin)
    rows = [tokenize_pair(example, i, tokenizer, spec, name, where) for example, i, where in examples]
    columns = {key: [row[key] for row in rows] for key in PAIR_COLUMNS}
    if spec.pair_margins and MARGIN_COLUMN in batch:  # reward models: RewardTrainer's optional margin of each pair
        columns[MARGIN_COLUMN] = [pair_margin(example, where) for example, _, where in examples]
    return columns


def _unpair_batch(batch: dict, name: str, origin: RowOrigin | None) -> dict:
    """TRL's unpair_preference_dataset on one map batch: its pairs' chosen completions (label true), then their
    rejected ones (label false), each with the pair's prompt (an implicit prompt split off as for dpo) and row."""
    size = len(next(iter(batch.values())))
    numbers = batch.get(ROW_COLUMN, [None] * size)
    examples = _examples(batch, list(range(size)), name, origin)
    rows = [(preference_to_canonical(example, where), number) for (example, _, where), number in zip(examples, numbers)]
    out = {"prompt": [], "completion": [], "label": [], ROW_COLUMN: []}
    for key, label in (("chosen", True), ("rejected", False)):
        for pair, number in rows:
            out["prompt"].append(pair["prompt"])
            out["completion"].append(pair[key])
            out["label"].append(label)
            out[ROW_COLUMN].append(number)
    return out if ROW_COLUMN in batch else {k: v for k, v in out.items() if k != ROW_COLUMN}


def unpair(raw, name: str, origin: RowOrigin | None = None):
    """Preference pairs as kto's unpaired rows (TRL's unpair_preference_dataset, batches of 1000 as its map)."""
    return raw.map(_unpair_batch, batched=True, batch_size=1000, remove_columns=raw.column_names,
                   fn_kwargs={"name": name, "origin": origin}, new_fingerprint=f"{fingerprint(raw)}-unpaired",
                   desc=f"unpairing {name}")


def _tokenize_unpaired_batch(batch: dict, indices: list[int], tokenizer, spec: DataSpec, fmt: str, name: str,
                             origin: RowOrigin | None) -> dict:
    rows = [tokenize_unpaired(example, i, tokenizer, spec, name, where)
            for example, i, where in _examples(batch, indices, name, origin)]
    return {key: [row[key] for row in rows] for key in UNPAIRED_COLUMNS}


def _tokenize_batch(batch: dict, indices: list[int], tokenizer, spec: DataSpec, fmt: str, name: str,
                    origin: RowOrigin | None) -> dict:
    rows = [row for example, i, where in _examples(batch, indices, name, origin)
            for row in tokenize_rows(example, i, tokenizer, spec, fmt, name, where)]
    return {key: [row[key] for row in rows] for key in ROW_COLUMNS}


def _fingerprint(raw, tokenizer, spec: DataSpec, fmt: str) -> str:
    """Cache key: raw data, tokenizer (vocab, special tokens, chat template), spec, format and this code."""
    backend = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    parts = [fingerprint(raw), backend, str(tokenizer.chat_template), str(tokenizer.all_special_tokens),
             json.dumps(asdict(spec), sort_keys=True), fmt, inspect.getsource(inspect.getmodule(_fingerprint)),
             inspect.getsource(inspect.getmodule(to_canonical))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def tokenize_dataset(raw, tokenizer, spec: DataSpec, fmt: str, name: str, num_proc: int | None = None,
                     origin: RowOrigin | None = None):
    """(tokenized examples that have trained tokens, statistics). Cached by `datasets` under a content key. A bad
    row is named by `origin` (its file and line) when `raw` has load_datasets' row numbers, else by position."""
    pairs, unpaired = fmt == "preference", fmt == "unpaired"
    from_pairs = unpaired and "label" not in raw.column_names  # kto on preference pairs: unpaired first, as TRL
    if from_pairs:
        raw = unpair(raw, name, origin)
    key = _fingerprint(raw, tokenizer, spec, fmt)
    tokenize = _tokenize_pairs_batch if pairs else _tokenize_unpaired_batch if unpaired else _tokenize_batch
    tokenized = raw.map(
        tokenize, batched=True, with_indices=True,
        remove_columns=raw.column_names, num_proc=num_proc,
        fn_kwargs={"tokenizer": tokenizer, "spec": spec, "fmt": fmt, "name": name, "origin": origin},
        new_fingerprint=key, desc=f"tokenizing {name}",
    )
    kept = tokenized.filter(lambda d: d == "", input_columns="dropped", new_fingerprint=key + "-kept",
                            desc=f"dropping untrainable {name}")
    dropped = tokenized["dropped"]
    stats = {
        "format": "unpaired (from preference pairs)" if from_pairs else fmt,
        "examples": len(kept),
        "dropped_overlong": dropped.count("overlong"),
        "dropped_untrainable": dropped.count("no_trained_tokens"),
        **({"dropped_identical": dropped.count("identical")} if pairs else {}),
        **({"desirable": sum(kept["desirable"]), "undesirable": len(kept) - sum(kept["desirable"])}
           if unpaired else {}),
        "truncated_examples": sum(n > 0 for n in tokenized["num_truncated"]),
        "truncated_tokens": int(sum(tokenized["num_truncated"])),
        "tokens": int(sum(len(ids) for ids in kept["input_ids"])) + (
            int(sum(len(ids) for ids in kept["rejected_input_ids"])) if pairs else 0),
        "trained_tokens": int(sum(kept["num_trained"])),
        "mask_methods": {m: n for m in sorted(set(tokenized["method"]) - {""}) if (n := tokenized["method"].count(m))},
        "expansion_extra_tokens": int(sum(tokenized["extra_tokens"])),
    }
    if len(tokenized) and not len(kept) and pairs:
        raise HftrainError(
            f"every pair of {name} ({len(tokenized)}) was dropped: {stats['dropped_identical']} with identical chosen "
            f"and rejected tokens, {stats['dropped_overlong']} whose prompt fills max_length={spec.max_length} (or "
            f"over-long with overlong_examples=drop), {stats['dropped_untrainable']} without a completion token; "
            "check the chosen/rejected columns, or raise max_length / set max_prompt_length"
        )
    if len(tokenized) and not len(kept):
        raise HftrainError(
            f"every example of {name} ({len(tokenized)}) has no trained token after masking and truncation to "
            f"max_length={spec.max_length} ({stats['dropped_overlong']} over-long, {stats['dropped_untrainable']} "
            "fully masked); check that assistant turns / completions exist and that the chat template marks them, "
            "or raise max_length"
        )
    columns = ["input_ids", "labels"] + (["rejected_input_ids", "rejected_labels"] if pairs else []) + (
        ["desirable", "prompt_length"] if unpaired else [])
    if MARGIN_COLUMN in kept.column_names:
        columns.append(MARGIN_COLUMN)
    return kept.select_columns(columns), stats
