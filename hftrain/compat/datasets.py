"""datasets internals hftrain uses (checked on datasets 5.2, the version the test suite runs, and 5.0, the lower end
CI runs: constraints/lower.txt).

- a dataset's fingerprint (`Dataset._fingerprint`, the hash datasets keys its own cache with): part of the keys of
  hftrain's tokenization and reference-log-prob caches;
- the examples-iterable interface every streamed source implements (`datasets.iterable_dataset.
  _BaseExamplesIterable`, with its `_init_state_dict` / `_state_dict` / `_sleep_on_threads_shutdown` members), which
  hftrain's JSON-lines reader subclasses (data/jsonlines.py).
"""

from __future__ import annotations

from hftrain.compat import Use

CHECKED = ">=5.0,<5.3"

FINGERPRINT = Use("datasets", CHECKED, "caching tokenized data (the dataset's fingerprint)")
EXAMPLES_ITERABLE = Use("datasets", CHECKED,
                        "streaming .jsonl files (hftrain's reader over datasets' examples interface)")

try:
    from datasets.iterable_dataset import _BaseExamplesIterable as ExamplesIterable
except ImportError:  # a datasets without it: `require_examples_iterable` says so before the reader is built
    ExamplesIterable = object


def fingerprint(dataset) -> str:
    """The hash datasets gives `dataset`'s content and the transforms that made it."""
    FINGERPRINT.require()
    return dataset._fingerprint


def require_examples_iterable() -> None:
    """Stop unless the installed datasets has the examples-iterable interface hftrain's JSON-lines reader was
    written against."""
    EXAMPLES_ITERABLE.require()
