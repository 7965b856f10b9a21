"""Preview what a recipe will train on, before training.

    python -m hftrain.data --config recipe.yaml [--show 3] [--dump N out.jsonl] [--<field> value ...]

--show N   prints the first N training examples as rendered text with the trained tokens marked
           (green on a terminal, otherwise between ⟦ and ⟧), then the statistics and a length histogram.
With streaming: true, --show N prints the first N training rows read from the stream (shuffle buffer and packing
as in training) and the counts of bad and dropped examples met; nothing else is read.
--dump N F writes the first N training rows exactly as the collator yields them (input_ids, labels and
           position_ids when packing), one JSON object per row, in the order of the first steps of a
           1-process run.

For an image-text model the rows are image chats (docs/vision.md): each example shows its image placeholder runs as
<image>xN (N image tokens, never trained), and the statistics count images, image tokens and the examples dropped
because max_length would cut inside an image.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from hftrain.config import load_recipe
from hftrain.data.batching import Collator, training_plan, training_rows
from hftrain.data.image_chats import image_token_ids
from hftrain.data.image_data import load_image_chats
from hftrain.data.sources import load_datasets
from hftrain.data.streaming import load_stream
from hftrain.data.tokenize import IGNORE_INDEX
from hftrain.errors import HftrainError, run_tool
from hftrain.model import build_tokenizer, pad_token_id
from hftrain.options import Parser
from hftrain.vision import build_processor, is_image_text, model_config


def marked_text(tokenizer, input_ids: list[int], labels: list[int], color: bool) -> str:
    """Decoded text with trained runs marked. A token is trained when it is a target (its label is set).

    Runs are decoded whole: a multi-byte character split over several byte-level tokens decodes only
    together.
    """
    start, end = ("\033[42;30m", "\033[0m") if color else ("⟦", "⟧")
    pieces, run, run_trained = [], [], False
    for tok, label in zip(input_ids, labels):
        trained = label != IGNORE_INDEX
        if trained != run_trained and run:
            pieces.append(tokenizer.decode(run) if not run_trained else start + tokenizer.decode(run) + end)
            run = []
        run.append(tok)
        run_trained = trained
    if run:
        pieces.append(tokenizer.decode(run) if not run_trained else start + tokenizer.decode(run) + end)
    return "".join(pieces)


def histogram(lengths: list[int], max_length: int, bins: int = 8, width: int = 40) -> str:
    step = max(1, -(-max_length // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(n // step, bins - 1)] += 1
    top = max(counts) or 1
    return "\n".join(f"  {i * step:>6}-{min((i + 1) * step, max_length):<6} {c:>7} {'#' * round(width * c / top)}"
                     for i, c in enumerate(counts))


METHODS = {
    "prefix": "located by rendering prefixes",
    "generation": "the template's {% generation %} mask",
    "expanded": "expanded to one example per assistant turn (the template rewrites earlier turns)",
    "last": "final assistant turn only",
    "completion": "completion only",
    "all tokens": "every token",
}


def mask_policy(recipe, sources: list[dict]) -> str:
    """One line: the loss policy, how many raw examples each mask method covered, and what expanding cost."""
    policy = (f"assistant_only_loss: true, train_on_turns: {recipe.train_on_turns}" if recipe.assistant_only_loss
              else "assistant_only_loss: false")
    methods: dict[str, int] = {}
    for source in sources:
        for method, n in source["mask_methods"].items():
            methods[method] = methods.get(method, 0) + n
    line = f"masks ({policy}): " + "; ".join(f"{n} example(s) {METHODS.get(m, m)}" for m, n in methods.items())
    extra = sum(source["expansion_extra_tokens"] for source in sources)
    if extra:
        tokens = sum(source["tokens"] for source in sources)
        line += (f". Expanding cost {extra} tokens ({extra / max(tokens - extra, 1):.1%} more than one example per "
                 "conversation); train_on_turns: last trains only each final turn, without that cost")
    return line


def build_arg_parser(prog: str = "python -m hftrain.data") -> Parser:
    """The preview's own options; the other arguments are the recipe's (`load_recipe`)."""
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)  # the rest are the recipe's: a prefix is not guessed
    parser.add_argument("--show", type=int, default=3, help="examples to print (default 3)")
    parser.add_argument("--dump", nargs=2, metavar=("N", "FILE"), help="write the first N collated rows to FILE")
    return parser


def preview(argv: list[str] | None = None) -> None:
    args, rest = build_arg_parser().parse_known_args(argv)
    recipe = load_recipe(rest, for_training=False, prog="python -m hftrain.data")
    if is_image_text(model_config(recipe)):
        if args.dump:
            raise HftrainError("--dump writes collated token rows of text data; for an image-text model the collator "
                               "also makes pixel values: preview image chats with --show")
        preview_image_chats(recipe, args.show, sys.stdout.isatty())
        return

    tokenizer = build_tokenizer(recipe)
    color = sys.stdout.isatty()
    if recipe.streaming:
        return preview_stream(recipe, tokenizer, args.show, color)
    train, evaluation, stats = load_datasets(recipe, tokenizer)
    sides = [("", "input_ids", "labels")]
    if "rejected_input_ids" in train.column_names:  # preference pairs: both completions, trained tokens marked
        sides = [(" chosen", "input_ids", "labels"), (" rejected", "rejected_input_ids", "rejected_labels")]
    for i in range(min(args.show, len(train))):
        row = train[i]
        rated = f", label {str(row['desirable']).lower()}" if "desirable" in row else ""  # kto's unpaired rows
        for name, ids_key, labels_key in sides:
            print(f"--- example {i}{name}{rated} ({len(row[ids_key])} tokens, "
                  f"{sum(lbl != IGNORE_INDEX for lbl in row[labels_key])} trained)")
            print(marked_text(tokenizer, row[ids_key], row[labels_key], color))
    print("--- statistics")
    if stats["chat_template"]:
        print(f"  note: {stats['chat_template']}")
    for source in stats["sources"]:
        share = source["trained_tokens"] / max(source["tokens"], 1)
        print(f"  {source['name']} (weight {source['weight']}, format {source['format']}): {source['examples']} "
              f"examples kept, {source['dropped_overlong']} dropped as over-long, {source['dropped_untrainable']} "
              f"dropped with no trained token, "
              + (f"{source['dropped_identical']} identical pairs dropped, " if "dropped_identical" in source else "")
              + (f"{source['desirable']} desirable and {source['undesirable']} undesirable, "
                 if "desirable" in source else "")
              + f"{source['truncated_examples']} truncated "
              f"({source['truncated_tokens']} tokens cut), {source['trained_tokens']} trained of "
              f"{source['tokens']} tokens ({share:.1%})")
    print(f"  training examples: {stats['train_examples']}, eval examples: {stats['eval_examples']}")
    print(f"  {mask_policy(recipe, stats['sources'])}")
    print(f"--- length histogram (tokens per training example, max_length {recipe.max_length})")
    print(histogram([len(ids) for ids in train["input_ids"]], recipe.max_length))

    if args.dump:
        count, path = int(args.dump[0]), args.dump[1]
        rows = training_rows(train, recipe.packing, recipe.max_length)
        plan = training_plan(recipe, train, rows, world=1)  # what one training process sees
        collator = Collator(train, pad_token_id(tokenizer), rows, packed=recipe.packing)
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            for micro_batch in plan.micro_batches(epoch=0, rank=0):
                batch = collator(micro_batch)
                batch.pop("num_examples")
                for r in range(batch["input_ids"].shape[0]):
                    if written == count:
                        break
                    f.write(json.dumps({k: v[r].tolist() for k, v in batch.items()}) + "\n")
                    written += 1
                if written == count:
                    break
        print(f"--- wrote {written} collated training rows to {path}")


def preview_image_chats(recipe, show: int, color: bool) -> None:
    """Image chats: the first examples with trained tokens marked and image token runs collapsed, then statistics."""
    processor = build_processor(recipe)
    train, _, stats = load_image_chats(recipe, processor)
    tokenizer = processor.tokenizer
    shown = tokenizer.convert_ids_to_tokens(sorted(image_token_ids(processor)))[0]  # <image>, <image_soft_token>, ...
    token = re.escape(shown)
    for i, row in enumerate(train.rows[:show]):
        # an image preference pair (hftrain.data.image_pairs) shows both sides, each a row of its own
        sides = [("", "input_ids", "labels")] + ([("rejected ", "rejected_input_ids", "rejected_labels")]
                                                 if "rejected_input_ids" in row else [])
        for side, ids, labels in sides:
            trained = sum(label != IGNORE_INDEX for label in row[labels])
            what = f"pair {i}, {side or 'chosen '}side" if len(sides) == 2 else f"example {i}"
            print(f"--- {what} ({len(row[ids])} tokens, {len(row['images'])} image(s) = "
                  f"{row['image_tokens']} image tokens, {trained} trained)")
            text = marked_text(tokenizer, row[ids], row[labels], color)
            print(re.sub(f"(?:{token})+", lambda m: f"{shown}x{len(re.findall(token, m.group(0)))}", text))
    print("--- statistics")
    for source in stats["sources"] + ([{"name": "eval", **stats["eval"]}] if "eval" in stats else []):
        print(f"  {source['name']} (format {source['format']}): {source['examples']} examples kept with "
              f"{source['images']} images ({source['image_tokens']} image tokens, never trained), "
              f"{source['dropped_overlong']} dropped as over-long, {source['dropped_image_cut']} dropped because "
              f"max_length={recipe.max_length} would cut inside an image, {source['dropped_no_trained_tokens']} with "
              f"no trained token, " + (f"{source['dropped_identical']} with identical sides, "
                                       if "dropped_identical" in source else "") +
              f"{source['truncated_examples']} truncated ({source['truncated_tokens']} tokens cut), "
              f"{source['trained_tokens']} trained of {source['tokens']} tokens")
    policy = "assistant turns only" if recipe.assistant_only_loss else "every text token"
    policy = f"{policy} (assistant_only_loss: {str(recipe.assistant_only_loss).lower()})"
    if train.rows and "rejected_input_ids" in train.rows[0]:
        policy = "each side's completion (its answer and end-of-turn token)"
    elif train.rows and "prompt_length" in train.rows[0]:  # kto's unpaired rows (hftrain.data.image_unpaired)
        policy = "each row's completion (its answer and end-of-turn token)"
    print(f"  masks: {policy}; image tokens and padding never")
    print(f"--- length histogram (tokens per training example, max_length {recipe.max_length})")
    print(histogram([len(ids) for ids in train["input_ids"]], recipe.max_length))


def preview_stream(recipe, tokenizer, show: int, color: bool) -> None:
    """streaming: true: the first `show` training rows of a 1-process run, read from the stream as training reads them
    (shuffle buffer and packing included), and what reading them met."""
    feed, _, stats = load_stream(recipe, tokenizer, rank=0, world=1)
    print(f"--- {feed.description}")
    for i in range(show):
        row = feed.stream.next_row()
        tokens = sum(len(example["input_ids"]) for example in row)
        print(f"--- row {i} ({len(row)} example(s), {tokens} tokens)")
        for example in row:
            for prefix in ("", "rejected_") if "rejected_input_ids" in example else ("",):
                print(marked_text(tokenizer, example[f"{prefix}input_ids"], example[f"{prefix}labels"], color))
    counts, first_bad = feed.stream.counts, feed.stream.first_bad
    print(f"--- read {counts['examples']} raw example(s): {counts['bad']} bad, {counts['dropped']} row(s) without a "
          "trained token dropped" + (f"; the first bad one: {first_bad}" if first_bad else ""))
    if stats["chat_template"]:
        print(f"  note: {stats['chat_template']}")


def main(argv: list[str] | None = None) -> None:
    run_tool(preview, argv)


if __name__ == "__main__":
    main()
