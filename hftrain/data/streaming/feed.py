"""The streamed feed the loop reads: micro-batches collated from the row stream (in a worker or in the process), its
plan, its state in every checkpoint and the checks that a resume reads it back right."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from hftrain.data.batching import Collator
from hftrain.data.streaming.rows import RowStream
from hftrain.errors import HftrainError


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
