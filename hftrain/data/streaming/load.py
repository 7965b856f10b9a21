"""`load_stream`: the recipe's streamed training set (and its in-memory evaluation set) built for one rank, and the
saved states read back."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

from hftrain.config import DatasetSource
from hftrain.data import image_chats, image_pairs
from hftrain.data.formats import detect_format
from hftrain.data.jsonlines import BAD_LINE
from hftrain.data.sources import CHAT_FORMATS, check_objective, load_eval_set, row_origin
from hftrain.data.streaming.feed import StreamCollator, StreamFeed, StreamPlan
from hftrain.data.streaming.rows import RowStream
from hftrain.data.streaming.sources import MIXTURE_RAW, MIXTURE_SOURCE, StreamSource, mix, stream_source
from hftrain.data.tokenize import DataSpec, prepare_chat_template, tokenize_dataset, tokenize_pair, tokenize_rows
from hftrain.errors import HftrainError, first_line


def _is_chat_example(fmt: str, example: dict) -> bool:
    first = "chosen" if fmt == "preference" else "prompt"
    return fmt in CHAT_FORMATS or (fmt in ("prompt_completion", "preference") and isinstance(example.get(first), list))


def _first_example(source: StreamSource) -> dict:
    """The first example that is a JSON object (its columns decide the format)."""
    try:
        return next(example for example in source.open() if BAD_LINE not in example)
    except StopIteration:
        raise HftrainError(f"dataset {source.name!r} holds no example (no line that is a JSON object)") from None
    except Exception as exc:  # noqa: BLE001
        raise HftrainError(f"cannot read dataset {source.name!r}: {first_line(exc)}") from None


def load_stream(recipe, tokenizer, rank: int, world: int, processor=None):
    """(StreamFeed, map-style eval set or None, stats) for `streaming: true`. `processor`: an image-text model's, whose
    image chats are encoded by it (data.image_chats.stream_row), their images opened when a row is read and when it is
    collated, never kept."""
    spec = DataSpec.from_recipe(recipe)
    entries = recipe.dataset_mixture or [DatasetSource(recipe.dataset_name, recipe.dataset_config,
                                                       recipe.dataset_train_split, 1.0, recipe.dataset_format,
                                                       recipe.dataset_columns)]
    parts, firsts, formats = [], [], []
    for entry in entries:
        part = stream_source(entry.name, entry.config, entry.split, entry.columns)
        firsts.append(_first_example(part))
        formats.append(detect_format(list(firsts[-1]), entry.format, spec.text_field, spec.messages_field, part.name))
        check_objective(recipe, formats[-1], part.name)
        parts.append(part)
    mixture = len(entries) > 1 or bool(recipe.dataset_mixture)
    source = mix(parts, [e.weight for e in entries], recipe.order_seed) if mixture else parts[0]
    fmt = formats[0]

    eval_raw, eval_fmt, held_out = None, None, 0
    if recipe.reads_eval_dataset:
        eval_raw, eval_fmt = load_eval_set(recipe, spec)
    elif recipe.validation_split_percentage > 0 and recipe.eval_strategy != "no":
        if source.num_rows is None:
            raise HftrainError(
                f"streaming dataset {source.name!r} has no known length, so validation_split_percentage="
                f"{recipe.validation_split_percentage} cannot be taken from it; set eval_dataset_name, or "
                "validation_split_percentage: 0"
            )
        held_out = max(1, int(source.num_rows * recipe.validation_split_percentage / 100))
        # the carve-out's lines that are not JSON are left out of the eval set (the training stream skips them too);
        # every key of any example becomes a column (from_list would keep only the first example's keys)
        carved = [example for example in source.open().take(held_out) if BAD_LINE not in example]
        keys = dict.fromkeys(key for example in carved for key in example)
        eval_raw = datasets.Dataset.from_list([{key: example.get(key) for key in keys} for example in carved])
        eval_fmt = fmt

    disjoint = world > 1 and source.num_shards % world == 0
    if disjoint and held_out:
        raise HftrainError(
            f"streaming dataset {source.name!r} has {source.num_shards} shards, which {world} ranks read disjointly, "
            "so the eval carve-out (the stream's first examples) cannot be skipped by every rank alike; set "
            "eval_dataset_name, or validation_split_percentage: 0"
        )
    needs_chat = any(_is_chat_example(f, x) for f, x in zip(formats, firsts)) or (
        eval_raw is not None and len(eval_raw) > 0 and _is_chat_example(eval_fmt, eval_raw[0]))
    # an image-text model renders with its processor's own template (as map-style image chats)
    template_note = prepare_chat_template(tokenizer, recipe.chat_template_path, needs_chat) if processor is None \
        else None

    sequential = recipe.train_sampling_strategy == "sequential"

    def open_pass(passes: int):
        raw = source.open()
        if recipe.max_samples is not None:
            raw = raw.take(held_out + recipe.max_samples)  # take() keeps the shard order (datasets refuses to shuffle)
        if not sequential:  # datasets shuffles the shards when the epoch is not 0: seeded by data_seed and the pass
            raw.set_epoch(1 + passes + 1_000_003 * recipe.order_seed)
        return split_dataset_by_node(raw, rank, world, strategy="shards") if disjoint else raw

    name = source.name
    # one local JSON-lines file read by hftrain's reader: a raw example's index is its row in the file (blank lines
    # skipped), so a bad one is named by its line
    origin = row_origin(name, False) if source.seeks and source.num_shards == 1 and not mixture else None

    base = image_chats.base_folder(name)

    def tokenize(example: dict, index: int) -> list[dict]:
        kind, where = fmt, name
        if mixture:  # a mixture's records carry their source and the raw example as JSON
            part = example[MIXTURE_SOURCE]
            example, kind, where = json.loads(example[MIXTURE_RAW]), formats[part], parts[part].name
        if BAD_LINE in example:
            raise HftrainError(example[BAD_LINE])
        place = origin.where(index) if origin is not None else None
        if processor is not None:  # image rows (never a mixture: refused for image-text models)
            encode = image_pairs.stream_pair if fmt == "preference" else image_chats.stream_row
            return [encode(example, processor, spec, base, place or f"dataset {name!r} example {index}")]
        if kind == "preference":
            return [tokenize_pair(example, index, tokenizer, spec, where, place)]
        return tokenize_rows(example, index, tokenizer, spec, kind, where, place)

    stream = RowStream(open_pass, tokenize, shuffle_buffer=1 if sequential else recipe.shuffle_buffer_size,
                       seed=recipe.order_seed * 1_000_003 + (rank if disjoint else 0), packing=recipe.packing,
                       max_length=recipe.max_length, skip=held_out)
    plan = StreamPlan(recipe.per_device_train_batch_size, world, recipe.gradient_accumulation_steps)
    order = "in the files' order" if sequential else f"through a shuffle buffer of {recipe.shuffle_buffer_size}"
    if disjoint:
        reading = (f"{world} ranks read disjoint shards ({source.num_shards // world} of {source.num_shards} each)")
    elif world > 1:
        reading = (f"every rank reads and tokenizes all {source.num_shards} shard(s) ({source.num_shards} is not a "
                   f"multiple of {world} ranks) and keeps its slice of each global batch")
    else:
        reading = f"one rank reads {source.num_shards} shard(s)"
    if recipe.pp_size > 1:  # the loop's data-parallel rank is a copy of the pipeline: its stages train on one batch
        reading += f" (a rank is one copy of the {recipe.pp_size}-stage pipeline: its stages read the same rows)"
    packed = ", packed on the fly" if recipe.packing else ""
    kinds = "/".join(dict.fromkeys(formats))
    workers = f", in {recipe.dataloader_num_workers} worker process(es)" if recipe.dataloader_num_workers else ""
    resumes = ("a resume seeks to the saved line" if source.seeks else
               "a resume re-reads the current shard up to the saved position (datasets)")
    description = f"streaming {name!r} ({kinds}): {reading}, {order}{packed}, tokenized on the fly{workers}; {resumes}"
    if processor is None:
        collator = StreamCollator(0, recipe.packing, fmt == "preference")
    else:  # a dataset of images as bytes (an Image feature) is refused here, before its bytes reach a checkpoint
        image_chats.check_image_paths(firsts[0], f"dataset {name!r} example 0")
        first_examples = source.open().take(image_chats.FILLER_SCAN)
        if fmt == "preference":
            filler = image_pairs.filler_pair(first_examples, processor, spec, base, name)
            collator = image_pairs.StreamImagePairCollator(processor, 0, base, name, filler, world)
        else:
            filler = image_chats.filler_row(first_examples, processor, spec, base, name)
            collator = image_chats.StreamImageCollator(processor, 0, base, name, filler, world)
    per_pass = None  # raw training examples in a pass, when known (for the logged epoch)
    if source.num_rows is not None and not disjoint:
        per_pass = min(source.num_rows - held_out, recipe.max_samples or source.num_rows) or None
    feed = StreamFeed(stream, collator, plan, rank, disjoint, recipe.max_bad_rows, description,
                      recipe.dataloader_num_workers, per_pass, source.seeks, recipe.dataloader_pin_memory)

    evaluation, stats = None, {"streaming": {"source": name, "format": fmt, "shards": source.num_shards,
                                             "rows": source.num_rows, "disjoint_shards": disjoint,
                                             "eval_held_out": held_out},
                               "chat_template": template_note, "sources": []}
    if eval_raw is not None and processor is not None:
        prepare = image_pairs.prepare_pairs if eval_fmt == "preference" else image_chats.prepare
        evaluation, stats["eval"] = prepare(eval_raw, processor, spec, recipe.eval_dataset_name or name)
        evaluation.name = recipe.eval_dataset_name or f"{name} (eval)"
    elif eval_raw is not None:
        evaluation, eval_stats = tokenize_dataset(eval_raw, tokenizer, spec, eval_fmt,
                                                  recipe.eval_dataset_name or f"{name} (eval)",
                                                  recipe.dataset_num_proc)
        stats["eval"] = eval_stats
    stats["eval_examples"] = len(evaluation) if evaluation is not None else 0
    return feed, evaluation, stats


def read_states(folder: Path, pattern: str) -> list[dict]:
    """Every rank's saved stream state in a checkpoint folder (files named by `pattern` with a `*`)."""
    return sorted((json.loads(p.read_text(encoding="utf-8")) for p in folder.glob(pattern)),
                  key=lambda s: s["rank"])
