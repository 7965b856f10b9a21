"""An image-text model's training data: the recipe's sets read as image chats (hftrain.data.image_chats), where a set
has chosen and rejected columns as image preference pairs (hftrain.data.image_pairs), or for kto as unpaired rows
(hftrain.data.image_unpaired), with the eval set or the carve-out and the statistics the data preview and the
start-up print."""

from __future__ import annotations

from hftrain.data.formats import detect_format
from hftrain.data.image_chats import IMAGES_COLUMN, prepare
from hftrain.data.image_pairs import prepare_pairs
from hftrain.data.image_unpaired import prepare_unpaired
from hftrain.data.sources import check_objective, hold_out, load_raw, numbered, renamed
from hftrain.data.tokenize import DataSpec
from hftrain.errors import HftrainError


def load_image_chats(recipe, processor):
    """(train, eval or None, stats) for an image-text model: dataset_name (and eval_dataset_name, or the
    validation_split_percentage carve-out), read as image chats, or as image preference pairs where the set has chosen
    and rejected columns (hftrain.data.image_pairs; check_objective pairs the format with the objective)."""
    spec = DataSpec.from_recipe(recipe)
    preparers = {"messages": prepare, "preference": prepare_pairs, "unpaired": prepare_unpaired}

    def load(name: str, split: str, columns: dict):
        raw = renamed(load_raw(name, recipe.dataset_config, split), columns, name)
        if not len(raw):
            raise HftrainError(f"dataset {name!r} split {split!r} is empty")
        fmt = detect_format(raw.column_names, recipe.dataset_format, spec.text_field, spec.messages_field, name,
                            recipe.objective) if {"chosen", "rejected"} <= set(raw.column_names) or \
            recipe.objective == "kto" else "messages"
        if recipe.objective == "kto" and fmt == "preference":
            raise HftrainError(f"dataset {name!r} holds preference pairs (chosen, rejected): kto on an image-text "
                               "model trains on unpaired rows (prompt, completion, label and "
                               f"{IMAGES_COLUMN!r}); unpair the pairs into two rows each (TRL's KTOTrainer refuses "
                               "paired vision data too; docs/vision.md)")
        if fmt == "messages" and spec.messages_field not in raw.column_names:
            raise HftrainError(f"dataset {name!r} has columns {raw.column_names}: an image-text model trains on "
                               f"chats ({spec.messages_field!r} with list-of-parts content and an {IMAGES_COLUMN!r} "
                               "column, TRL's vision format; see docs/vision.md) or, for dpo and simpo, on "
                               f"preference pairs (prompt, chosen, rejected and {IMAGES_COLUMN!r})")
        check_objective(recipe, fmt, name)
        return numbered(raw), preparers[fmt]

    raw, prepare_train = load(recipe.dataset_name, recipe.dataset_train_split, recipe.dataset_columns)
    evaluation, stats = None, {"sources": []}
    if recipe.reads_eval_dataset:
        eval_raw, prepare_eval = load(recipe.eval_dataset_name, recipe.eval_split, recipe.dataset_columns)
        evaluation, stats["eval"] = prepare_eval(eval_raw, processor, spec, recipe.eval_dataset_name)
    elif recipe.validation_split_percentage > 0 and recipe.eval_strategy != "no":
        raw, held_out = hold_out(raw, recipe, recipe.dataset_name)
        evaluation, stats["eval"] = prepare_train(held_out, processor, spec, recipe.dataset_name)
        evaluation.name = f"{recipe.dataset_name} (eval)"
    if recipe.max_samples is not None:
        raw = raw.select(range(min(recipe.max_samples, len(raw))))
    train, train_stats = prepare_train(raw, processor, spec, recipe.dataset_name)
    stats["sources"].append({"name": recipe.dataset_name, "weight": 1.0, **train_stats})
    stats["train_examples"] = len(train)
    stats["eval_examples"] = len(evaluation) if evaluation is not None else 0
    return train, evaluation, stats
