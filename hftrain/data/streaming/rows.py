"""Rows on the fly: each rank's share of the stream, tokenized, truncated or packed as they arrive, with the
position to resume from."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from hftrain.errors import HftrainError

# an image chat's row also keeps its rendered text and image paths (data.image_chats), an image pair's also its prompt's
# length and its image tokens' places (data.image_pairs.pair_row)
IMAGE_KEYS = ("text", "images", "prompt_tokens", "image_positions")
PACK_OPEN_ROWS = 8  # packing on the fly: rows filled at once (best fit among them); the fullest leaves past this


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
