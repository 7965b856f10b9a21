"""Rows, batch plans and collation.

A training *row* is one example, or with packing several examples concatenated (best-fit
decreasing into max_length tokens). `BatchPlan` decides which rows each rank sees in each
micro-batch of each optimizer step; `Collator` turns a list of rows into tensors.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hftrain.data.tokenize import IGNORE_INDEX


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of example indices whose lengths sum to <= capacity: longest first, each into the fullest bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin id), sorted
    for i in order:
        length = lengths[i]
        if length > capacity:
            raise ValueError(f"example {i} has {length} tokens, more than the packing capacity {capacity}")
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            remaining, b = free.pop(slot)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if remaining - length > 0:
            bisect.insort(free, (remaining - length, b))
    return bins


def training_rows(dataset, packing: bool, max_length: int) -> list[list[int]]:
    """Example indices of each training row: one per row, or packed bins in creation order."""
    if not packing:
        return [[i] for i in range(len(dataset))]
    return pack_best_fit_decreasing([len(ids) for ids in dataset["input_ids"]], max_length)


def row_lengths(dataset, rows: list[list[int]]) -> list[int]:
    """Tokens in each training row (the sum over its examples when packed)."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    return [sum(lengths[i] for i in row) for row in rows]


# Rows sorted together by length when grouping: this many global batches, as transformers' LengthGroupedSampler
# sorts mega-batches of 50 batches. Larger windows pad less; smaller ones keep batch composition more random.
GROUP_WINDOW_BATCHES = 50


@dataclass(frozen=True)
class BatchPlan:
    """Which rows each rank sees in each micro-batch of each optimizer step.

    One optimizer step consumes a global batch of G = micro_batch x world x accum consecutive
    rows of the epoch's order (the rows' own order, or a permutation seeded by (seed, epoch)).
    Micro-batch j of rank r is the slice [(j*world + r)*micro_batch, +micro_batch) of that global
    batch, so k micro-batches of b on 1 process and 1 micro-batch of b on k processes see the same
    rows per step. The last step of an epoch may be short: its missing micro-batch slots are
    empty and collate to a fully masked row, so every rank still runs `accum` forward/backward
    passes (collectives stay matched) while the loss only counts real tokens.

    With `lengths` (tokens per row) the order is length-grouped: each window of
    GROUP_WINDOW_BATCHES x G rows of that order is sorted by length (longest first), cut into global
    batches, and the full global batches are shuffled by the same (seed, epoch) generator (a short
    last batch stays last). Rows of similar length then share a step, so right padding wastes little,
    and the order still depends only on (seed, epoch, G): a resumed run sees the same tail. It does
    depend on G, so resuming with another global batch size changes the grouped order.
    """

    num_examples: int  # rows
    micro_batch: int
    world: int
    accum: int
    seed: int
    shuffle: bool
    lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.lengths is not None and len(self.lengths) != self.num_examples:
            raise ValueError(f"{len(self.lengths)} row lengths for {self.num_examples} rows")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.global_batch)

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            order, generator = list(range(self.num_examples)), None
        else:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.num_examples, generator=generator).tolist()
        return order if self.lengths is None else self._grouped_by_length(order, generator)

    def _grouped_by_length(self, order: list[int], generator: torch.Generator | None) -> list[int]:
        g, window = self.global_batch, self.global_batch * GROUP_WINDOW_BATCHES
        batches = []
        for start in range(0, len(order), window):  # windows are whole global batches: only the last may be short
            by_length = sorted(order[start:start + window], key=lambda row: -self.lengths[row])  # stable
            batches += [by_length[i:i + g] for i in range(0, len(by_length), g)]
        short = [batches.pop()] if batches and len(batches[-1]) < g else []
        if generator is not None:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return [row for batch in batches + short for row in batch]

    def step_items(self, chunk: list[int]) -> list:
        """What the micro-batches hold of one step's rows: the rows themselves (kto's plan adds each row's partner)."""
        return chunk

    def micro_batches(self, epoch: int, rank: int, start_step: int = 0) -> Iterator[list[int]]:
        """This rank's micro-batches (lists of row indices) from `start_step` to the end of the epoch."""
        order, b = self.epoch_order(epoch), self.micro_batch
        for step in range(start_step, self.steps_per_epoch):
            chunk = self.step_items(order[step * self.global_batch:(step + 1) * self.global_batch])
            for j in range(self.accum):
                first = (j * self.world + rank) * b
                yield chunk[first:first + b]


def training_plan(recipe, dataset, rows: list[list[int]], world: int) -> BatchPlan:
    """The BatchPlan a recipe asks for: batch sizes, seed and `train_sampling_strategy`."""
    strategy = recipe.train_sampling_strategy
    lengths = tuple(row_lengths(dataset, rows)) if strategy == "group_by_length" else None
    return BatchPlan(len(rows), recipe.per_device_train_batch_size, world, recipe.gradient_accumulation_steps,
                     recipe.order_seed, shuffle=strategy != "sequential", lengths=lengths)


def eval_micro_batches(num_examples: int, micro_batch: int, world: int, rank: int) -> list[list[int]]:
    """Disjoint evaluation shards with the same number of batches on every rank (short ones may be empty)."""
    stride = micro_batch * world
    return [list(range(start + rank * micro_batch, min(start + (rank + 1) * micro_batch, num_examples)))
            for start in range(0, num_examples, stride)]


class Collator:
    """Right-pads a micro-batch of rows; an empty micro-batch becomes one fully masked row.

    `num_examples` (real examples in the batch, for throughput; pairs for preference data, whose b pairs become
    2b rows: chosen rows first, then rejected rows in the same order) is popped by the loop before the
    forward. No attention mask is needed: with right padding a causal model never lets a real token attend
    to a pad, so real positions are exact and pad labels are -100. Packed rows carry position_ids
    restarting at 0 for each example; with no attention mask transformers turns them into a
    block-diagonal causal mask (and flash-attention into per-example sequence lengths), so no token
    attends across examples. The padding after a packed row starts its own position run too.

    `mark_documents` (set for a model whose attention is hftrain.attention's varlen): the batch also carries the
    documents' boundaries as transformers' flash attention takes them, so that no one scans position_ids for them:
    `cu_seq_lens_q` / `cu_seq_lens_k`, int32 cumulative lengths over the micro-batch flattened row after row, in
    which every example is a segment and so is each row's padding (a one-token example, an example filling its row,
    the one-token filler row of an empty micro-batch alike), and `max_length_q` / `max_length_k`, the longest
    segment as a Python int (the kernel takes it from the host: no device sync reads it).
    """

    def __init__(self, dataset, pad_token_id: int, rows: list[list[int]] | None = None, packed: bool = False):
        self.dataset = dataset
        self.pad_token_id = pad_token_id
        self.rows = rows
        self.packed = packed
        self.mark_real_tokens = False  # add `real_tokens` (not padding): a mixture-of-experts router loss needs it
        self.mark_documents = False  # add the documents' boundaries (cu_seq_lens_q, ...): varlen attention takes them
        # preference pairs: b pairs collate to 2b rows, the b chosen rows then the b rejected rows (one forward)
        self.paired = "rejected_input_ids" in dataset.column_names
        self.reference = None  # [pairs, 2] precomputed reference log-probs: added to each batch as `ref_logps`

    def __call__(self, row_indices: list[int]) -> dict[str, torch.Tensor]:
        groups = [self.rows[r] for r in row_indices] if self.rows is not None else [[r] for r in row_indices]
        flat = [i for group in groups for i in group]
        sides = [("input_ids", "labels")] + ([("rejected_input_ids", "rejected_labels")] if self.paired else [])
        fetched = self.dataset[flat] if flat else {key: [] for side in sides for key in side}
        filler = [([self.pad_token_id], [IGNORE_INDEX])]
        rows, group_sizes = [], []
        for ids_key, labels_key in sides:
            ids_iter, labels_iter = iter(fetched[ids_key]), iter(fetched[labels_key])
            for group in groups or [[]]:
                rows.append([(next(ids_iter), next(labels_iter)) for _ in group] or filler)
                group_sizes.append(len(group))  # 0: the filler row of an empty micro-batch
        width = max(sum(len(ids) for ids, _ in parts) for parts in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        position_ids = torch.zeros_like(input_ids)
        real_tokens = torch.zeros_like(input_ids, dtype=torch.bool)
        for r, parts in enumerate(rows):
            offset = 0
            for ids, lbl in parts:
                input_ids[r, offset:offset + len(ids)] = torch.tensor(ids)
                labels[r, offset:offset + len(lbl)] = torch.tensor(lbl)
                position_ids[r, offset:offset + len(ids)] = torch.arange(len(ids))
                offset += len(ids)
            position_ids[r, offset:] = torch.arange(width - offset)
            real_tokens[r, :offset] = bool(group_sizes[r])
        batch = {"input_ids": input_ids, "labels": labels, "num_examples": torch.tensor(len(flat))}
        if self.packed:
            batch["position_ids"] = position_ids
        if self.mark_documents:
            batch.update(document_boundaries(rows, width))
        if self.mark_real_tokens:
            batch["real_tokens"] = real_tokens
        if "margin" in self.dataset.column_names:  # reward models' optional margin, one per pair
            batch["margin"] = torch.tensor(fetched["margin"] if flat else [0.0], dtype=torch.float32)
        if self.reference is not None:  # one value per row, in the rows' order (chosen rows, then rejected rows)
            ref = self.reference[flat] if flat else torch.zeros(1, 2)
            batch["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]])
        return batch


def document_boundaries(rows: list[list[tuple[list, list]]], width: int) -> dict:
    """transformers' flash keyword arguments for rows of (input_ids, labels) parts right-padded to `width`: each part
    a segment, then the row's padding (if any) one more, cumulated over the rows in order."""
    lengths = []
    for parts in rows:
        lengths += [len(ids) for ids, _ in parts]
        if (padding := width - sum(len(ids) for ids, _ in parts)) > 0:
            lengths.append(padding)
    cumulative = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    longest = max(lengths)
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative, "max_length_q": longest,
            "max_length_k": longest}


def make_loader(batches: Iterator[list[int]] | list[list[int]], collator: Collator, num_workers: int, *,
                pin_memory: bool):
    """A DataLoader over precomputed index lists (collation may run in worker processes).

    It has its own generator: creating an iterator draws a seed from it, and drawing from the global RNG would
    shift dropout masks whenever a loader is created (e.g. on resume), breaking resume = uninterrupted run.
    `pin_memory` (dataloader_pin_memory) pins batches only when CUDA is available: without a GPU there is no
    host-to-device copy to speed up.
    """
    return torch.utils.data.DataLoader(
        list(batches), batch_size=None, shuffle=False, collate_fn=collator, num_workers=num_workers,
        generator=torch.Generator(), pin_memory=pin_memory and torch.cuda.is_available(),
    )


class IndexedFeed:
    """A map-style training set's micro-batches for the loop: this rank's part of the BatchPlan, collated (possibly in
    worker processes). The same interface as `streaming.StreamFeed`: the position lives in the progress counters, so
    a checkpoint needs no data state."""

    stop_reason = None  # map-style data is checked whole before step 1

    def __init__(self, plan: BatchPlan, collator: Collator, rank: int, num_workers: int, pin_memory: bool):
        self.plan, self.collator, self.rank = plan, collator, rank
        self.num_workers, self.pin_memory = num_workers, pin_memory

    def batches(self, progress) -> Iterator[dict]:
        """The micro-batches of the rest of the current epoch."""
        order = self.plan.micro_batches(progress.epoch, self.rank, progress.step_in_epoch)
        return iter(make_loader(order, self.collator, self.num_workers, pin_memory=self.pin_memory))

    def start(self, step: int, state: None) -> None:
        """Nothing to restore: BatchPlan finds the position from the progress counters."""

    def state_dict(self, step: int) -> None:
        return None

    def recorded_progress(self, progress, dp):
        """What a checkpoint records: the loop's counters are the position."""
        return progress

    def pop_generation_seconds(self) -> float:
        """Seconds spent generating the data since the last call: none here (grpo's feed samples rollouts)."""
        return 0.0

    def window_metrics(self, dp) -> dict:
        return {}
