"""The training feed of a run whose objective trains on examples (sft, dpo, simpo): map-style datasets (training
rows, the batch plan, an `IndexedFeed`) or a stream (`StreamFeed`), with the collators for text or image chats.

`setup_examples(run)` is the data phase of `hftrain/finetune.py` for those objectives: it returns what the phase
produced (`TrainingData`), reading datasets through the run's `load_datasets` seam and refusing what cannot continue
from the checkpoint being resumed, before the model loads. `Feed` is what the loop reads from every objective's feed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hftrain.data.batching import Collator, IndexedFeed, training_plan, training_rows
from hftrain.data.streaming import check_resume, load_stream, read_states
from hftrain.errors import HftrainError, same_in_every_process
from hftrain.model import pad_token_id
from hftrain.parallel.launch import main_process_first, phase
from hftrain.paths import STREAM_STATE


@runtime_checkable
class Feed(Protocol):
    """The loop's micro-batches, whatever their source: map-style rows (`data.batching.IndexedFeed`), a stream
    (`data.streaming.StreamFeed`), grpo's generation windows (`rl.grpo.Rollouts`)."""

    plan: Any  # which rows each rank reads in each micro-batch: global_batch, steps_per_epoch (checkpoint.realign)
    stop_reason: str | None  # set when the data must stop the run (a stream past max_bad_rows, a failing reward)

    def batches(self, progress) -> Iterator[dict]:
        """The micro-batches from `progress` (epoch, step in epoch) on."""

    def start(self, step: int, state: dict | None) -> None:
        """Continue from a checkpoint's feed state (`state_dict`), or from the start."""

    def state_dict(self, step: int) -> dict | None:
        """What a checkpoint after `step` must hold to continue exactly (None: the plan alone says it)."""

    def recorded_progress(self, progress, dp):
        """The progress a checkpoint records (a stream's own epoch count)."""

    def pop_generation_seconds(self) -> float:
        """Seconds spent sampling since the last call (grpo), counted as generation, not data wait."""

    def window_metrics(self, dp) -> dict:
        """The feed's fields of a logged row (a stream's epoch, grpo's rewards)."""


@dataclass(frozen=True)
class TrainingData:
    """What the data phase hands the run (`Objective.setup_data`): the feed the loop reads and what was read."""

    feed: Any  # the `Feed` the loop reads; grpo: its rl.grpo.RolloutSource, which `Objective.feed` turns into the
    # rollouts once the model they sample from is prepared
    plan: Any  # the feed's plan (batching.BatchPlan, a stream's plan, rl.rollouts.WindowPlan)
    total_steps: int  # optimizer steps of the run (`total_steps`)
    data_line: tuple[str, str]  # the start-up line's words: (steps per epoch, what the training data is)
    data_stats: dict  # written to the run files (sources, lengths, template)
    train_set: Any = None  # map-style training examples (None when streamed)
    eval_set: Any = None
    rows: Any = None  # training rows (packed or not); grpo: its prompts
    collator: Any = None  # None where the feed builds its own batches (grpo's rollouts)
    eval_collator: Any = None
    stream_state: dict | None = None  # this rank's feed state in the checkpoint being resumed


def total_steps(recipe, plan) -> int:
    """The run's optimizer steps: max_steps, or num_train_epochs x the plan's steps per epoch (a stream has no
    epochs: its recipe must set max_steps)."""
    return recipe.max_steps if recipe.max_steps > 0 else math.ceil(recipe.num_train_epochs * plan.steps_per_epoch)


def setup_examples(run) -> TrainingData:
    """Datasets of examples, training rows, the batch plan, the collators and the feed."""
    recipe, world = run.recipe, run.dp.world
    if recipe.streaming:
        return setup_stream(run)
    if run.resume_from is not None and read_states(run.resume_from, STREAM_STATE.format(index="*")):
        raise HftrainError(f"checkpoint {run.resume_from} was saved by a streamed run (streaming: true): its data "
                           "position is a place in the stream, which map-style data cannot continue from; resume "
                           "with streaming: true")
    with phase(run.accelerator, "data preparation", recipe.ddp_timeout), main_process_first(run.accelerator):
        train_set, eval_set, data_stats = run.load_datasets(run.tokenizer)  # rank 0 caches first
    rows = training_rows(train_set, recipe.packing, recipe.max_length)
    plan = training_plan(recipe, train_set, rows, world)
    if len(rows) < plan.global_batch:
        with same_in_every_process():  # every process counts the same rows: the main process reports
            raise HftrainError(
                f"the training set has {len(rows)} usable {'packed rows' if recipe.packing else 'examples'}, "
                f"fewer than one global batch of {plan.global_batch} (per_device_train_batch_size x {world} "
                "processes x gradient_accumulation_steps); use a smaller batch or more data"
            )
    pad = pad_token_id(run.tokenizer)
    if run.processor is not None:  # rows are single examples (packing is refused for image-text models)
        collator = train_set.collator(run.processor, pad)  # image chats, or image preference pairs
        eval_collator = eval_set.collator(run.processor, pad) if eval_set is not None else None
    else:
        collator = Collator(train_set, pad, rows, packed=recipe.packing)
        eval_collator = Collator(eval_set, pad) if eval_set is not None else None
    feed = IndexedFeed(plan, collator, run.dp.rank, recipe.dataloader_num_workers, recipe.dataloader_pin_memory)
    line = (f"({plan.steps_per_epoch} per epoch)", f"{len(train_set)} training examples in {len(rows)} rows")
    return TrainingData(feed, plan, total_steps(recipe, plan), line, data_stats, train_set, eval_set, rows, collator,
                        eval_collator)


def setup_stream(run) -> TrainingData:
    """streaming: the feed reads the training set on the fly (hftrain.data.streaming); a resumed run continues from
    the checkpoint's stream position, checked here, before the model loads."""
    recipe = run.recipe
    with phase(run.accelerator, "data preparation", recipe.ddp_timeout), main_process_first(run.accelerator):
        feed, eval_set, data_stats = load_stream(recipe, run.tokenizer, run.dp.rank, run.dp.world, run.processor)
    pad = pad_token_id(run.tokenizer)
    collator = feed.collator
    collator.pad_token_id = pad
    if eval_set is None:
        eval_collator = None
    elif run.processor is not None:  # image chats or pairs: the eval set is map-style ImageChats or ImagePairs
        eval_collator = eval_set.collator(run.processor, pad)
    else:
        eval_collator = Collator(eval_set, pad)
    stream_state = None
    if run.resume_from is not None:
        saved = read_states(run.resume_from, STREAM_STATE.format(index="*"))
        stream_state = check_resume(saved, run.dp.world, feed.disjoint, feed.plan.global_batch, run.dp.rank,
                                    run.resume_from)
    line = ("(one endless epoch)", feed.description + (feed.resume_note(stream_state) if stream_state is not None
                                                       else ""))
    return TrainingData(feed, feed.plan, total_steps(recipe, feed.plan), line, data_stats, None, eval_set, None,
                        collator, eval_collator, stream_state)
