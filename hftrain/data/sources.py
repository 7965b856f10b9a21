"""Where examples come from: files, saved `datasets` folders, hub ids, weighted mixtures, eval splits."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import datasets

from hftrain.config import DatasetSource, Recipe
from hftrain.data.formats import detect_format
from hftrain.data.origin import ROW_COLUMN, RowOrigin, bad_json_line
from hftrain.data.tokenize import DataSpec, prepare_chat_template, tokenize_dataset
from hftrain.errors import HftrainError, first_line

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
CHAT_FORMATS = ("messages", "sharegpt", "alpaca")
# datasets' JSON builder logs the error of a file it cannot parse before raising it ("Failed to load JSON from file
# ... in row 299": pyarrow's 0-based row of a block, not the line); load_raw reports the raise with the file and line
JSON_BUILDER_LOGGER = "datasets.packaged_modules.json.json"


class _DropErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextmanager
def builder_errors_unlogged() -> Iterator[None]:
    """datasets' JSON builder logs no error while a file loads (its warnings still show): each error it logs
    precedes the exception it raises, which `load_raw` reports as one paragraph naming the file and line."""
    logger, dropped = logging.getLogger(JSON_BUILDER_LOGGER), _DropErrors()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def load_raw(name: str, config: str | None, split: str):
    """A `datasets.Dataset` from a data file, a saved dataset folder or a hub id."""
    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise HftrainError(f"dataset file {name!r} has an unsupported extension; use one of "
                                   f"{', '.join(FILE_BUILDERS)} or a saved datasets folder")
            with builder_errors_unlogged():
                return datasets.load_dataset(builder, data_files=str(path), split="train")
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise HftrainError(f"saved dataset {name!r} has splits {list(loaded)}, not {split!r}")
                return loaded[split]
            return loaded
        return datasets.load_dataset(name, config, split=split)
    except HftrainError:
        raise
    except Exception as exc:  # datasets raises many types (DatasetNotFoundError, ArrowInvalid, ...): one message
        if isinstance(exc, StopIteration) or "corresponds to no data" in str(exc):  # how datasets says "empty"
            raise HftrainError(f"dataset {name!r} split {split!r} is empty") from None
        if path.is_file():  # it exists: say what in it cannot be read (pyarrow's JSON errors name no line)
            bad = bad_json_line(path) if FILE_BUILDERS.get(path.suffix.lower()) == "json" else None
            if bad:
                raise HftrainError(f"dataset file {bad}; fix or remove that line") from None
            raise HftrainError(f"dataset file {name!r} cannot be read: {first_line(exc.__cause__ or exc)}; fix the "
                               "file") from None
        raise HftrainError(
            f"cannot load dataset {name!r} (split {split!r}): {first_line(exc)}. Give an existing data file, a saved "
            "datasets folder, or a hub id reachable from this machine (HF_HUB_OFFLINE=1 allows cached ones only)"
        ) from None


def renamed(raw, columns: dict[str, str], name: str):
    """`raw` with the recipe's column renames applied (each renamed column must exist)."""
    missing = sorted(set(columns) - set(raw.column_names))
    if missing:
        raise HftrainError(f"dataset {name!r} has no column(s) {missing} to rename (columns: {raw.column_names})")
    return raw.rename_columns(columns) if columns else raw


def numbered(raw):
    """`raw` with each row's number in its source (origin.ROW_COLUMN), taken before anything reorders the rows, so
    that a bad row is named by its place in the file; tokenization drops the column."""
    return raw.add_column(ROW_COLUMN, list(range(len(raw))))


def row_origin(name: str, in_mixture: bool) -> RowOrigin:
    """Where the rows of source `name` come from: a local file (lines are counted in it) or a dataset."""
    path = Path(name).expanduser()
    label = f"dataset {name!r}" if not path.is_file() else name
    return RowOrigin(label, str(path) if path.is_file() else None, " (a source of dataset_mixture)" if in_mixture
                     else "")


def _weighted(dataset, weight: float, seed: int):
    """floor(weight) full copies plus a fixed-seed sample of the fractional part."""
    copies, fraction = int(weight), weight - int(weight)
    parts = [dataset] * copies
    if fraction > 0:
        parts.append(dataset.shuffle(seed=seed).select(range(math.ceil(fraction * len(dataset)))))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def training_sources(recipe: Recipe) -> list[DatasetSource]:
    """The recipe's training sources: its mixture, or the one dataset as a source of weight 1."""
    if recipe.dataset_mixture:
        return recipe.dataset_mixture
    return [DatasetSource(recipe.dataset_name, recipe.dataset_config, recipe.dataset_train_split, 1.0,
                          recipe.dataset_format, recipe.dataset_columns)]


def check_objective(recipe: Recipe, fmt: str, name: str) -> None:
    """Preference pairs train dpo/simpo/orpo/reward (and kto, unpaired: `objective_format`), unpaired feedback kto,
    everything else sft."""
    if (recipe.objective == "kto") != (fmt == "unpaired") and not (recipe.objective == "kto" and fmt == "preference"):
        if recipe.objective != "kto":
            raise HftrainError(f"dataset {name!r} has format unpaired (prompt, completion, label) but "
                               f"objective={recipe.objective}; unpaired feedback trains objective: kto")
        why = f"it has format {fmt} and no label column"
        raise HftrainError(f"dataset {name!r} cannot train objective=kto: kto learns from unpaired feedback, rows "
                           f"of prompt, completion and label (true for a desirable completion, false for an "
                           f"undesirable one), and {why}; add the label column (or rename yours with "
                           "dataset_columns)")
    if recipe.objective == "kto":
        return
    pairs = recipe.objective not in ("sft", "distill")  # distill's offline completions are sft data's
    if (fmt == "preference") != pairs:
        wanted = "preference pairs (chosen, rejected, optional prompt)" if pairs else \
            "SFT data (a preference dataset needs objective: dpo, simpo, orpo or reward)"
        raise HftrainError(f"dataset {name!r} has format {fmt} but objective={recipe.objective} trains on {wanted}")


def objective_format(recipe: Recipe, fmt: str) -> str:
    """The format the objective trains on: kto takes preference pairs as unpaired rows (TRL's KTOTrainer unpairs
    them: `tokenize.unpair`, after any hold-out, so a pair's two rows stay on one side)."""
    return "unpaired" if recipe.objective == "kto" and fmt == "preference" else fmt


def load_eval_set(recipe: Recipe, spec: DataSpec):
    """(raw eval dataset, its format) of `eval_dataset_name`, renamed and checked against the objective."""
    raw = renamed(load_raw(recipe.eval_dataset_name, recipe.dataset_config, recipe.eval_split),
                  recipe.dataset_columns, recipe.eval_dataset_name)
    fmt = detect_format(raw.column_names, recipe.dataset_format, spec.text_field, spec.messages_field,
                        recipe.eval_dataset_name, recipe.objective)
    check_objective(recipe, fmt, recipe.eval_dataset_name)
    return raw, objective_format(recipe, fmt)


def hold_out(raw, recipe: Recipe, name: str):
    """(train, eval) of a map-style dataset: validation_split_percentage of it held out with the order seed."""
    n_eval = max(1, int(len(raw) * recipe.validation_split_percentage / 100))
    if n_eval >= len(raw):
        raise HftrainError(f"dataset {name!r} has {len(raw)} examples, too few to hold out "
                           f"{recipe.validation_split_percentage}% for evaluation")
    split = raw.train_test_split(test_size=n_eval, seed=recipe.order_seed, shuffle=True)
    return split["train"], split["test"]


def _is_chat(fmt: str, raw) -> bool:
    first = "prompt" if fmt != "preference" and "prompt" in raw.column_names else "chosen"
    return fmt in CHAT_FORMATS or (fmt in ("prompt_completion", "preference", "unpaired") and len(raw) > 0
                                   and isinstance(raw[0][first], list))


def load_datasets(recipe: Recipe, tokenizer):
    """(train, eval or None, stats). Every source is loaded and checked before anything is tokenized.

    The eval carve-out (validation_split_percentage, fixed seed) is taken from each source before
    weighting, so an up-sampled example never lands in both splits.
    """
    spec = DataSpec.from_recipe(recipe)
    loaded = []
    for source in training_sources(recipe):
        raw = renamed(load_raw(source.name, source.config, source.split), source.columns, source.name)
        if not len(raw):
            raise HftrainError(f"dataset {source.name!r} split {source.split!r} is empty")
        fmt = detect_format(raw.column_names, source.format, spec.text_field, spec.messages_field, source.name,
                            recipe.objective)
        check_objective(recipe, fmt, source.name)
        loaded.append((source, numbered(raw), objective_format(recipe, fmt)))
    eval_raw, eval_fmt = load_eval_set(recipe, spec) if recipe.reads_eval_dataset else (None, None)
    needs_chat = any(_is_chat(fmt, raw) for _, raw, fmt in loaded) or (eval_raw is not None and
                                                                        _is_chat(eval_fmt, eval_raw))
    template_note = prepare_chat_template(tokenizer, recipe.chat_template_path, needs_chat)

    trains, evals, stats = [], [], {"sources": [], "chat_template": template_note}
    for source, raw, fmt in loaded:
        origin = row_origin(source.name, len(loaded) > 1)
        if not recipe.eval_dataset_name and recipe.validation_split_percentage > 0 and recipe.eval_strategy != "no":
            raw, held_out = hold_out(raw, recipe, source.name)
            evaluation, _ = tokenize_dataset(held_out, tokenizer, spec, fmt, f"{source.name} (eval)",
                                             recipe.dataset_num_proc,
                                             replace(origin, note=origin.note + ", held out for evaluation"))
            evals.append(evaluation)
        if recipe.max_samples is not None and not recipe.dataset_mixture:
            raw = raw.select(range(min(recipe.max_samples, len(raw))))
        train, train_stats = tokenize_dataset(raw, tokenizer, spec, fmt, source.name, recipe.dataset_num_proc, origin)
        trains.append(_weighted(train, source.weight, recipe.order_seed))
        stats["sources"].append({"name": source.name, "weight": source.weight, **train_stats})
    train = trains[0] if len(trains) == 1 else datasets.concatenate_datasets(trains)
    if recipe.max_samples is not None and recipe.dataset_mixture:  # a fixed-seed sample of the whole mixture
        train = train.shuffle(seed=recipe.order_seed).select(range(min(recipe.max_samples, len(train))))
    if eval_raw is not None:
        evaluation, eval_stats = tokenize_dataset(numbered(eval_raw), tokenizer, spec, eval_fmt,
                                                  recipe.eval_dataset_name, recipe.dataset_num_proc,
                                                  row_origin(recipe.eval_dataset_name, False))
        evals, stats["eval"] = [evaluation], eval_stats
    evaluation = None if not evals else evals[0] if len(evals) == 1 else datasets.concatenate_datasets(evals)
    stats["train_examples"] = len(train)
    stats["eval_examples"] = len(evaluation) if evaluation is not None else 0
    return train, evaluation, stats
