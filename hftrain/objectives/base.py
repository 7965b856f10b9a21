"""`Objective`: what the loop asks of the recipe's objective, whatever it is (`hftrain.objectives.OBJECTIVES` maps
`recipe.objective` to one). The loop calls these hooks and never branches on the objective's name. Each hook is
handed `run`, a frozen value of the parts it may use (`DataRun`, `ModelRun`, `TrainRun`), never the run itself."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.data.feeds import TrainingData
from hftrain.loss import ObjectiveLoss
from hftrain.run_parts import DataRun, ModelRun, TrainRun


class Objective:
    """One objective family's hooks, in the order the loop calls them.

    Each hook receives `run`: not the run itself but a frozen value of what exists when it is called, `DataRun`
    (setup_data, eval_addons), `ModelRun` (prepare, feed) or `TrainRun` (notes, evaluate, add_files), each field
    documented in `hftrain/run_parts.py`. A hook reads those fields and changes none of them;
    tests/unit/test_objectives_base.py fails, naming file:line, on a hook under hftrain/objectives or hftrain/rl that
    reads anything else. A part an objective truly needs beyond them becomes a field there, with its reason.

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
