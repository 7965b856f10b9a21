"""Data: load a dataset, render + tokenize it with exact loss masks, and plan the batches.

Formats (detected from the columns):
- text:     a `dataset_text_field` column; every token is trained, EOS appended.
- messages: a `dataset_messages_field` column of {role, content} dicts, rendered with the
            tokenizer's chat template; with `assistant_only_loss` only assistant turns (their
            end-of-turn token included) are trained. Masks come from character offsets of the
            rendered text, found by rendering the conversation prefix by prefix, never by
            searching for marker strings.

Labels are aligned with input_ids (HF convention, the loss shifts them) and the first label of
every example is -100: it is never a target, so `(labels != -100).sum()` is exactly the number of
predicted tokens. Batching is a deterministic `BatchPlan` (see below) so that data order,
gradient accumulation and data parallelism are exact and resumable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from hftrain.config import Recipe
from hftrain.errors import HftrainError

IGNORE_INDEX = -100
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = ("system", "user", "assistant")


# --------------------------------------------------------------------------- loading
def load_raw(name: str, config: str | None, split: str):
    """A `datasets.Dataset` from a data file, a saved dataset folder or a hub id."""
    import datasets

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise HftrainError(f"dataset file {name!r} has an unsupported extension; use one of "
                                   f"{', '.join(FILE_BUILDERS)} or a saved datasets folder")
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(name, config, split=split)
    except HftrainError:
        raise
    except (FileNotFoundError, ConnectionError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HftrainError(
            f"cannot load dataset {name!r} (split {split!r}): {first_line}. Give an existing data file, a saved "
            "datasets folder, or a hub id reachable from this machine (HF_HUB_OFFLINE=1 allows cached ones only)"
        ) from None


def detect_format(columns: list[str], recipe: Recipe) -> str:
    if recipe.dataset_messages_field in columns:
        return "messages"
    if recipe.dataset_text_field in columns:
        return "text"
    raise HftrainError(
        f"dataset {recipe.dataset_name!r} has columns {columns}, none of which is the messages column "
        f"{recipe.dataset_messages_field!r} or the text column {recipe.dataset_text_field!r}; rename a column or "
        "set dataset_messages_field / dataset_text_field"
    )


# ----------------------------------------------------------------------- tokenizing
def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"message {i} has role {m.get('role') if isinstance(m, dict) else m!r}; roles are {ROLES}"
        if not isinstance(m.get("content"), str):
            return f"message {i} content is {type(m.get('content')).__name__}, not a string"
    return None


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of each assistant turn.

    A turn's span runs from the end of the prompt rendered with `add_generation_prompt=True` to the
    end of the conversation rendered through that turn, trailing whitespace excluded: it holds the
    answer and the template's end-of-turn token.
    """
    render = tokenizer.apply_chat_template
    full = render(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], tokenize=False, add_generation_prompt=True)
        through = render(messages[: i + 1], tokenize=False)
        if not (full.startswith(prompt) and full.startswith(through) and len(through) > len(prompt)):
            raise HftrainError(
                "the chat template does not render conversations prefix by prefix (a turn changes earlier text), "
                "so assistant tokens cannot be located exactly; use a template that does, or assistant_only_loss=false"
            )
        spans.append((len(prompt), len(through.rstrip())))
    return full, spans


def tokenize_example(example: dict, tokenizer, recipe: Recipe, fmt: str) -> dict:
    """input_ids, labels (first one -100), and bookkeeping counts for one example."""
    if fmt == "text":
        text = example[recipe.dataset_text_field]
        if not isinstance(text, str):
            raise HftrainError(f"column {recipe.dataset_text_field!r} holds {type(text).__name__}, not text")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids.append(tokenizer.eos_token_id)
        trained = [True] * len(ids)
    else:
        messages = example[recipe.dataset_messages_field]
        problem = _check_messages(messages)
        if problem:
            raise HftrainError(f"bad chat example in {recipe.dataset_name!r}: {problem}")
        text, spans = assistant_char_spans(tokenizer, messages)
        # The template already holds BOS if the model wants one: adding special tokens again would double it.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if recipe.assistant_only_loss:
            trained = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
        else:
            trained = [True] * len(ids)
    truncated = max(0, len(ids) - recipe.max_length)
    ids, trained = ids[: recipe.max_length], trained[: recipe.max_length]
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, trained)]
    if labels:
        labels[0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "num_trained": sum(lbl != IGNORE_INDEX for lbl in labels),
            "num_truncated": truncated}


def tokenize_dataset(raw, tokenizer, recipe: Recipe, name: str):
    """Tokenize every example (cached by `datasets`), drop those with nothing left to train, report counts."""
    fmt = detect_format(raw.column_names, recipe)
    if fmt == "messages" and not tokenizer.chat_template:
        raise HftrainError(f"{name} data is chat ({recipe.dataset_messages_field!r} column) but the tokenizer of "
                           f"{recipe.tokenizer_name_or_path or recipe.model_name_or_path!r} has no chat template; "
                           "use an instruct model's tokenizer (tokenizer_name_or_path) or text data")
    tokenized = raw.map(
        tokenize_example, fn_kwargs={"tokenizer": tokenizer, "recipe": recipe, "fmt": fmt},
        remove_columns=raw.column_names, desc=f"tokenizing {name}",
    )
    kept = tokenized.filter(lambda n: n > 0, input_columns="num_trained", desc=f"dropping untrainable {name}")
    if len(tokenized) and not len(kept):
        raise HftrainError(
            f"every example of {name} ({len(tokenized)}) has no trained token after masking and truncation to "
            f"max_length={recipe.max_length}; check that assistant turns exist, that the chat template marks them, "
            "or raise max_length"
        )
    stats = {"format": fmt, "examples": len(kept), "dropped_untrainable": len(tokenized) - len(kept),
             "truncated_examples": sum(n > 0 for n in tokenized["num_truncated"]),
             "trained_tokens": int(sum(kept["num_trained"]))}
    return kept.select_columns(["input_ids", "labels"]), stats


def load_datasets(recipe: Recipe, tokenizer):
    """(train, eval or None, stats): raw load, fixed-seed eval carve-out, tokenization."""
    if not len(train_raw := load_raw(recipe.dataset_name, recipe.dataset_config, recipe.dataset_train_split)):
        raise HftrainError(f"dataset {recipe.dataset_name!r} split {recipe.dataset_train_split!r} is empty")
    eval_raw = None
    if recipe.eval_dataset_name:
        eval_raw = load_raw(recipe.eval_dataset_name, recipe.dataset_config, recipe.eval_split)
    elif recipe.validation_split_percentage > 0:
        n_eval = max(1, int(len(train_raw) * recipe.validation_split_percentage / 100))
        if n_eval >= len(train_raw):
            raise HftrainError(f"dataset {recipe.dataset_name!r} has {len(train_raw)} examples, too few to hold "
                               f"out {recipe.validation_split_percentage}% for evaluation")
        split = train_raw.train_test_split(test_size=n_eval, seed=recipe.seed, shuffle=True)
        train_raw, eval_raw = split["train"], split["test"]
    if recipe.max_samples is not None:
        train_raw = train_raw.select(range(min(recipe.max_samples, len(train_raw))))
    train, stats = tokenize_dataset(train_raw, tokenizer, recipe, "train")
    evaluation, eval_stats = tokenize_dataset(eval_raw, tokenizer, recipe, "eval") if eval_raw else (None, None)
    return train, evaluation, {"train": stats, "eval": eval_stats}


# ------------------------------------------------------------------------ batching
@dataclass(frozen=True)
class BatchPlan:
    """Which examples each rank sees in each micro-batch of each optimizer step.

    One optimizer step consumes a global batch of G = micro_batch x world x accum consecutive
    examples of the epoch's order (the dataset order, or a permutation seeded by (seed, epoch)).
    Micro-batch j of rank r is the slice [(j*world + r)*micro_batch, +micro_batch) of that global
    batch, so k micro-batches of b on 1 process and 1 micro-batch of b on k processes see the same
    examples per step. The last step of an epoch may be short: its missing micro-batch slots are
    empty and collate to a fully masked row, so every rank still runs `accum` forward/backward
    passes (collectives stay matched) while the loss only counts real tokens.
    """

    num_examples: int
    micro_batch: int
    world: int
    accum: int
    seed: int
    shuffle: bool

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.global_batch)

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def micro_batches(self, epoch: int, rank: int, start_step: int = 0) -> Iterator[list[int]]:
        """This rank's micro-batches (lists of example indices) from `start_step` to the end of the epoch."""
        order, b = self.epoch_order(epoch), self.micro_batch
        for step in range(start_step, self.steps_per_epoch):
            chunk = order[step * self.global_batch:(step + 1) * self.global_batch]
            for j in range(self.accum):
                first = (j * self.world + rank) * b
                yield chunk[first:first + b]


def eval_micro_batches(num_examples: int, micro_batch: int, world: int, rank: int) -> list[list[int]]:
    """Disjoint evaluation shards with the same number of batches on every rank (short ones may be empty)."""
    stride = micro_batch * world
    return [list(range(start + rank * micro_batch, min(start + (rank + 1) * micro_batch, num_examples)))
            for start in range(0, num_examples, stride)]


class Collator:
    """Right-pads a micro-batch of tokenized examples; an empty micro-batch becomes one fully masked row.

    No attention mask is needed: with right padding a causal model never lets a real token attend
    to a pad, so the real positions' logits are exact, and pad labels are -100.
    """

    def __init__(self, dataset, pad_token_id: int):
        self.dataset = dataset
        self.pad_token_id = pad_token_id

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = self.dataset[indices] if indices else {"input_ids": [[self.pad_token_id]], "labels": [[IGNORE_INDEX]]}
        width = max(len(r) for r in rows["input_ids"])
        input_ids = torch.full((len(rows["input_ids"]), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for i, (ids, lbl) in enumerate(zip(rows["input_ids"], rows["labels"])):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lbl)] = torch.tensor(lbl)
        return {"input_ids": input_ids, "labels": labels}


def make_loader(batches: Iterator[list[int]] | list[list[int]], collator: Collator, num_workers: int):
    """A DataLoader over precomputed index lists (collation may run in worker processes).

    It has its own generator: creating an iterator draws a seed from it, and drawing from the global RNG would
    shift dropout masks whenever a loader is created (e.g. on resume), breaking resume = uninterrupted run.
    """
    return torch.utils.data.DataLoader(
        list(batches), batch_size=None, shuffle=False, collate_fn=collator, num_workers=num_workers,
        generator=torch.Generator(),
    )
