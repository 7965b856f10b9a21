"""Data: sources -> formats -> tokenization with exact masks -> rows (packed or not) -> batches.

Public names; the implementation lives in the submodules:
- `sources`: files, saved folders, hub ids, mixtures, eval carve-outs (`load_datasets`)
- `formats`: format detection, validation and conversion (`detect_format`, `to_canonical`)
- `tokenize`: chat templates, masks, truncation, statistics (`tokenize_dataset`)
- `batching`: packing, `BatchPlan` (random, sequential or length-grouped order), `Collator`
`python -m hftrain.data --config recipe.yaml --show 3` previews what will be trained.
The data fields of the recipe and their rules (`problems`) are `hftrain/fields/data.py`.
"""

from hftrain.data.batching import (
    BatchPlan,
    Collator,
    eval_micro_batches,
    make_loader,
    pack_best_fit_decreasing,
    row_lengths,
    training_plan,
    training_rows,
)
from hftrain.data.formats import detect_format, to_canonical
from hftrain.data.sources import load_datasets, load_raw
from hftrain.data.tokenize import (
    CHATML_TEMPLATE,
    IGNORE_INDEX,
    DataSpec,
    assistant_char_spans,
    prepare_chat_template,
    tokenize_dataset,
    tokenize_example,
)
from hftrain.fields.data import problems

__all__ = [
    "BatchPlan", "Collator", "eval_micro_batches", "make_loader", "pack_best_fit_decreasing", "row_lengths",
    "training_plan", "training_rows",
    "detect_format", "to_canonical", "load_datasets", "load_raw", "CHATML_TEMPLATE", "IGNORE_INDEX",
    "DataSpec", "assistant_char_spans", "prepare_chat_template", "tokenize_dataset", "tokenize_example",
    "problems",
]
