"""The training feed of a run whose objective trains on examples (sft, dpo, simpo): map-style datasets (training
rows, the batch plan, an `IndexedFeed`) or a stream (`StreamFeed`), with the collators for text or image chats.

`setup_examples(run)` is the data phase of `hftrain/finetune.py` for those objectives: it fills the attributes that
`Objective.setup_data` lists (`train_set`, `eval_set`, `data_stats`, `rows`, `plan`, `total_steps`, `collator`,
`eval_collator`, `feed`, `stream_state`, `data_line`), reading datasets through the run's `load_datasets` seam and
refusing what cannot continue from the checkpoint being resumed, before the model loads.
"""

from __future__ import annotations

import math

from hftrain.data.batching import Collator, IndexedFeed, training_plan, training_rows
from hftrain.data.image_chats import ImageChatCollator
from hftrain.data.streaming import check_resume, load_stream, read_states
from hftrain.errors import HftrainError
from hftrain.model import pad_token_id
from hftrain.parallel.launch import phase
from hftrain.paths import STREAM_STATE


def setup_examples(run) -> None:
    """Datasets of examples, training rows, the batch plan, the collators and the feed."""
    recipe, world = run.recipe, run.dp.world
    if recipe.streaming:
        return setup_stream(run)
    if run.resume_from is not None and read_states(run.resume_from, STREAM_STATE.format(index="*")):
        raise HftrainError(f"checkpoint {run.resume_from} was saved by a streamed run (streaming: true): its data "
                           "position is a place in the stream, which map-style data cannot continue from; resume "
                           "with streaming: true")
    with phase(run.accelerator, "data preparation", recipe.ddp_timeout), run.accelerator.main_process_first():
        run.train_set, run.eval_set, run.data_stats = run.load_datasets(run.tokenizer)  # rank 0 caches first
    run.rows = training_rows(run.train_set, recipe.packing, recipe.max_length)
    run.plan = training_plan(recipe, run.train_set, run.rows, world)
    if len(run.rows) < run.plan.global_batch:
        raise HftrainError(
            f"the training set has {len(run.rows)} usable {'packed rows' if recipe.packing else 'examples'}, "
            f"fewer than one global batch of {run.plan.global_batch} (per_device_train_batch_size x {world} "
            "processes x gradient_accumulation_steps); use a smaller batch or more data"
        )
    run.total_steps = recipe.max_steps if recipe.max_steps > 0 else \
        math.ceil(recipe.num_train_epochs * run.plan.steps_per_epoch)
    pad = pad_token_id(run.tokenizer)
    if run.processor is not None:  # rows are single examples (packing is refused for image-text models)
        run.collator = ImageChatCollator(run.train_set, run.processor, pad)
        run.eval_collator = ImageChatCollator(run.eval_set, run.processor, pad) if run.eval_set is not None else None
    else:
        run.collator = Collator(run.train_set, pad, run.rows, packed=recipe.packing)
        run.eval_collator = Collator(run.eval_set, pad) if run.eval_set is not None else None
    run.feed = IndexedFeed(run.plan, run.collator, run.dp.rank, recipe.dataloader_num_workers,
                           recipe.dataloader_pin_memory)
    run.stream_state = None
    run.data_line = (f"({run.plan.steps_per_epoch} per epoch)", f"{len(run.train_set)} training examples in "
                     f"{len(run.rows)} rows")


def setup_stream(run) -> None:
    """streaming: the feed reads the training set on the fly (hftrain.data.streaming); a resumed run continues from
    the checkpoint's stream position, checked here, before the model loads."""
    recipe = run.recipe
    with phase(run.accelerator, "data preparation", recipe.ddp_timeout), run.accelerator.main_process_first():
        run.feed, run.eval_set, run.data_stats = load_stream(recipe, run.tokenizer, run.dp.rank, run.dp.world,
                                                             run.processor)
    run.plan, run.total_steps = run.feed.plan, recipe.max_steps
    run.train_set, run.rows = None, None
    pad = pad_token_id(run.tokenizer)
    run.collator = run.feed.collator
    run.collator.pad_token_id = pad
    if run.eval_set is None:
        run.eval_collator = None
    elif run.processor is not None:  # image chats: the eval set is map-style ImageChats
        run.eval_collator = ImageChatCollator(run.eval_set, run.processor, pad)
    else:
        run.eval_collator = Collator(run.eval_set, pad)
    run.stream_state = None
    if run.resume_from is not None:
        saved = read_states(run.resume_from, STREAM_STATE.format(index="*"))
        run.stream_state = check_resume(saved, run.dp.world, run.feed.disjoint, run.plan.global_batch,
                                        run.dp.rank, run.resume_from)
    run.data_line = ("(one endless epoch)", run.feed.description + (
        run.feed.resume_note(run.stream_state) if run.stream_state is not None else ""))
