"""The data group of the recipe: its fields (`DataFields`, `DatasetSource`) and the rules judged from the recipe alone
(`problems`); what loads and batches the data is `hftrain/data/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hftrain.fields import DATA_SUFFIXES as DATA_SUFFIXES  # `as`: re-exported
from hftrain.fields import looks_local as looks_local
from hftrain.fields import recipe_field as _f
from hftrain.paths import DEFAULT_DATASET


@dataclass
class DatasetSource:
    """One dataset of a mixture."""

    name: str
    config: str | None = None
    split: str = "train"
    weight: float = 1.0
    format: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)


@dataclass
class DataFields:
    dataset_name: str = _f(
        str(DEFAULT_DATASET),
        "Hub dataset id, local data file (.json/.jsonl/.csv/.parquet) or a saved `datasets` folder. Default: the "
        "chat data shipped inside hftrain.",
        group="data",
    )
    dataset_config: str | None = _f(None, "Hub dataset configuration name.", group="data")
    dataset_train_split: str = _f("train", "Split used for training.", group="data")
    eval_dataset_name: str | None = _f(
        None, "Separate eval dataset (same forms as dataset_name). Default: carve-out of the training set.",
        group="data",
    )
    eval_split: str = _f("train", "Split of eval_dataset_name used for evaluation.", group="data")
    validation_split_percentage: float = _f(
        5.0, "Percent of the training set held out for evaluation (fixed seed) when no eval_dataset_name; "
        "0 disables evaluation.", group="data",
    )
    dataset_format: str = _f(
        "auto", "Data format; auto detects it from the columns (see docs/data.md for each format's shape).",
        group="data", choices=("auto", "text", "prompt_completion", "alpaca", "messages", "sharegpt", "preference",
                                 "unpaired"),
    )
    dataset_columns: dict[str, str] = _f(
        {}, "Rename columns before format detection, {dataset_column: expected_column}, e.g. {question: prompt}.",
        group="data",
    )
    dataset_mixture: list[DatasetSource] = _f(
        [], "Train on several datasets instead of dataset_name: a list of {name, config, split, weight, columns, "
        "format}; weight 0.5 keeps a fixed-seed half of a dataset, 2.0 repeats it twice.", group="data",
    )
    dataset_text_field: str = _f("text", "Column holding raw text for plain causal-LM data.", group="data")
    dataset_messages_field: str = _f(
        "messages", "Column holding chat messages ({role, content} lists).", group="data"
    )
    chat_template_path: str | None = _f(
        None, "Jinja chat template file to use instead of the tokenizer's. Without either, chat data gets a "
        "ChatML template whose <|im_start|>/<|im_end|> tokens are added (embeddings resized) and <|im_end|> "
        "becomes EOS.", group="data",
    )
    assistant_only_loss: bool = _f(
        True, "For chat data, train on assistant turns only (their end-of-turn token included).", group="data"
    )
    train_on_turns: str = _f(
        "all", "With assistant_only_loss, which assistant turns are trained: all (each in the context the model "
        "sees when it writes it; a template that rewrites earlier turns, e.g. strips past <think> reasoning, "
        "splits a conversation into one example per turn) or last (the final assistant turn only, one example "
        "per conversation). See docs/data.md.", group="data", choices=("all", "last"),
    )
    completion_only_loss: bool = _f(
        True, "For prompt/completion and alpaca data, train on the completion only (EOS included).", group="data"
    )
    max_length: int = _f(512, "Maximum tokens per example (before packing).", group="data")
    overlong_examples: str = _f(
        "truncate", "Examples longer than max_length: truncate (chat: at the last complete assistant turn that "
        "fits, else at max_length) or drop.", group="data", choices=("truncate", "drop"),
    )
    packing: bool = _f(
        False, "Pack examples into rows of max_length tokens (best-fit decreasing), padding-free, with position_ids "
        "restarting per example so no token attends across examples.", group="data",
    )
    max_samples: int | None = _f(None, "Use at most this many training examples (after the eval carve-out).",
                                 group="data")
    dataset_num_proc: int | None = _f(None, "Processes for tokenization (datasets.map num_proc).", group="data")
    dataloader_num_workers: int = _f(0, "Worker processes for batch collation.", group="data")
    dataloader_pin_memory: bool = _f(
        True, "Collate batches into pinned (page-locked) memory so the copy to the GPU can overlap compute "
        "(non_blocking). CUDA only; no effect on CPU.", group="data",
    )
    streaming: bool = _f(
        False, "Stream the training set instead of tokenizing all of it before step 1: a datasets IterableDataset "
        "(a data file, a folder of data files, a saved datasets folder or a hub id) read, tokenized, masked and packed "
        "on the fly, with flat memory and start-up; the checkpoint holds the stream's position, so a resume continues "
        "exactly. Needs max_steps. Ranks read disjoint shards when the shard count is a multiple of the data-parallel "
        "processes, else every rank reads the whole stream. The eval set stays map-style. See docs/data.md.",
        group="data",
    )
    shuffle_buffer_size: int = _f(
        1000, "streaming with train_sampling_strategy random: raw examples held in a buffer from which each next one "
        "is drawn at random (seeded from data_seed; saved in checkpoints). Larger mixes more, costs memory.",
        group="data",
    )
    max_bad_rows: int = _f(
        10, "streaming: raw examples that cannot be read as the dataset's format (a missing column, a wrong type, no "
        "assistant turn) are skipped and counted per logging window; past this many the run stops with a checkpoint "
        "and names the first.", group="data",
    )


def problems(r) -> list[str]:
    """The data group's rules, then streaming's."""
    return _value_problems(r) + _source_problems(r) + _streaming_problems(r)


def _value_problems(r) -> list[str]:
    """Sizes and shares out of range, and local paths that do not exist."""
    problems = []
    if r.max_samples is not None and r.max_samples < 1:
        problems.append(f"max_samples must be >= 1 or unset, got {r.max_samples}")
    if r.max_length < 2:
        problems.append(f"max_length must be >= 2 tokens, got {r.max_length}")
    if not 0 <= r.validation_split_percentage < 100:
        problems.append(f"validation_split_percentage must be in [0, 100), got {r.validation_split_percentage}")
    if r.eval_dataset_name and r.validation_split_percentage not in (0, 5.0):
        problems.append("eval_dataset_name and validation_split_percentage are both set; the carve-out is only used "
                        "without eval_dataset_name")
    if r.dataloader_num_workers < 0:
        problems.append("dataloader_num_workers must be >= 0")
    for name in ("dataset_name", "eval_dataset_name"):
        path = getattr(r, name)
        if path and looks_local(path) and not Path(path).expanduser().exists():
            problems.append(f"{name} {path!r} does not exist; give a data file, a saved dataset folder or a hub id")
    return problems


def _source_problems(r) -> list[str]:
    problems = []
    if r.dataset_mixture and r.dataset_name != str(DEFAULT_DATASET):
        problems.append("dataset_name and dataset_mixture are both set; list every dataset in dataset_mixture")
    formats = DataFields.__dataclass_fields__["dataset_format"].metadata["choices"]
    for i, source in enumerate(r.dataset_mixture):
        if source.weight <= 0:
            problems.append(f"dataset_mixture entry {i} ({source.name}) has weight {source.weight}; use > 0")
        if source.format not in formats:
            problems.append(f"dataset_mixture entry {i} has format {source.format!r}; use one of {', '.join(formats)}")
        if looks_local(source.name) and not Path(source.name).expanduser().exists():
            problems.append(f"dataset_mixture entry {i}: {source.name!r} does not exist")
    if r.train_on_turns == "last" and not r.assistant_only_loss:
        problems.append("train_on_turns=last picks the assistant turn to train, but assistant_only_loss=false trains "
                        "every token; set assistant_only_loss: true or leave train_on_turns at all")
    if r.chat_template_path and not Path(r.chat_template_path).is_file():
        problems.append(f"chat_template_path {r.chat_template_path!r} is not a file")
    if r.dataset_num_proc is not None and r.dataset_num_proc < 1:
        problems.append(f"dataset_num_proc must be >= 1 or unset, got {r.dataset_num_proc}")
    return problems


def _streaming_problems(r) -> list[str]:
    """`streaming: true` and what a stream of unknown length cannot do."""
    problems = []
    if r.shuffle_buffer_size < 1:
        problems.append(f"shuffle_buffer_size must be >= 1, got {r.shuffle_buffer_size}")
    if r.max_bad_rows < 0:
        problems.append(f"max_bad_rows must be >= 0, got {r.max_bad_rows}")
    if not r.streaming:
        return problems
    why = "with streaming: true the training set is a stream of unknown length"
    if r.max_steps <= 0:
        problems.append(f"{why}, so epochs cannot be counted: set max_steps")
    for kind in ("eval", "save"):
        if getattr(r, f"{kind}_strategy") == "epoch":
            problems.append(f"{kind}_strategy=epoch: {why}; use {kind}_strategy: steps with {kind}_steps")
    if r.train_sampling_strategy == "group_by_length":
        problems.append(f"train_sampling_strategy=group_by_length sorts the whole set by length, but {why}; use "
                        "random (a shuffle buffer) or sequential")
    if r.precompute_ref_log_probs:
        problems.append(f"precompute_ref_log_probs computes every training pair's reference once, but {why}; "
                        "turn one of them off")
    return problems
