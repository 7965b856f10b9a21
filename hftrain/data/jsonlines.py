"""Streamed `.jsonl` files read by hftrain itself: a line that is not JSON is a bad example, and a resume seeks.

datasets' JSON builder parses a file in blocks with pyarrow: one line that is not JSON raises and ends the stream,
and a resume re-reads the current file up to the position. `json_lines_dataset` gives a `datasets.IterableDataset`
(so `split_dataset_by_node`, `interleave_datasets`, `.take`, `.map`, `set_epoch`'s shard shuffle and
`state_dict()` / `load_state_dict()` all work on it as on datasets' own) whose examples are the lines parsed one by
one with `json.loads`:

- a line that is not a JSON object becomes the example `{BAD_LINE: "file, line N: why"}`, which the streamed
  tokenizer counts as a bad example (`max_bad_rows`) instead of stopping the run; blank lines are skipped;
- its state is datasets' `{shard_idx, shard_example_idx}` plus the byte `offset` of the next line in the current
  file (and its line number), so `load_state_dict` seeks there: resuming costs the same at any position;
- examples are the JSON objects as written (columns renamed by `columns`), not Arrow-typed rows: a key missing
  from one line is missing, not None.

It subclasses datasets' examples-iterable base class (`compat.datasets.ExamplesIterable`, the interface every datasets
source implements; private in datasets, so checked by version there).
"""

from __future__ import annotations

import json
from copy import deepcopy

import datasets
import numpy as np

from hftrain.compat.datasets import ExamplesIterable, require_examples_iterable

BAD_LINE = "hftrain_bad_line"  # the one column of the example standing for a line that is not a JSON object


def parse_line(text: bytes, name: str, line: int, columns: dict[str, str] | None = None) -> dict:
    """One line of a JSON-lines file as an example, or `{BAD_LINE: "file, line N: why"}` when it is not a JSON
    object (also how `origin.bad_json_line` names the line that datasets' reader failed on)."""
    try:
        example = json.loads(text.rstrip())
    except json.JSONDecodeError as exc:
        return {BAD_LINE: f"{name}, line {line}: not JSON ({exc.msg} at column {exc.colno})"}
    except ValueError as exc:  # UnicodeDecodeError
        return {BAD_LINE: f"{name}, line {line}: not JSON ({exc})"}
    if not isinstance(example, dict):
        return {BAD_LINE: f"{name}, line {line}: a JSON {type(example).__name__}, not an object"}
    return {columns.get(key, key): value for key, value in example.items()} if columns else example


class JsonLinesExamples(ExamplesIterable):
    """The examples of JSON-lines files, one shard per file, positioned by byte offset."""

    def __init__(self, files: list[str], columns: dict[str, str] | None = None):
        require_examples_iterable()
        super().__init__()
        self.files, self.columns = list(files), dict(columns or {})
        self._sleep_on_threads_shutdown = False  # read by interleave_datasets: no reader threads here

    def _init_state_dict(self) -> dict:
        self._state_dict = {"shard_idx": 0, "shard_example_idx": 0, "offset": 0, "line": 0,
                            "type": self.__class__.__name__}
        return self._state_dict

    def __iter__(self):
        state = self._state_dict
        first = state["shard_idx"] if state else 0
        for shard_idx in range(first, len(self.files)):
            name = self.files[shard_idx]
            resumed = state is not None and shard_idx == first
            offset, line = (state["offset"], state["line"]) if resumed else (0, 0)
            with open(name, "rb") as f:
                f.seek(offset)
                for text in f:
                    offset, line = offset + len(text), line + 1
                    if not text.strip():
                        if state is not None:
                            state["offset"], state["line"] = offset, line
                        continue
                    example = parse_line(text, name, line, self.columns)
                    if state is not None:  # datasets' convention: the state counts the examples handed out
                        state["offset"], state["line"] = offset, line
                        state["shard_example_idx"] += 1
                    yield f"{shard_idx}_{line}", example
            if state is not None:
                state.update(shard_idx=shard_idx + 1, shard_example_idx=0, offset=0, line=0)

    def shuffle_data_sources(self, generator: np.random.Generator) -> JsonLinesExamples:
        files = list(self.files)
        deepcopy(generator).shuffle(files)
        return JsonLinesExamples(files, self.columns)

    def shard_data_sources(self, num_shards: int, index: int, contiguous=True) -> JsonLinesExamples:
        shards = self.split_shard_indices_by_worker(num_shards, index, contiguous=contiguous)
        return JsonLinesExamples([self.files[i] for i in shards], self.columns)

    def reshard_data_sources(self) -> JsonLinesExamples:
        return JsonLinesExamples(self.files, self.columns)

    @property
    def num_shards(self) -> int:
        return len(self.files)


def json_lines_dataset(files: list[str], columns: dict[str, str] | None = None) -> datasets.IterableDataset:
    """A streamed dataset of JSON-lines files (one shard per file), read line by line."""
    return datasets.IterableDataset(JsonLinesExamples(files, columns))
