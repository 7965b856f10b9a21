"""`Objective`: what the loop asks of the recipe's objective, whatever it is (`hftrain.objectives.OBJECTIVES` maps
`recipe.objective` to one). The loop calls these hooks and never branches on the objective's name. Each hook is
handed `run`, a frozen value of the parts it may use (`DataRun`, `ModelRun`, `TrainRun`), never the run itself."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
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



class Objective:
    """One objective family's hooks, in the order the loop calls them.

    Each hook receives `run`: not the run itself but a frozen value of what exists when it is called, `DataRun`
    (setup_data, eval_addons), `ModelRun` (prepare, feed) or `TrainRun` (notes, evaluate, add_files), each field
    documented above. A hook reads those fields and changes none of them; tests/unit/test_objectives_base.py fails,
    naming file:line, on a hook under hftrain/objectives or hftrain/rl that reads anything else. A part an objective
    truly needs beyond them becomes a field here, with its reason.

    The loss module it builds is a `loss.ObjectiveLoss`: `forward` returns a *sum*, `loss_units(batch)` says over
    what (tokens, pairs, ...), the loop adds those units over every micro-batch and data-parallel rank of the
    optimizer step and divides once; `pop_stats` and `eval_metrics` give the objective's own statistics; add-ons
    such as the router loss compose onto it (`router`).
    """

    name = ""

    def setup_data(self, run: DataRun) -> TrainingData:
        """The training data (`setup_data`, after the tokenizer, before the model), returned to the run: the feed
        the loop reads (a `data.feeds.Feed`), its plan (`checkpoint.realign` reads its `global_batch`,
        `steps_per_epoch`, `num_examples`, `world`, `accum`), the run's total steps, the datasets, collators, the
        resumed feed state and the start-up line's words. Examples from datasets, streamed or not:
        `run.setup_examples()`."""
        return run.setup_examples()

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> ObjectiveLoss:
        """The loss module around the built model (`setup_model`, before the backend wraps it). `copy_model`: the
        parallelism backend's way to copy the built model (e.g. for a frozen reference)."""
        raise NotImplementedError

    def prepare(self, run: ModelRun) -> dict[str, torch.Tensor] | None:
        """After the backend prepared the model and optimizer, before a checkpoint is loaded: place what the loss
        needs beside the model (a frozen reference) and compute what it needs before step 1. Returns tensors saved
        with every checkpoint and handed back on resume (layout.REFERENCE_FILE), or None."""
        return None

    def feed(self, run: ModelRun):
        """The feed the loop reads (a `data.feeds.Feed`), after `prepare`: the data phase's (`run.data.feed`), or,
        for an objective whose batches are sampled from the model (grpo's rollouts), built now from what its data phase
        returned and the prepared model, whole."""
        return run.data.feed

    eval_headline = "eval_loss"  # the metric the final evaluation's line shows
    # log_completions: the eval examples' prompts are completed at each evaluation (hftrain.samples); an objective
    # whose evaluation and log_completions already show generated text (grpo) says False
    completes_eval_prompts = True
    # the final model writes text, so the run's closing line offers `hftrain chat` with it (a reward model scores)
    writes_text = True
    final_use = "score conversations"  # what the closing line offers to do with a final model that writes no text

    def evaluate(self, run: TrainRun) -> dict[str, float]:
        """The evaluation's metrics (every rank calls it at once, when `run.data.eval_set` is set): the loss module's
        loss over the eval set (`finetune.evaluate`), e.g. eval_loss."""
        return run.evaluate_loss()

    def notes(self, run: TrainRun) -> list[str]:
        """Start-up lines describing the objective (printed after the layout line)."""
        return []

    def eval_addons(self, run: DataRun) -> list:
        """What each evaluation runs on the live model besides the objective's own evaluation and the run's add-ons
        (eval_tasks, log_completions): callables of the `TrainRun` returning metrics, created in the data phase
        (embedding's retrieval metrics)."""
        return []

    def add_files(self, run: TrainRun, folder) -> None:
        """Files of the objective's own in a folder for use (the final model, a hub upload), written by the main
        process beside the saved model before its card (embedding: sentence-transformers' modules.json and the
        rest)."""
