"""Where streamed rows come from: a dataset read lazily (hub or local files; each file's rows counted where the
format says), and a weighted mixture of several."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.parquet as pq

from hftrain.data.jsonlines import json_lines_dataset
from hftrain.data.sources import FILE_BUILDERS
from hftrain.errors import HftrainError, first_line


def _data_files(path: Path) -> list[str] | None:
    """The data files a local file or folder of files stands for (None: not local data files)."""
    if path.is_file():
        return [str(path)]
    if path.is_dir() and not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FILE_BUILDERS)
        return [str(p) for p in files] or None
    return None


def _count_rows(files: list[str]) -> int | None:
    """Rows in local .jsonl / .parquet files without decoding them (None for other kinds)."""
    total = 0
    for name in files:
        suffix = Path(name).suffix.lower()
        if suffix == ".jsonl":
            with open(name, "rb") as f:
                total += sum(1 for line in f if line.strip())
        elif suffix == ".parquet":
            total += pq.ParquetFile(name).metadata.num_rows
        else:
            return None
    return total


@dataclass
class StreamSource:
    """One streamed dataset: how to open it (once per pass) and what is known about it before reading it."""

    name: str
    open: Callable[[], object]  # -> a fresh datasets.IterableDataset of raw examples (columns renamed)
    num_shards: int
    num_rows: int | None  # known without reading (local .jsonl/.parquet, saved folders), else None
    seeks: bool = False  # a resume seeks to the position (hftrain's .jsonl reader); else datasets re-reads the shard


def stream_source(name: str, config: str | None, split: str, columns: dict[str, str]) -> StreamSource:
    path = Path(name).expanduser()

    def renamed(raw):
        return raw.rename_columns(columns) if columns else raw

    try:
        files = _data_files(path)
        if files is not None:
            kinds = {FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files}
            if None in kinds or len(kinds) != 1:
                raise HftrainError(f"dataset {name!r}: streamed data files must share one of the extensions "
                                   f"{', '.join(FILE_BUILDERS)}")
            builder = kinds.pop()
            if all(Path(f).suffix.lower() == ".jsonl" for f in files):  # hftrain's reader: bad lines, seeking resume
                return StreamSource(name, lambda: json_lines_dataset(files, columns), len(files), _count_rows(files),
                                    seeks=True)

            def open_files():
                return renamed(datasets.load_dataset(builder, data_files=files, split="train", streaming=True))

            return StreamSource(name, open_files, len(files), _count_rows(files))
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise HftrainError(f"saved dataset {name!r} has splits {list(loaded)}, not {split!r}")
                loaded = loaded[split]
            shards = max(1, len(loaded.cache_files))  # one shard per saved arrow file

            def open_saved():
                return renamed(loaded.to_iterable_dataset(num_shards=shards))

            return StreamSource(name, open_saved, shards, len(loaded))
        probe = datasets.load_dataset(name, config, split=split, streaming=True)
        known = probe.info.splits.get(split) if probe.info and probe.info.splits else None

        def open_hub():
            return renamed(datasets.load_dataset(name, config, split=split, streaming=True))

        return StreamSource(name, open_hub, probe.num_shards, known.num_examples if known else None)
    except HftrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types: one message
        raise HftrainError(
            f"cannot stream dataset {name!r} (split {split!r}): {first_line(exc)}. Give an existing data file, a "
            "folder of data files, a saved datasets folder, or a hub id reachable from this machine"
        ) from None


MIXTURE_SOURCE, MIXTURE_RAW = "hftrain_source", "hftrain_raw"


def mix(parts: list[StreamSource], weights: list[float], seed: int) -> StreamSource:
    """dataset_mixture streamed: `interleave_datasets` draws each next example from a source with probability
    weight / sum of weights (seeded; its generator state is in datasets' state_dict, so a resume continues it); a
    source that ends starts over until every source has ended once (`all_exhausted`). Sources of different formats
    become records {source index, the raw example as JSON}, tokenized by their own format."""
    total = sum(weights)

    def tag(index: int):
        return lambda example: {MIXTURE_SOURCE: index, MIXTURE_RAW: json.dumps(example, default=str)}

    def open_mixture():
        streams = [part.open().map(tag(i)).select_columns([MIXTURE_SOURCE, MIXTURE_RAW]) for i, part in
                   enumerate(parts)]
        return datasets.interleave_datasets(streams, probabilities=[w / total for w in weights], seed=seed,
                                            stopping_strategy="all_exhausted")

    name = "mixture of " + ", ".join(f"{part.name} ({w:g})" for part, w in zip(parts, weights))
    return StreamSource(name, open_mixture, 1, None, seeks=all(part.seeks for part in parts))
