"""Streaming training data (`streaming: true`): read, tokenized and packed on the fly, resumed exactly.

The training set is a `datasets.IterableDataset` of raw examples (local data files, a folder of them, a saved
`datasets` folder or a hub id; `load_dataset(..., streaming=True)` / `to_iterable_dataset`). Nothing is tokenized
or cached before step 1: `RowStream` pulls raw examples one at a time, through an optional seeded shuffle buffer,
tokenizes and masks each with the same code as map-style data (`tokenize.tokenize_rows` / `tokenize_pair`), drops
rows without a trained token (counted), packs rows on the fly when `packing` is on, and hands out training rows.

Ranks. With a shard count divisible by the data-parallel world, `split_dataset_by_node(strategy="shards")` gives
each rank its own shards: each rank streams, shuffles and packs its own rows and takes
per_device_train_batch_size x gradient_accumulation_steps of them per step. Otherwise (one file, say) every rank
reads and tokenizes the whole stream and keeps its slice of each global batch exactly as `BatchPlan` slices a
map-style global batch, so a streamed run with sequential order and no packing trains the rows of the map-style
run, and 2 processes train the rows of 1 process with the same global batch. (datasets' own "examples" split keeps
one raw example in world; that would give other rows to each rank than the map-style plan does.)

Exact resume. A checkpoint holds, per rank, the stream's state at the step boundary (`StreamFeed.state_dict`):
datasets' `state_dict()` of the raw stream (position in shards and examples; on resume datasets skips whole shards;
`.jsonl` files, read by `jsonlines`, seek to the byte offset of the next line, while datasets' other readers re-read
the current shard up to the position without decoding it into examples; nothing is tokenized again), the shuffle
buffer's raw examples and its generator state, rows already tokenized but not yet trained (an expanded
conversation's later turns), the partly filled packs, and the counters. A resumed run trains exactly the rows the
uninterrupted run would have. When the stream ends the next pass (epoch) starts from its beginning; with random
order its shards come in a new order (datasets' `set_epoch`, seeded by data_seed and the pass) and the shuffle
buffer's generator goes on, so a shuffled pass differs from the previous one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import torch
from datasets.distributed import split_dataset_by_node

from hftrain.config import DatasetSource
from hftrain.data import image_chats
from hftrain.data.batching import Collator
from hftrain.data.formats import detect_format
from hftrain.data.jsonlines import BAD_LINE, json_lines_dataset
from hftrain.data.sources import CHAT_FORMATS, FILE_BUILDERS, check_objective, load_eval_set, row_origin
from hftrain.data.tokenize import DataSpec, prepare_chat_template, tokenize_dataset, tokenize_pair, tokenize_rows
from hftrain.errors import HftrainError, first_line

IMAGE_KEYS = ("text", "images")  # an image chat's row also keeps its rendered text and image paths (data.image_chats)
PACK_OPEN_ROWS = 8  # packing on the fly: rows filled at once (best fit among them); the fullest leaves past this


# ----------------------------------------------------------------------------------------------- sources
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


def _mixture(parts: list[StreamSource], weights: list[float], seed: int) -> StreamSource:
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


# ----------------------------------------------------------------------------------------------- rows
class RowStream:
    """Training rows of one reader (one rank, or every rank alike): raw examples -> shuffle buffer -> tokenized rows
    -> packed rows, with its whole position in `state()` / `load_state()`.

    A row is a list of examples ({input_ids, labels} and, for preference pairs, the rejected side): one example, or
    several packed into max_length tokens. Bad raw examples (a missing column, a wrong type, no assistant turn) are
    skipped and counted; rows without a trained token after truncation are dropped and counted, as map-style data
    does.
    """

    def __init__(self, open_pass: Callable[[int], object], tokenize: Callable[[dict, int], list[dict]], *,
                 shuffle_buffer: int, seed: int, packing: bool, max_length: int, skip: int = 0):
        self.open_pass, self.tokenize = open_pass, tokenize
        self.shuffle_buffer, self.packing, self.max_length, self.skip = shuffle_buffer, packing, max_length, skip
        self.rng = random.Random(seed)
        self.passes = 0  # passes over the source completed
        self.read = 0  # raw examples read in this pass (the next one's index in the source, carve-out included)
        self.raw = None  # the pass's IterableDataset, its iterator and whether it ended
        self.raw_iter: Iterator | None = None
        self.source_done = False
        self.buffer: list[tuple[int, dict]] = []  # shuffle buffer: (index, raw example)
        self.pending: list[dict] = []  # tokenized rows of the last raw example not yet handed out
        self.open_rows: list[list[dict]] = []  # packing: rows being filled
        self.ready: list[list[dict]] = []  # packing: finished rows, in the order they are handed out
        self.counts = {"examples": 0, "rows": 0, "bad": 0, "dropped": 0}  # since the start of the run
        self.first_bad: str | None = None
        self.raw_state: dict | None = None  # datasets' state to resume the pass from (set by load_state)

    # ---------------------------------------------------------------- raw examples
    def _next_source(self) -> tuple[int, dict] | None:
        if self.source_done:
            return None
        if self.raw_iter is None:
            self.raw = self.open_pass(self.passes)
            if self.raw_state is not None:
                self.raw.load_state_dict(self.raw_state)
                self.raw_state = None
            # .iter(batch_size=1), not iter(): in a DataLoader worker, datasets' __iter__ would give this worker a share
            # of the shards; every worker here reads the whole stream (see StreamFeed)
            self.raw_iter = ({key: values[0] for key, values in batch.items()} for batch in self.raw.iter(batch_size=1))
        while True:
            try:
                example = next(self.raw_iter)
            except StopIteration:
                self.source_done = True
                return None
            index, self.read = self.read, self.read + 1
            if index >= self.skip:  # the first `skip` examples are the eval carve-out
                return index, example

    def _next_raw(self) -> tuple[int, dict] | None:
        """The next raw example of this pass (through the shuffle buffer), None at the end of the pass."""
        if self.shuffle_buffer <= 1:
            return self._next_source()
        while len(self.buffer) < self.shuffle_buffer:
            item = self._next_source()
            if item is None:
                break
            self.buffer.append(item)
        if not self.buffer:
            return None
        i = self.rng.randrange(len(self.buffer))
        item = self.buffer[i]
        self.buffer[i] = self.buffer[-1]
        self.buffer.pop()
        return item

    def _new_pass(self) -> None:
        self.passes += 1
        self.read, self.raw, self.raw_iter, self.source_done, self.raw_state = 0, None, None, False, None

    # ---------------------------------------------------------------- tokenized rows
    def _next_example(self) -> dict:
        """The next tokenized example; a new pass starts when the source ends."""
        empty_passes = 0
        while not self.pending:
            item = self._next_raw()
            if item is None:
                empty_passes += 1
                if empty_passes > 1 or (self.passes and not self.counts["rows"]):
                    raise HftrainError(self._empty_message())
                self._new_pass()
                continue
            empty_passes = 0
            index, example = item
            self.counts["examples"] += 1
            try:
                rows = self.tokenize(example, index)
            except HftrainError as exc:
                self.counts["bad"] += 1
                if self.first_bad is None:
                    self.first_bad = f"pass {self.passes + 1}, example {index}: {exc}"
                continue
            kept = [row for row in rows if not row["dropped"]]
            self.counts["dropped"] += len(rows) - len(kept)
            self.pending = [{k: v for k, v in row.items() if k.endswith(("input_ids", "labels")) or k in IMAGE_KEYS}
                            for row in kept]
        return self.pending.pop(0)

    def _empty_message(self) -> str:
        bad = f"; the first bad one: {self.first_bad}" if self.first_bad else ""
        return (f"the training stream holds no usable example ({self.counts['examples']} read, {self.counts['bad']} "
                f"bad, {self.counts['dropped']} without a trained token after truncation to max_length="
                f"{self.max_length}){bad}")

    def next_row(self) -> list[dict]:
        """The next training row: one example, or with packing several whose tokens fit max_length."""
        if not self.packing:
            row = [self._next_example()]
        else:
            row = self._next_packed()
        self.counts["rows"] += 1
        return row

    def _next_packed(self) -> list[dict]:
        """Best fit on the fly: each example joins the fullest open row it fits in (or opens one); a row that is full,
        or the fullest when more than PACK_OPEN_ROWS are open, is finished. A row finished first is handed out
        first; at the end of a pass every open row is finished, oldest first."""
        while not self.ready:
            end_of_pass = not self.pending and self.source_done and (self.shuffle_buffer <= 1 or not self.buffer)
            if end_of_pass and self.open_rows:
                self.ready, self.open_rows = self.open_rows, []
                break
            example = self._next_example()
            length = len(example["input_ids"])
            room = [(self.max_length - self._tokens(row), i) for i, row in enumerate(self.open_rows)]
            fits = [(free, i) for free, i in room if free >= length]
            if fits:
                _, i = min(fits)
                self.open_rows[i].append(example)
            else:
                self.open_rows.append([example])
                i = len(self.open_rows) - 1
            if self._tokens(self.open_rows[i]) >= self.max_length:
                self.ready.append(self.open_rows.pop(i))
            elif len(self.open_rows) > PACK_OPEN_ROWS:
                fullest = max(range(len(self.open_rows)), key=lambda k: (self._tokens(self.open_rows[k]), -k))
                self.ready.append(self.open_rows.pop(fullest))
        return self.ready.pop(0)

    @staticmethod
    def _tokens(row: list[dict]) -> int:
        return sum(len(example["input_ids"]) for example in row)

    # ---------------------------------------------------------------- position
    def state(self) -> dict:
        """Everything needed to continue from here: plain JSON-able values (copies of the lists, not the rows)."""
        raw = self.raw.state_dict() if self.raw is not None else self.raw_state
        return {"passes": self.passes, "read": self.read, "raw": raw, "source_done": self.source_done,
                "buffer": list(self.buffer), "rng": self.rng.getstate(), "pending": list(self.pending),
                "open_rows": [list(row) for row in self.open_rows], "ready": list(self.ready),
                "counts": dict(self.counts), "first_bad": self.first_bad}

    def load_state(self, state: dict) -> None:
        self.passes, self.read, self.source_done = state["passes"], state["read"], state["source_done"]
        self.raw, self.raw_iter, self.raw_state = None, None, state["raw"]
        self.buffer = [tuple(item) for item in state["buffer"]]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.pending, self.open_rows, self.ready = state["pending"], state["open_rows"], state["ready"]
        self.counts, self.first_bad = dict(state["counts"]), state["first_bad"]


# ----------------------------------------------------------------------------------------------- batches
class _Columns:
    """A list of examples seen as the column view `Collator` reads (`column_names`, `dataset[indices]`)."""

    def __init__(self, examples: list[dict], paired: bool):
        self.examples = examples
        self.column_names = ["input_ids", "labels"] + (["rejected_input_ids", "rejected_labels"] if paired else [])

    def __getitem__(self, indices: list[int]) -> dict[str, list]:
        return {key: [self.examples[i][key] for i in indices] for key in self.column_names}


class StreamCollator:
    """`Collator` for micro-batches given as rows (lists of examples) instead of row indices."""

    def __init__(self, pad_token_id: int, packed: bool, paired: bool):
        self.pad_token_id, self.packed, self.paired = pad_token_id, packed, paired
        self.mark_real_tokens = False
        self.mark_documents = False
        self.reference = None  # precomputed reference log-probs are refused with streaming

    def __call__(self, rows: list[list[dict]]):
        examples = [example for row in rows for example in row]
        groups, start = [], 0
        for row in rows:
            groups.append(list(range(start, start + len(row))))
            start += len(row)
        collator = Collator(_Columns(examples, self.paired), self.pad_token_id, groups, packed=self.packed)
        collator.mark_real_tokens, collator.mark_documents = self.mark_real_tokens, self.mark_documents
        return collator(list(range(len(rows))))


@dataclass(frozen=True)
class StreamPlan:
    """The batch layout of a streamed run (the `BatchPlan` fields the loop and checkpoints read): one endless epoch."""

    micro_batch: int
    world: int
    accum: int
    num_examples: int = 2**62  # unknown: the stream goes on (a new pass after its end)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples


STATE_VERSION = 1


class StreamFeed:
    """This rank's micro-batches of a streamed training set, and the stream's position at every step boundary.

    `disjoint`: this rank reads its own shards (split_dataset_by_node) and takes micro_batch x accum rows per step;
    otherwise every rank reads the whole stream, takes global batches of micro_batch x world x accum rows and keeps
    micro-batch j's slice [(j x world + rank) x micro_batch, + micro_batch), as BatchPlan does.

    With `num_workers` > 0 the reading, tokenizing and collating run in DataLoader worker processes: each worker holds
    a copy of the stream, reads every step's rows and collates the steps whose number (from the start) is its own
    modulo the workers; each step comes back with the stream's state after it, which is what a checkpoint saves. So a
    checkpoint has the same form with or without workers and resumes exactly with any number of them.
    """

    def __init__(self, stream: RowStream, collator: StreamCollator, plan: StreamPlan, rank: int, disjoint: bool,
                 max_bad_rows: int, description: str, num_workers: int = 0, examples_per_pass: int | None = None,
                 seeks: bool = False, pin_memory: bool = False):
        self.stream, self.collator, self.plan, self.rank, self.disjoint = stream, collator, plan, rank, disjoint
        self.max_bad_rows, self.description, self.num_workers = max_bad_rows, description, num_workers
        self.examples_per_pass = examples_per_pass  # raw training examples in a pass (after the carve-out), if known
        self.seeks = seeks  # a resume seeks to the saved position (else datasets re-reads the current shard)
        # dataloader_pin_memory: batches in page-locked memory (the loop copies them non_blocking), on CUDA only, as
        # map-style batches (data.batching.make_loader)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.steps_read = 0  # steps whose rows were taken from the stream
        self.snapshots: dict[int, dict] = {}  # steps done -> the stream's state then (the last two)
        self.position: dict | None = None  # with workers: the stream's state after `steps_read` steps
        self.logged = {"examples": 0, "bad": 0, "dropped": 0}

    def start(self, step: int, state: dict | None) -> None:
        """Continue after `step` optimizer steps, from a checkpoint's stream state (None: the beginning)."""
        self.steps_read = step
        if state is not None:
            self.stream.load_state(state["stream"])
        self.logged = {k: self.stream.counts[k] for k in self.logged}

    def read_step(self) -> list[list[list[dict]]]:
        """The rows of the next step, as this rank's micro-batches (lists of rows)."""
        plan, readers = self.plan, 1 if self.disjoint else self.plan.world
        place = 0 if self.disjoint else self.rank
        rows = [self.stream.next_row() for _ in range(plan.micro_batch * readers * plan.accum)]
        self.steps_read += 1
        return [rows[(j * readers + place) * plan.micro_batch:][:plan.micro_batch] for j in range(plan.accum)]

    def _keep(self, state: dict) -> None:
        """Remember `state` as the position after `steps_read` steps (and the one before it)."""
        self.snapshots = {self.steps_read: state,
                          **{k: v for k, v in self.snapshots.items() if k == self.steps_read - 1}}

    def batches(self, progress) -> Iterator[dict]:
        """Collated micro-batches from the current position on (endless)."""
        if self.num_workers == 0:
            while True:
                self._keep(self.stream.state())
                for micro_batch in self.read_step():
                    batch = self.collator(micro_batch)
                    yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch
        self.position = self.stream.state()
        loader = torch.utils.data.DataLoader(_WorkerSteps(self), batch_size=None, num_workers=self.num_workers,
                                             collate_fn=_as_is, generator=torch.Generator(),
                                             pin_memory=self.pin_memory)
        for micro_batches, after in loader:
            self._keep(self.position)
            self.steps_read += 1
            self.position = after
            yield from micro_batches

    def _state(self) -> dict:
        return self.stream.state() if self.num_workers == 0 or self.position is None else self.position

    def state_dict(self, step: int) -> dict:
        """The stream's position after `step` optimizer steps (the rows of a step taken but not trained are not in
        it), with what a resume checks it against."""
        state = self._state() if step == self.steps_read else self.snapshots.get(step)
        if state is None:
            raise RuntimeError(f"no stream state for step {step} (rows taken for {self.steps_read} steps)")
        return {"version": STATE_VERSION, "rank": self.rank, "world": self.plan.world, "disjoint": self.disjoint,
                "global_batch": self.plan.global_batch, "stream": state}

    @property
    def stop_reason(self) -> str | None:
        """Why the run must stop (max_bad_rows passed), or None."""
        state = self._state()
        if state["counts"]["bad"] > self.max_bad_rows:
            return (f"the training stream has {state['counts']['bad']} bad examples, more than max_bad_rows="
                    f"{self.max_bad_rows}; the first: {state['first_bad']}; fix or remove the bad examples, or raise "
                    "max_bad_rows")
        return None

    def resume_note(self, state: dict) -> str:
        """What a resume from `state` (a checkpoint's, see check_resume) reads again, for the start-up line."""
        if self.seeks:
            return "; the stream resumes by seeking to the saved line of its file (nothing before it is read again)"
        read = state["stream"]["read"]
        return (f"; datasets re-reads the current shard up to the saved position (at most the {read:,} examples of "
                "this pass before it, without tokenizing them; whole shards before it are skipped, so the time grows "
                "with the position inside a shard: see docs/data.md)")

    def epoch(self, state: dict) -> float:
        """Passes over the stream completed, plus the part of the current one drawn so far (read, less what waits in
        the shuffle buffer) when its length is known."""
        drawn = max(0, state["read"] - len(state["buffer"]) - self.stream.skip)  # the eval carve-out is not drawn
        done = drawn / self.examples_per_pass if self.examples_per_pass else 0.0
        return state["passes"] + min(1.0, done)

    def recorded_progress(self, progress, dp):
        """`progress` as a checkpoint or the final folder records it: `epoch` is the logged epoch at that step (the
        ranks' mean of `epoch`), not the loop's 0 of the one endless epoch. A collective: every rank calls it."""
        local = torch.tensor([self.epoch(self.state_dict(progress.step)["stream"])], dtype=torch.float64,
                             device=dp.accelerator.device)
        return replace(progress, epoch=round(float(dp.sum(local)[0]) / dp.world, 4))

    def pop_generation_seconds(self) -> float:
        """Seconds spent generating the data since the last call: none here (grpo's feed samples rollouts)."""
        return 0.0

    def window_metrics(self, dp) -> dict:
        """Raw examples read, bad examples and dropped rows since the last logged row, over the data-parallel ranks
        (every rank counts the same examples when they all read the whole stream), and the epoch: the ranks' mean
        of `epoch` (ranks reading disjoint shards may be in different passes)."""
        state = self._state()
        counts = state["counts"]
        local = torch.tensor([counts[k] - self.logged[k] for k in self.logged] + [self.epoch(state)],
                             dtype=torch.float64, device=dp.accelerator.device)
        self.logged = {k: counts[k] for k in self.logged}
        total = dp.sum(local).cpu()
        counted = total[:3] / (1 if self.disjoint else dp.world)
        return {"epoch": round(float(total[3]) / dp.world, 4), "stream_examples": int(counted[0]),
                "stream_bad_rows": int(counted[1]), "stream_dropped_rows": int(counted[2])}


def _as_is(item):
    return item


class _WorkerSteps(torch.utils.data.IterableDataset):
    """A StreamFeed's steps for DataLoader workers: (collated micro-batches, the stream's state after the step)."""

    def __init__(self, feed: StreamFeed):
        self.feed = feed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        feed, first = self.feed, self.feed.steps_read  # each worker has its own copy (forked)
        while True:
            micro_batches = feed.read_step()
            if (feed.steps_read - 1 - first) % workers == worker:
                yield [feed.collator(rows) for rows in micro_batches], feed.stream.state()


def check_resume(saved: list[dict], world: int, disjoint: bool, global_batch: int, rank: int, path) -> dict:
    """The saved stream state this rank continues from, or HftrainError saying why the checkpoint cannot continue the
    stream exactly. `saved`: the states of every rank of the saved run."""
    if not saved:
        raise HftrainError(f"checkpoint {path} holds no stream position (it was saved by a map-style run); resume it "
                           "with streaming: false, or start the streamed run afresh")
    first = saved[0]
    if first["version"] != STATE_VERSION:
        raise HftrainError(f"checkpoint {path} holds a stream position of format {first['version']}; this hftrain "
                           f"reads format {STATE_VERSION}")
    if first["disjoint"] or disjoint:
        if not (first["disjoint"] and disjoint and first["world"] == world):
            saved_how = (f"{first['world']} ranks reading disjoint shards" if first["disjoint"]
                         else "every rank reading the whole stream")
            now_how = f"{world} ranks reading disjoint shards" if disjoint else "every rank reading the whole stream"
            raise HftrainError(
                f"checkpoint {path} was saved with {saved_how}; this run would have {now_how}, so the shards would be "
                "assigned to other ranks and no rank's position would carry over. Resume with the saved number of "
                f"data-parallel processes ({first['world']})"
            )
        return next(s for s in saved if s["rank"] == rank)
    if first["global_batch"] != global_batch:
        raise HftrainError(
            f"checkpoint {path} was saved with a global batch of {first['global_batch']} rows per step, this run takes "
            f"{global_batch}: the stream position is exact only with the same global batch "
            "(per_device_train_batch_size x processes x gradient_accumulation_steps); keep it"
        )
    return first  # every rank read the whole stream: the ranks' states are the same


# ----------------------------------------------------------------------------------------------- setup
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
    source = _mixture(parts, [e.weight for e in entries], recipe.order_seed) if mixture else parts[0]
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
        if processor is not None:
            return [image_chats.stream_row(example, processor, spec, base, f"dataset {name!r} example {index}")]
        kind, where = fmt, name
        if mixture:  # a mixture's records carry their source and the raw example as JSON
            part = example[MIXTURE_SOURCE]
            example, kind, where = json.loads(example[MIXTURE_RAW]), formats[part], parts[part].name
        if BAD_LINE in example:
            raise HftrainError(example[BAD_LINE])
        place = origin.where(index) if origin is not None else None
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
        filler = image_chats.filler_row(source.open().take(image_chats.FILLER_SCAN), processor, spec, base, name)
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
        evaluation, stats["eval"] = image_chats.prepare(eval_raw, processor, spec, recipe.eval_dataset_name or name)
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
