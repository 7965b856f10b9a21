"""What each phase of a run hands to the objective's hooks (`hftrain.objectives.base.Objective`): `ModelParts`, what
the model phase built, and the run values `DataRun` -> `ModelRun` -> `TrainRun`. Outside `hftrain.objectives` so that
modules the objectives import (an add-on such as `retrieval_eval`'s) can name them without an import cycle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from accelerate import Accelerator
from torch import nn

from hftrain.checkpoint import Progress
from hftrain.config import Recipe
from hftrain.data.feeds import Feed, TrainingData
from hftrain.loss import ObjectiveLoss
from hftrain.parallel.base import Backend, DataParallel
from hftrain.watchdog import Watchdog


@dataclass(frozen=True)
class ModelParts:
    """What the model phase built (`finetune.Finetune.setup_model`), handed to the optimizer phase as one value and
    read by the objective's later hooks as `run.parts`."""

    loss: ObjectiveLoss  # the objective's loss module around the built model (`build_loss`): what the backend wraps;
    # its reference (dpo, kto, grpo) or teacher (distill) inside it
    notes: list[str]  # the builder's and the loss module's start-up notes (the run adds its own)
    flops: Any  # metrics.FlopCounter of the built model (active parameters per token)
    summary: dict  # model.model_summary: method, trained and total counts, before sharding hides the full counts
    memory_baseline_mb: float  # memory in use before the model was built: what the memory estimate sits on top of


Later = TypeVar("Later", bound="DataRun")


# What a hook may read of the run, phase by phase: `finetune.Finetune` builds each value once the phase that makes
# its parts has run, and each phase's value holds the one before it. A hook reads these fields and nothing else
# (tests/unit/test_objectives_base.py reads every hook's source); they are frozen: a hook changes none of them.
@dataclass(frozen=True)
class DataRun:
    """What `setup_data` and `eval_addons` receive: the run before its data and model."""

    recipe: Recipe  # the validated recipe
    tokenizer: Any  # the tokenizer (an image-text model's: its processor's)
    processor: Any  # an image-text model's processor (reads images), else None
    accelerator: Accelerator  # this process: device, is_main_process, num_processes
    dp: DataParallel  # the data-parallel ranks: world, rank, sum, gather
    backend: Backend  # the parallelism backend: prepare, micro_batch, release, generation_context
    resume_from: Path | None  # the checkpoint this run resumes from, else None
    output_dir: Path  # the run's folder (checkpoints, rollouts.jsonl, final/)
    watchdog: Watchdog  # the hang watchdog: `window(what)` around a long phase every rank is in
    setup_examples: Callable[[], TrainingData]  # the data phase of examples from datasets (data.feeds.setup_examples)

    def handed_on(self, later: type[Later], **more) -> Later:
        """The next phase's value (built by `finetune.Finetune`, not a hook's to call): these fields and the parts
        that phase made (`more`)."""
        return later(**{field.name: getattr(self, field.name) for field in fields(self)}, **more)


@dataclass(frozen=True)
class ModelRun(DataRun):
    """What `prepare` and `feed` receive: after the backend prepared the model and optimizer, before a checkpoint is
    loaded."""

    data: TrainingData  # what `setup_data` returned: feed, plan, total_steps, datasets, collators
    parts: ModelParts  # what the model phase built; `parts.loss` is the loss module (its reference or teacher inside)
    model: nn.Module  # the prepared model (the backend's wrapper around `parts.loss`): what a forward calls


@dataclass(frozen=True)
class TrainRun(ModelRun):
    """What `notes`, `evaluate` and `add_files` receive: from the start-up lines to the end of the run."""

    feed: Feed  # the feed the loop reads (`Objective.feed`'s: the data phase's, grpo's Rollouts)
    progress: Progress  # the run's progress, kept current: `progress.step` is the last completed step
    evaluate_loss: Callable[[], dict[str, float]]  # the loss module's metrics over the eval set (every rank calls it)
    say: Callable[[str], None]  # a line on the console and in the run's log (the main process's; others' dropped)
