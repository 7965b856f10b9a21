"""objective grpo: the loss module (`GRPOLoss`), its reference for beta > 0, and the rollout source that the
loop's batches come from (`Rollouts`: generation windows, rewards, advantages, rollouts.jsonl, TRL's metrics).

The loop is the one of every objective: it asks the objective for its micro-batches, sums the loss module's
`loss_units` over the step's micro-batches and processes, and divides once (hftrain.rl.loss has the table of what
each loss_type sums over). Generation happens lazily, when the loop asks for the first micro-batch of a window: after
the previous optimizer step, with the weights the window's rollouts are sampled from.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from torch import nn

from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.jsonl import keep_through
from hftrain.loss import ObjectiveLoss
from hftrain.model import WrapsCausalLM
from hftrain.parallel.sequence import GroupSum
from hftrain.paths import EVAL_ROLLOUTS_FILE, ROLLOUTS_FILE
from hftrain.rl.async_worker import SampledWindow, WindowQueue, WorkerFailure, sampled_rows
from hftrain.rl.generation import RolloutGenerator
from hftrain.rl.images import PromptImages
from hftrain.rl.loss import (
    TOKEN_NORMALISED,
    LossSettings,
    aggregate,
    clip_statistics,
    completion_log_probs,
    group_advantages,
    leave_one_out_advantages,
    loss_units,
    micro_batch_loss,
    nanstd,
    per_token_loss,
    token_log_probs,
    vllm_importance_sampling_ratio,
)
from hftrain.rl.rewards import RewardFailure, RewardFunction, score
from hftrain.rl.rollouts import (
    Completion,
    Prompt,
    Sampled,
    Sampling,
    WindowPlan,
    collate,
    is_conversational,
    model_inputs,
    render_prompt,
    row_seed,
    sampling_log_probs,
)
from hftrain.rl.tools import Tooling
from hftrain.tracking import Table

# the generation "window" of the evaluation's row seeds: every evaluation samples each eval completion with the same
# seed (the same noise), so evaluations differ by the model only; training windows count from 0
EVAL_WINDOW = -1


def loss_settings(recipe) -> LossSettings:
    """The loss's settings; advantage_estimator rloo puts beta's KL into the reward (RLOOTrainer), not the loss."""
    return LossSettings(loss_type=recipe.loss_type, epsilon=recipe.epsilon, epsilon_high=recipe.epsilon_high,
                        beta=0.0 if recipe.advantage_estimator == "rloo" else recipe.beta,
                        importance_sampling_level=recipe.importance_sampling_level,
                        max_completion_length=recipe.max_completion_length,
                        sapo_temperature_pos=recipe.sapo_temperature_pos,
                        sapo_temperature_neg=recipe.sapo_temperature_neg)


def sharded_token_log_probs(lm: nn.Module, input_ids: torch.Tensor, temperature: float, shards) -> torch.Tensor:
    """`token_log_probs` of this rank's shard of the rows (`shards`: hftrain.parallel.context's `RingSlices`, run
    inside the ring's context), gathered back whole: [B, L-1], no gradient."""
    rows, width = input_ids.shape
    targets = shards.local(F.pad(input_ids[:, 1:], (0, 1)))  # each position's next token, cut with the positions
    logits = lm(input_ids=shards.local(input_ids), position_ids=shards.positions(rows, width, input_ids.device),
                use_cache=False).logits
    return shards.gather(completion_log_probs(logits, targets, temperature)[0], rows, width)[:, :-1]


def reference_token_log_probs(temperature: float) -> Callable[..., torch.Tensor]:
    """grpo's reference computation: `(lm, input_ids, shards=None) -> per-token log-probs` from logits / temperature,
    on the whole rows (with an image-text model's `model_inputs`: its pixels), or on this rank's shards of them (context
    parallelism)."""
    def compute(lm: nn.Module, input_ids: torch.Tensor, shards=None, **model_inputs: torch.Tensor) -> torch.Tensor:
        if shards is None:
            return token_log_probs(lm, input_ids, temperature, **model_inputs)[0]
        return sharded_token_log_probs(lm, input_ids, temperature, shards)
    return compute


class ReferenceTokenLogProbs(WrapsCausalLM):
    """The frozen starting model of a fully fine-tuned policy (beta > 0): `forward` returns per-token log-probs, so
    that a strategy that wraps it gathers its weights around that forward."""

    def __init__(self, lm: nn.Module, temperature: float):
        super().__init__()
        self.lm, self.compute = lm.eval().requires_grad_(False), reference_token_log_probs(temperature)

    def forward(self, input_ids: torch.Tensor, shards=None, **model_inputs: torch.Tensor) -> torch.Tensor:
        return self.compute(self.lm, input_ids, shards, **model_inputs)


def stored_windows(state: dict | None) -> list[SampledWindow]:
    """The rollout worker's windows a checkpoint holds (async_generation), in window order."""
    return [SampledWindow.restore(item) for item in (state or {}).get("async_windows", [])]


def fingerprint(sequences: list[list[int]]) -> torch.Tensor:
    """Per sequence: its length and two 48-bit parts of a SHA-256 of its tokens (exact in float64): equal for
    equal sequences, different (but for a hash collision) for different ones."""
    rows = []
    for s in sequences:
        digest = hashlib.sha256(",".join(map(str, s)).encode()).digest()
        rows.append([len(s), int.from_bytes(digest[:6], "little"), int.from_bytes(digest[6:12], "little")])
    return torch.tensor(rows, dtype=torch.float64)


class GRPOLoss(ObjectiveLoss):
    """Wraps a causal LM so that `forward` returns the micro-batch's GRPO loss as a sum over `loss_units`
    (completion tokens for dapo, completions otherwise). `collecting` (set by the rollout source): forward returns
    the per-token log-probs instead (the old log-probs of num_iterations > 1), through the strategy's wrapper."""

    examples_name = "completions"
    headline = ("reward", "loss")  # the loss is ~0 by construction at num_iterations 1; the reward is the signal

    def __init__(self, lm: nn.Module, recipe, reference):
        super().__init__(lm)  # no router loss: a dense model, or its router loss left out (coefficient 0)
        self.settings, self.temperature, self.reference = loss_settings(recipe), recipe.temperature, reference
        self.unit = "tokens" if recipe.loss_type in TOKEN_NORMALISED else "completions"
        self.collecting = False
        # context parallelism (hftrain.parallel.context's RingAttention sets it): the reference's forward on this
        # rank's shards of the rows, inside the ring's context, as the policy's; else on the whole rows
        self.reference_shards = None
        self.sums: dict[str, torch.Tensor] = {}  # (sum, count) pairs of kl, entropy and clip ratios, this rank
        # async_generation's importance-sampling correction, computed in the training forward (`sampling_weights`,
        # with the recipe's vllm_importance_sampling_* settings): min / max statistics of its weights, this rank
        self.recipe = recipe
        self.extremes: dict[str, torch.Tensor] = {}

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_units(batch["labels"][:, 1:] != IGNORE_INDEX, self.settings.loss_type)

    def _add(self, name: str, value: torch.Tensor, count: torch.Tensor) -> None:
        pair = torch.stack([value.detach().double(), count.detach().double()])
        self.sums[name] = pair if name not in self.sums else self.sums[name] + pair

    def _extreme(self, name: str, value: torch.Tensor, pick) -> None:
        value = value.detach().double().reshape(())
        self.extremes[name] = value if name not in self.extremes else pick(self.extremes[name], value)

    def sampling_weights(self, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """async_generation: TRL's importance-sampling weights of a micro-batch against the sampler's log-probs, with
        this training forward's log-probs as the trained model's at generation (each window is trained once, in one
        optimizer step, by the weights that took it: a forward at generation would give the same values), and their
        statistics (TRL's sampling/* metrics: token or completion sums and counts, min and max)."""
        r = self.recipe
        weights = vllm_importance_sampling_ratio(logps, sampling_logps, mask, r.vllm_importance_sampling_mode,
                                                 r.vllm_importance_sampling_clip_min,
                                                 r.vllm_importance_sampling_clip_max)
        delta = (logps - sampling_logps).abs()[mask]
        delta = delta[~torch.isnan(delta)]
        kept = weights.flatten() if r.vllm_importance_sampling_mode.startswith("sequence") else weights[mask]
        nan = torch.tensor(math.nan, dtype=torch.float64)
        self._add("sampling/sampling_logp_difference/mean", delta.sum(), torch.tensor(len(delta)))
        self._add("sampling/importance_sampling_ratio/mean", kept.sum(), torch.tensor(len(kept)))
        self._extreme("sampling/sampling_logp_difference/max", delta.max() if len(delta) else nan, torch.fmax)
        self._extreme("sampling/importance_sampling_ratio/min", kept.min() if len(kept) else nan, torch.fmin)
        self._extreme("sampling/importance_sampling_ratio/max", kept.max() if len(kept) else nan, torch.fmax)
        return weights

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
                old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                sampling_weights: torch.Tensor | None = None, sampling_logps: torch.Tensor | None = None,
                **model_inputs: torch.Tensor) -> torch.Tensor:
        logps, entropy = token_log_probs(self.lm, input_ids, self.temperature, **model_inputs)
        if self.collecting:
            return logps.detach()
        mask = labels[:, 1:] != IGNORE_INDEX
        if sampling_logps is not None:  # async_generation: the correction against the sampler's log-probs
            sampling_weights = self.sampling_weights(logps.detach(), sampling_logps, mask)
        loss, ratio, kl = per_token_loss(logps, old_logps, ref_logps, advantages.to(logps.dtype), mask, self.settings,
                                         sampling_weights)
        tokens = mask.sum()
        self._add("entropy", (entropy * mask).sum(), tokens)
        if kl is not None:
            self._add("kl", (kl * mask).sum(), tokens)
        for name, (value, count) in clip_statistics(ratio, advantages, mask, self.settings).items():
            self._add(name, value, count)
        return micro_batch_loss(loss, mask, self.settings)

    def sliced_forward(self, slices, input_ids: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
                       old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                       sampling_weights: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` on this rank's slice of the micro-batch under sequence parallelism (hftrain.parallel.sequence,
        `SequenceSlices`: the rows concatenated and cut into sp pieces) or context parallelism
        (hftrain.parallel.context, `RingSlices`: each row cut into the ring's head-tail chunks, run inside its
        context), returning the group's whole loss sum.

        Each position predicts the next token, so every per-token input is laid out per predicting position ([B, W]:
        the [B, W-1] tensors padded with one untrained column) and sliced with the tokens: the targets, the mask, the
        advantages (one per row, spread over its tokens), the old and reference log-probs. Each completion's summed
        token loss is added over the group's slices differentiably (`GroupSum`, as the SFT loss), so each loss_type's
        normalisation (parallel to `micro_batch_loss`) sees whole completions and the group counts each token once
        (and, at sequence level, each completion's mean log-ratio before its ratio is taken);
        the statistics' sums are added over the slices too. `collecting`: the whole [B, W-1] log-probs, gathered."""
        rows, width = input_ids.shape
        device = input_ids.device

        def spread(per_position: torch.Tensor, fill=0) -> torch.Tensor:  # [B, W-1] -> this rank's [1, piece]
            return slices.local(F.pad(per_position, (0, 1), value=fill), fill)

        targets = spread(input_ids[:, 1:])
        logits = self.lm(input_ids=slices.local(input_ids), position_ids=slices.positions(rows, width, device),
                         use_cache=False).logits
        logps, entropy = completion_log_probs(logits, targets, self.temperature)
        if self.collecting:
            return slices.gather(logps.detach(), rows, width)[:, :-1]
        whole_mask = labels[:, 1:] != IGNORE_INDEX
        mask = spread(whole_mask, False)
        row_of = slices.local(torch.arange(rows, device=device)[:, None].expand(rows, width))
        adv = advantages.to(logps.dtype)[row_of]
        if sampling_weights is not None:
            sampling_weights = spread(sampling_weights.expand_as(whole_mask).to(logps.dtype))
        old = None if old_logps is None else spread(old_logps)
        log_ratio = None
        if self.settings.importance_sampling_level == "sequence":  # each completion's mean over all its slices
            local = torch.zeros(rows, dtype=logps.dtype, device=device).index_add(
                0, row_of.flatten(), ((logps - (logps.detach() if old is None else old)) * mask).flatten())
            per_row = GroupSum.apply(local, slices.group) / whole_mask.sum(-1).clamp(min=1).to(logps.dtype)
            log_ratio = per_row[row_of]
        loss, ratio, kl = per_token_loss(logps, old, None if ref_logps is None else spread(ref_logps), adv, mask,
                                         self.settings, sampling_weights, log_ratio)
        tokens = whole_mask.sum()
        self._add("entropy", slices.sum((entropy * mask).sum()), tokens)
        if kl is not None:
            self._add("kl", slices.sum((kl * mask).sum()), tokens)
        if log_ratio is None:
            for name, (value, count) in clip_statistics(ratio, adv, mask, self.settings).items():
                self._add(name, slices.sum(value), slices.sum(count))
        else:  # one ratio per completion, the same on every rank of the group
            for name, (value, count) in clip_statistics(torch.exp(per_row.detach())[:, None], advantages,
                                                        whole_mask, self.settings).items():
                self._add(name, value, count)
        summed = torch.zeros(rows, dtype=loss.dtype, device=device).index_add(0, row_of.flatten(),
                                                                              (loss * mask).flatten())
        # Collective that changes the number: each completion's loss sum over the group's slices, differentiable
        # (its backward hands each slice sp x its gradient, undone by the strategy's mean over all processes)
        return aggregate(GroupSum.apply(summed, slices.group), whole_mask, self.settings)

    def reference_log_probs(self, input_ids: torch.Tensor, **model_inputs: torch.Tensor) -> torch.Tensor:
        """The reference's per-token log-probs of the whole rows [B, L-1] (beta > 0), on the same pixels as the
        policy's (`model_inputs`)."""
        if self.reference_shards is None:
            return self.reference.log_probs(input_ids, **model_inputs)
        return self.reference.log_probs(input_ids, self.reference_shards)

    def pop_stats(self) -> dict[str, torch.Tensor]:
        return {}  # the rollout source logs GRPO's metrics (Rollouts.metrics), with their own denominators

    def pop_sums(self) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return sums

    def pop_extremes(self) -> dict[str, torch.Tensor]:
        extremes, self.extremes = self.extremes, {}
        return extremes


@dataclass(frozen=True)
class SampledRows:
    """Rows as sampled (`Rollouts.sample`, `Rollouts.sample_window`): their prompts (with tool calling, as the
    environments left them), processor outputs (an image-text model's, else None), completions and environments
    (tool calling's, else None); for a training window also the policy version that sampled it and the rollout
    worker's failure, if any."""

    prompts: list[Prompt]
    inputs: list[dict] | None
    sampled: list[Sampled]
    environments: list | None
    version: int = 0
    failure: str | None = None


@dataclass(frozen=True)
class RolloutSource:
    """What grpo's data phase read (`GRPO.setup_data`): the prompts, the reward functions, the windows' plan and how
    completions are sampled and stopped. The rollouts are built from it once the model they sample from is prepared
    (`Rollouts(source, policy)`)."""

    recipe: Any
    plan: WindowPlan
    prompts: list
    funcs: list[RewardFunction]
    tokenizer: Any
    accelerator: Any
    # dp: the data share (parallel.base.DataParallel). The ranks of one tensor-parallel group hold the same
    # data-parallel rank, so the same prompts, row seeds and completions; gathers count each group once.
    dp: Any
    output_dir: Path
    sampling: Sampling
    eos_ids: frozenset[int]
    pad_id: int
    busy: Callable = lambda name: nullcontext()  # busy(name): a stretch that counts as progress for the watchdog
    tooling: Tooling | None = None  # tool calling (hftrain.rl.tools): multi-turn rollouts
    images: PromptImages | None = None  # an image-text model's prompts with images (hftrain.rl.images)

    @classmethod
    def read(cls, recipe, plan: WindowPlan, prompts, funcs: list[RewardFunction], tokenizer, accelerator, dp,
             output_dir: Path, busy=lambda name: nullcontext(), tooling: Tooling | None = None,
             images: PromptImages | None = None) -> RolloutSource:
        """The sampling settings from the recipe, the stop and pad tokens from the tokenizer."""
        sampling = Sampling(recipe.max_completion_length, recipe.temperature, recipe.top_p, recipe.top_k,
                            recipe.repetition_penalty, recipe.mask_truncated_completions,
                            images.suppressed if images is not None else ())
        eos = tokenizer.eos_token_id
        eos_ids = frozenset({eos} if isinstance(eos, int) else set(eos or []))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
        return cls(recipe, plan, prompts, funcs, tokenizer, accelerator, dp, output_dir, sampling, eos_ids, pad_id,
                   busy, tooling, images)


@dataclass(frozen=True)
class Policy:
    """What the rollouts sample from and score with, once the backend has prepared the model (`GRPO.feed`)."""

    model: nn.Module  # the prepared model: the old log-probs of stored windows
    loss_fn: GRPOLoss  # the loss module inside it: its statistics, its reference
    generator: RolloutGenerator  # samples the completions (rl.generation.build_generator)
    # the backend's context for forwards over whole sequences on every rank (sequence parallelism's reference),
    # and its context around a micro-batch's forward through the loss module (context parallelism's ring)
    whole_sequences: Callable[[], AbstractContextManager] = nullcontext
    micro_batch: Callable[[dict], AbstractContextManager] = nullcontext
    max_model_length: int | None = None  # the model's context: a tool result may not push a sequence past it
    # async_generation: starts the rollout worker the windows come from, given the first window it samples
    start_worker: Callable[[int], WindowQueue] | None = None


class Rollouts:
    """The micro-batches of objective grpo, generation window by generation window (hftrain.rl.rollouts has the
    layout), sampled from `policy`. `loader(order)` is the loop's batch iterator for the (window, micro-batch,
    iteration) triples of `WindowPlan.micro_batches`."""

    def __init__(self, source: RolloutSource, policy: Policy):
        recipe, plan = source.recipe, source.plan
        self.recipe, self.plan, self.prompts, self.funcs = recipe, plan, source.prompts, source.funcs
        self.tooling, self.busy, self.images = source.tooling, source.busy, source.images
        self.tokenizer, self.accelerator, self.dp, self.rank = source.tokenizer, source.accelerator, source.dp, \
            source.dp.rank
        self.file = source.output_dir / ROLLOUTS_FILE
        self.sampling, self.eos_ids, self.pad_id = source.sampling, source.eos_ids, source.pad_id
        self.model, self.loss_fn, self.generator = policy.model, policy.loss_fn, policy.generator
        self.whole_sequences, self.micro_batch = policy.whole_sequences, policy.micro_batch
        self.start_worker, self.worker = policy.start_worker, None
        if self.tooling is not None:  # a tool result may not push a sequence past the model's context (TRL's rule)
            self.tooling.loop.max_model_length = policy.max_model_length
        self.weights = torch.tensor(recipe.reward_weights or [1.0] * len(self.funcs), dtype=torch.float32)
        # old log-probs are stored when a window's later micro-batches train after an update, and with vLLM's
        # importance-sampling correction, whose ratio they are the numerator of (TRL's rules); the rollout worker's
        # samples are corrected the same way against their behaviour log-probs
        self.correct_sampling = (recipe.use_vllm or recipe.async_generation) and \
            recipe.vllm_importance_sampling_correction
        # async_generation trains each window once, in one optimizer step, with the weights that took it: the
        # correction's numerator is then the training forward's own log-probs, and the loss computes the weights
        # (GRPOLoss.sampling_weights) without a forward at generation
        self.correct_in_loss = self.correct_sampling and recipe.async_generation
        self.store_old = recipe.num_iterations > 1 or plan.steps_per_generation > plan.accum or (
            self.correct_sampling and not self.correct_in_loss)
        # advantage_estimator rloo with beta > 0: the reward is penalised by the KL of the log-probs at generation
        self.reward_kl = recipe.advantage_estimator == "rloo" and recipe.beta != 0
        self.window, self.buffer, self.truncated = None, [], False
        self.async_stats: list[list[float]] = []  # async_generation: per window taken (sample_window)
        self.generation_seconds = 0.0  # since the loop last asked (pop_generation_seconds)
        self.generated_metrics: list[dict[str, float]] = []
        self.latest_rows: list[dict] = []  # log_completions: the last window's rollouts.jsonl rows (main process)
        # The loop's data vote: set on every rank when a reward function failed on any rank (generate), so that all
        # ranks stop at the same step with a checkpoint instead of waiting in a collective until ddp_timeout.
        self.stop_reason: str | None = None

    # ------------------------------------------------------------------------------------ the loop's batches

    def batches(self, progress):
        """The loop's micro-batches of the rest of the current epoch (the feed interface of data.batching)."""
        return self.loader(self.plan.micro_batches(progress.epoch, self.rank, progress.step_in_epoch))

    def state_dict(self, step: int) -> dict | None:
        """What a checkpoint after `step` needs to continue exactly: nothing at the end of a generation window (the
        next one is sampled from seeds and the saved weights), else this rank's buffered micro-batches, whose
        rollouts were sampled from weights that are gone (JSON: float32 values round-trip exactly). async_generation:
        the windows after `step` whose policy versions the resumed run cannot push again (`WindowQueue.held`)."""
        if self.worker is not None:
            return {"rank": self.rank, "world": self.plan.world, **self.worker.held(step)}
        if step % self.plan.steps_per_window == 0 or self.window is None:
            return None
        return {"rank": self.rank, "world": self.plan.world, "window": self.window,
                "micro_batches": [{k: v.tolist() for k, v in batch.items()} for batch in self.buffer],
                "dtypes": {k: str(v.dtype).removeprefix("torch.") for batch in self.buffer for k, v in batch.items()}}

    def start(self, step: int, state: dict | None) -> None:
        """Before the first step: a checkpoint saved inside a window hands its buffered micro-batches back; the
        evaluations after `step` (of the run resumed, or of a run this one overwrites) leave eval_rollouts.jsonl."""
        if self.accelerator.is_main_process:
            keep_through(self.file.parent / EVAL_ROLLOUTS_FILE, step)
        if self.start_worker is not None:
            self.worker = self.start_async(step, state)
            return
        if state is None:
            return
        types = {"input_ids": torch.long, "labels": torch.long, "num_examples": torch.long,
                 **{k: getattr(torch, name) for k, name in state.get("dtypes", {}).items()}}  # image inputs' too
        self.window = state["window"]
        self.buffer = [{k: torch.tensor(v, dtype=types.get(k, torch.float32)) for k, v in batch.items()}
                       for batch in state["micro_batches"]]

    def start_async(self, step: int, state: dict | None) -> WindowQueue:
        """async_generation: the rollout worker, from the window after `step` (one step per window) or after the
        windows the checkpoint holds (sampled by weights the resumed run cannot push again), which it hands back
        first: the resumed run continues exactly."""
        held = stored_windows(state)
        if step > 0 and (state is None or not state.get("async_complete", False)):
            why = ("was saved without the rollout worker's sampled windows (by a synchronous run, or when the worker "
                   "had failed)") if state is None or "async_complete" in state else "holds no rollout worker state"
            raise HftrainError(f"the checkpoint resumed from (step {step}) {why}; an async_generation run resumes "
                               "exactly only from a checkpoint saved by a run whose worker was alive: resume from an "
                               "earlier checkpoint, or start again")
        worker = self.start_worker(step + len(held))
        worker.hold(held)
        return worker

    def window_metrics(self, dp) -> dict:
        return self.metrics(dp.sum)

    def pop_generation_seconds(self) -> float:
        """Wall-clock seconds this rank spent sampling and scoring generation windows since the last call (the loop
        counts them as generation_time, not as data wait; generate synchronises with the device when it reads the
        completions back)."""
        seconds, self.generation_seconds = self.generation_seconds, 0.0
        return seconds

    def recorded_progress(self, progress, dp):
        """What a checkpoint records: the loop's counters are the position (as data.batching.IndexedFeed)."""
        return progress

    def loader(self, order):
        for window, micro, iteration in order:
            if window != self.window:
                if (micro, iteration) != (0, 0):
                    raise HftrainError(
                        f"the checkpoint resumed from was saved inside generation window {window} (steps "
                        f"{self.plan.first_step(window)}-{self.plan.first_step(window + 1) - 1}) without its "
                        "buffered rollouts; resume from a checkpoint saved by this version of hftrain")
                if not self.truncated:  # the first window this process samples: rows from it on are written again
                    self.truncate_rows(window)
                    self.truncated = True
                with self.busy("generation"):
                    started = time.perf_counter()
                    self.generate(window)
                    self.generation_seconds += time.perf_counter() - started
            batch = dict(self.buffer[micro])
            if not self.store_old:
                batch.pop("old_logps", None)
            yield batch

    # ------------------------------------------------------------------------------------------ generation
    def completion_value(self, prompt, text: str, sampled: Sampled | None = None):
        """What reward functions receive as the completion: its messages with tool calling (the assistant turns and
        tool results, as TRL), else TRL's one assistant message for chat prompts, the text for text prompts."""
        if sampled is not None and sampled.messages is not None:
            return sampled.messages
        return [{"role": "assistant", "content": text}] if is_conversational(prompt.value) else text

    def reward_prompt(self, prompt: Prompt):
        """What reward functions receive as the prompt: the dataset's, or for an image-text model TRL's messages with
        each image part holding its image (PromptImages.reward_prompt)."""
        return prompt.value if self.images is None else self.images.reward_prompt(prompt)

    def image_columns(self, prompt: Prompt) -> dict:
        """rollouts.jsonl's `images` column of an image-text model's prompt: its images as the data names them."""
        return {} if prompt.images is None else {"images": prompt.images}

    def sample(self, prompts: list[Prompt], seed, inputs: list[dict] | None = None) -> SampledRows:
        """prompts[i] sampled with seed(i, turn): one turn each (an image-text model's prompts with their pixels,
        `inputs`: PromptImages.row_inputs), or with tool calling the multi-turn rollouts (hftrain.rl.tools: every turn
        with its prompt's pixels, the environments' observations added to the prompts), every process sampling
        together."""
        if self.tooling is None:
            ids, seeds = [p.ids for p in prompts], [seed(i, 0) for i in range(len(prompts))]
            sampled = self.generator.sample(ids, seeds) if inputs is None else self.generator.sample(ids, seeds, inputs)
            return SampledRows(prompts, inputs, sampled, None)

        def render(value, columns):
            return render_prompt(value, columns, self.tokenizer, self.recipe.max_prompt_length,
                                 self.tooling.schema_tools)

        out = self.tooling.rollouts(self.generator.sample, prompts, seed, render, inputs, self.images)
        return SampledRows(out.prompts, out.inputs, out.sampled, out.environments)

    def sample_window(self, window: int, prompts: list[Prompt], seed, inputs: list[dict] | None = None
                      ) -> SampledRows:
        """This rank's rows of `window`: sampled here with the current weights (their version: the optimizer steps
        taken), or (async_generation) taken from the rollout worker after pushing the weights due at this step. A
        worker that failed or died gives stand-in rows, never trained, and its message as the failure, which stops
        the run (`stop_on_failure`)."""
        steps = self.plan.first_step(window) - 1
        if self.worker is None:
            return replace(self.sample(prompts, seed, inputs), version=steps)
        sync = self.recipe.weight_sync_steps
        if steps % sync == 0:
            self.worker.push(steps // sync)
        try:
            item = self.worker.take(window)
        except WorkerFailure as exc:
            stand_in = Sampled([next(iter(self.eos_ids))], False, [0.0])
            return SampledRows(prompts, inputs, [stand_in] * len(prompts), None, steps // sync, str(exc))
        if item.seeds != [seed(i, 0) for i in range(len(prompts))]:
            raise HftrainError(f"{self.worker.name} sampled generation batch {window} with other row seeds than this "
                               "process's rows; this is a bug in hftrain")
        self.async_stats.append([float(steps // sync - item.version), item.busy_seconds, item.idle_seconds,
                                 self.worker.wait_seconds, float(self.worker.results.qsize())])
        self.worker.wait_seconds = 0.0
        # tool calling: the prompts as the worker's environments left them, and those environments (reward functions
        # receive them)
        return SampledRows(item.prompts or prompts, inputs, sampled_rows(item), item.environments, item.version)

    def async_metrics(self) -> dict[str, float]:
        """async_generation's metrics of the window just taken, every rank's (TRL's names where TRL has them):
        sample/staleness_mean and _max (weight syncs between the sampling policy and the trainer's),
        rollout/worker_busy_s and rollout/worker_idle_s (the worker sampling this window, and waiting for its weights
        or for room in the queue before it), perf/rollout_wait_s (the trainer blocked on the queue),
        sample/rollout_queue_size (windows left in the queue)."""
        local = torch.tensor(self.async_stats[-1], dtype=torch.float64)[None]
        every = self.dp.gather(local.to(self.accelerator.device)).cpu()
        return {"sample/staleness_mean": every[:, 0].mean().item(), "sample/staleness_max": every[:, 0].max().item(),
                "rollout/worker_busy_s": every[:, 1].mean().item(), "rollout/worker_idle_s": every[:, 2].mean().item(),
                "perf/rollout_wait_s": every[:, 3].mean().item(),
                "sample/rollout_queue_size": every[:, 4].mean().item()}

    def tool_metrics(self, counts: torch.Tensor) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed / calls) of
        completions whose [calls, failed calls] are `counts`; nothing without tool calling."""
        if self.tooling is None:
            return {}
        calls, failures = counts[:, 0].sum().item(), counts[:, 1].sum().item()
        return {"tools/call_frequency": calls / len(counts),
                "tools/failure_frequency": failures / calls if calls else 0.0}

    @staticmethod
    def call_counts(s: Sampled) -> list[float]:
        calls = s.tool_calls or []
        return [float(len(calls)), float(sum(c["failed"] for c in calls))]

    @torch.no_grad()
    def generate(self, window: int) -> None:
        """Sample this rank's completions of `window`, score them, compute the advantages over the whole window
        (every rank's rewards gathered), collate the micro-batches and write the window's rollouts.jsonl rows."""
        plan, recipe, G = self.plan, self.recipe, self.plan.num_generations
        prompt_index = plan.window_prompts(window)
        rows = plan.rank_rows(self.rank)
        self.model_was_training = self.model.training
        self.model.eval()
        window_prompts = [self.prompts[prompt_index[row // G]] for row in rows]
        # an image-text model's prompts: their pixels, for generate and for every forward over the micro-batches
        inputs = self.images.row_inputs(window_prompts) if self.images is not None else None
        taken = self.sample_window(
            window, window_prompts, lambda i, turn: row_seed(recipe.seed, window, rows[i] // G, rows[i] % G, turn),
            inputs)
        prompts, inputs, sampled, environments = taken.prompts, taken.inputs, taken.sampled, taken.environments
        version, failure = taken.version, taken.failure
        completions = [Completion(row, row // G, prompt_index[row // G], s.completion_ids, s.truncated,
                                  sampling_logps=s.sampling_logps, tool_mask=s.tool_mask, tool_calls=s.tool_calls,
                                  messages=s.messages, policy_version=version) for row, s in zip(rows, sampled)]
        self.dp.check_replicas_agree(fingerprint([c.completion_ids for c in completions]), "completions")
        texts = [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in completions]
        columns = {k: [p.columns[k] for p in prompts] for k in prompts[0].columns}
        if environments is not None:  # TRL passes reward functions the rollouts' environments
            columns["environments"] = environments
        local = torch.full((len(completions), len(self.funcs)), math.nan)
        # the ranks of a tensor-parallel group hold the same completions: scored once (nothing when the worker failed)
        if self.dp.leads_group and failure is None:
            try:
                local = score(self.funcs, [self.reward_prompt(p) for p in prompts],
                              [self.completion_value(p, t, s) for p, t, s in zip(prompts, texts, sampled)],
                              [c.completion_ids for c in completions], columns)
            except RewardFailure as exc:  # still take part in the gather below: the other ranks are waiting in it
                failure = str(exc)
        # Advantages are normalised over the whole window: every data-parallel rank's rewards, in window order (rank r
        # holds rows [r x b x S, (r + 1) x b x S)), gathered onto every rank, with each rank's failure flag.
        device = self.accelerator.device
        # lengths count the tokens the model sampled (TRL's, tool results left out), then the calls and failed calls
        lengths = torch.tensor([[c.model_tokens, float(c.truncated), *self.call_counts(s), float(failure is not None)]
                                for c, s in zip(completions, sampled)])
        everything = self.dp.gather(torch.cat([local, lengths], dim=1).to(device)).cpu()
        all_rewards, all_lengths = everything[:, :len(self.funcs)], everything[:, len(self.funcs):-1]
        if everything[:, -1].any():
            self.stop_on_failure(window, failure, completions, prompts)
            return
        b = plan.micro_batch
        self.buffer, sampled_with = [], []
        for k in range(plan.steps_per_generation):  # the advantages are filled in below
            part = completions[k * b:(k + 1) * b]
            prompt_ids = [p.ids for p in prompts[k * b:(k + 1) * b]]
            batch = collate(prompt_ids, part, torch.zeros(len(part)), self.pad_id, recipe.mask_truncated_completions,
                            inputs[k * b:(k + 1) * b] if inputs is not None else None)
            sampling = (sampling_log_probs(prompt_ids, part, batch["input_ids"].shape[1]) if self.correct_sampling
                        else None)
            extra = self.rollout_log_probs(batch, None if self.correct_in_loss else sampling)
            if self.correct_in_loss:
                extra["sampling_logps"] = sampling
            self.buffer.append({**batch, **extra})
            sampled_with.append(sampling)
        kl = self.reward_penalty() if self.reward_kl else None
        rewards, advantages, zero_std = self.advantages(all_rewards, kl)
        self.generated_metrics.append({**self.reward_metrics(all_rewards, rewards, zero_std, all_lengths),
                                       **self.tool_metrics(all_lengths[:, 2:4]),
                                       **(self.async_metrics() if self.worker is not None else {})})
        if kl is not None:
            self.generated_metrics[-1]["kl"] = self.kl_metric
        mine = slice(rows.start, rows.stop)
        for c, r_k, r, a in zip(completions, all_rewards[mine].tolist(), rewards[mine].tolist(),
                                advantages[mine].tolist()):
            c.rewards, c.reward, c.advantage = r_k, r, a
        for k, batch in enumerate(self.buffer):
            batch["advantages"] = advantages[mine][k * b:(k + 1) * b].to(torch.float32)
            if "old_logps" in batch:  # the behaviour log-probs where the trained model sampled (no other sampler's)
                for i, c in enumerate(completions[k * b:(k + 1) * b]):
                    if c.sampling_logps is None:
                        start = len(prompts[k * b + i].ids) - 1
                        c.behaviour_logps = batch["old_logps"][i, start:start + len(c.completion_ids)].tolist()
        if self.correct_sampling and not self.correct_in_loss:
            self.generated_metrics[-1].update(self.sampling_metrics(sampled_with))
        self.window = window
        if self.model_was_training:
            self.model.train()
        self.write_rows(window, completions, prompts, texts)

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, prompts: list[Prompt], step: int) -> dict[str, float]:
        """TRL's GRPO evaluation: each eval prompt completed num_generations times with the run's generation settings
        (the generator that samples the training completions), scored by the reward functions, no update; TRL's
        metrics of those completions with the eval_ prefix (eval_reward, eval_rewards/<func>/mean, ...), over the
        whole eval set. The prompt x generation rows are split over the data-parallel ranks in order (a rank past the
        end completes row 0 again, left out, so that every rank generates as often as the others), sampled per
        row seed (the same for every evaluation, whatever the process count), gathered, and written to
        eval_rollouts.jsonl with `step`."""
        G, dp, recipe = self.plan.num_generations, self.dp, self.recipe
        total = len(prompts) * G
        per_rank = math.ceil(total / dp.world)
        mine = range(dp.rank * per_rank, (dp.rank + 1) * per_rank)
        rows = [row if row < total else 0 for row in mine]
        was_training = self.model.training
        self.model.eval()
        sampled, b, rows_prompts, environments = [], recipe.per_device_eval_batch_size, [], []
        try:
            for k in range(0, per_rank, b):
                chunk = rows[k:k + b]
                chunk_rows = [prompts[row // G] for row in chunk]
                taken = self.sample(
                    chunk_rows,
                    lambda i, turn, chunk=chunk: row_seed(recipe.seed, EVAL_WINDOW, chunk[i] // G, chunk[i] % G, turn),
                    self.images.row_inputs(chunk_rows) if self.images is not None else None)
                rows_prompts += taken.prompts
                sampled += taken.sampled
                environments += taken.environments or []
        finally:
            if was_training:
                self.model.train()
        ids = [s.completion_ids for s in sampled]
        dp.check_replicas_agree(fingerprint(ids), "eval completions")
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
        local, failure = torch.full((len(rows), len(self.funcs)), math.nan), None
        if dp.leads_group:
            columns = {k: [p.columns[k] for p in rows_prompts] for k in rows_prompts[0].columns}
            if environments:
                columns["environments"] = environments
            try:
                local = score(self.funcs, [self.reward_prompt(p) for p in rows_prompts],
                              [self.completion_value(p, t, s) for p, t, s in zip(rows_prompts, texts, sampled)], ids,
                              columns)
            except RewardFailure as exc:  # still take part in the gather: the other ranks wait in it
                failure = str(exc)
        extra = torch.tensor([[s.model_tokens, float(s.truncated), *self.call_counts(s), float(row < total),
                               float(failure is not None)] for s, row in zip(sampled, mine)])
        everything = dp.gather(torch.cat([local, extra], dim=1).to(self.accelerator.device)).cpu()
        if everything[:, -1].any():
            failures = gather_object([failure]) if self.accelerator.num_processes > 1 else [failure]
            raise HftrainError(f"{next(m for m in failures if m is not None)}, scoring the evaluation's completions "
                               f"after step {step}; fix the function")
        everything = everything[everything[:, -2].bool()]  # the rows of every rank in order, fillers left out
        per_func, lengths = everything[:, :len(self.funcs)], everything[:, len(self.funcs):-2]
        rewards, _, zero_std = self.advantages(per_func)
        tools = self.tool_metrics(lengths[:, 2:4])
        names = [f.name for f in self.funcs]
        records = [{"step": step, "group": row // G, "prompt_ids": p.ids, "completion_ids": c, "prompt": p.text,
                    "completion": t, "rewards": {n: (None if math.isnan(v) else v)
                                                 for n, v in zip(names, per_func[row].tolist())},
                    "reward": None if math.isnan(rewards[row]) else rewards[row].item(), "truncated": s.truncated,
                    "row": row, **self.tool_columns(s), **self.image_columns(p)}
                   for row, p, c, t, s in zip(mine, rows_prompts, ids, texts, sampled) if row < total]
        records = gather_object(records) if self.accelerator.num_processes > 1 else records
        if self.accelerator.is_main_process:
            unique = {r["row"]: r for r in records}  # a tensor-parallel group's ranks hold the same rows
            with (self.file.parent / EVAL_ROLLOUTS_FILE).open("a") as f:
                for row in sorted(unique):
                    f.write(json.dumps(unique[row]) + "\n")
        return {f"eval_{name}": value
                for name, value in {**self.reward_metrics(per_func, rewards, zero_std, lengths), **tools}.items()}

    def stop_on_failure(self, window: int, failure: str | None, completions: list[Completion], prompts) -> None:
        """A reward function failed on some rank: every rank sets the loop's stop reason (the failing rank's message,
        naming the function) and hands the loop micro-batches that are never trained (the vote comes before the
        forward), so that the loop's collective vote stops all ranks at this step with a checkpoint of the state
        before the window; a resume samples the window again. No rollouts.jsonl rows or metrics for it."""
        failures = gather_object([failure]) if self.accelerator.num_processes > 1 else [failure]
        rank, message = next((r, m) for r, m in enumerate(failures) if m is not None)
        where = f" on process {rank}" if self.accelerator.num_processes > 1 else ""
        if message.startswith("the rollout worker"):  # WorkerFailure's message names the worker and its process
            self.stop_reason = (f"{message}, so generation batch {window} (training step "
                                f"{self.plan.first_step(window)}) has no rollouts")
        else:
            self.stop_reason = (f"{message}{where}, scoring the completions of generation batch {window} (training "
                                f"step {self.plan.first_step(window)}); fix the function")
        b, zeros = self.plan.micro_batch, torch.zeros(len(completions))
        self.buffer = [collate([p.ids for p in prompts[k * b:(k + 1) * b]], completions[k * b:(k + 1) * b],
                               zeros[k * b:(k + 1) * b], self.pad_id, self.recipe.mask_truncated_completions)
                       for k in range(self.plan.steps_per_generation)]
        self.window = window
        if self.model_was_training:
            self.model.train()

    def rollout_log_probs(self, batch: dict[str, torch.Tensor],
                          sampling_logps: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The stored old log-probs (num_iterations > 1, steps_per_generation > accumulation, or vLLM's correction),
        the reference's (beta > 0) and, with vLLM's importance-sampling correction (`sampling_logps`: vLLM's
        log-probs of the sampled tokens), the weights of each token's loss, of one micro-batch, in its own padding."""
        out, device = {}, self.accelerator.device
        inputs = {k: v.to(device) for k, v in batch.items() if k != "num_examples"}
        if self.store_old or self.reward_kl:
            self.loss_fn.collecting = True
            try:
                with self.micro_batch(inputs) as sharded:  # context parallelism: inside the ring's context
                    out["old_logps"] = self.model(**sharded).cpu()
            finally:
                self.loss_fn.collecting = False
        if self.loss_fn.reference is not None:
            # a sequence-parallel group's ranks: each the whole rows; a context-parallel group's: each its shards,
            # inside the ring's context
            with self.whole_sequences(), self.micro_batch(inputs):
                out["ref_logps"] = self.loss_fn.reference_log_probs(inputs["input_ids"], **model_inputs(inputs)).cpu()
        if sampling_logps is not None:
            r, mask = self.recipe, batch["labels"][:, 1:] != IGNORE_INDEX
            out["sampling_weights"] = vllm_importance_sampling_ratio(
                out["old_logps"], sampling_logps, mask, r.vllm_importance_sampling_mode,
                r.vllm_importance_sampling_clip_min, r.vllm_importance_sampling_clip_max)
        return out

    def advantages(self, per_func: torch.Tensor, kl: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reward, advantage, zero std) of each completion of a whole window, by advantage_estimator: GRPO's group
        baseline scaled by scale_rewards, or RLOO's leave-one-out baseline (`kl`: its reward penalty)."""
        recipe, G = self.recipe, self.plan.num_generations
        if recipe.advantage_estimator == "rloo":
            return leave_one_out_advantages(per_func, self.weights, G, recipe.normalize_advantages, kl)
        return group_advantages(per_func, self.weights, G, recipe.scale_rewards)

    def reward_penalty(self) -> torch.Tensor:
        """advantage_estimator rloo, beta > 0 (RLOOTrainer): beta x each completion's summed first-order KL,
        sum_t m (logp - ref logp) with the log-probs at generation, every rank's completions in window order; sets
        `kl_metric`, TRL's kl (the token mean of logp - ref logp over the window's trained tokens)."""
        sums, tokens = [], []
        for batch in self.buffer:
            mask = (batch["labels"][:, 1:] != IGNORE_INDEX).to(torch.float32)
            per_token = (batch["old_logps"] - batch["ref_logps"]) * mask
            sums.append(per_token.sum(-1))
            tokens.append(mask.sum(-1))
        local = torch.stack([torch.cat(sums), torch.cat(tokens)], dim=1).double()
        every = self.dp.gather(local.to(self.accelerator.device)).cpu()
        self.kl_metric = (every[:, 0].sum() / every[:, 1].sum().clamp(min=1)).item()
        return self.recipe.beta * every[:, 0].to(torch.float32)

    def sampling_metrics(self, sampling_logps: list[torch.Tensor]) -> dict[str, float]:
        """TRL's vLLM metrics of this window, every rank's tokens: |old - sampling log-prob| over the trained tokens
        (mean and max; tokens vLLM gave no log-prob left out) and the importance weights (min, mean, max over the
        trained tokens, or over completions for sequence_* modes). TRL averages per-rank means; here the means are
        over the window's tokens (or completions) on all ranks."""
        deltas, weights = [], []
        sequence = self.recipe.vllm_importance_sampling_mode.startswith("sequence")
        for batch, sampling in zip(self.buffer, sampling_logps):
            mask = batch["labels"][:, 1:] != IGNORE_INDEX
            delta = (batch["old_logps"] - sampling).abs()[mask]
            deltas.append(delta[~torch.isnan(delta)])
            weights.append(batch["sampling_weights"].flatten() if sequence else batch["sampling_weights"][mask])
        delta, weight = torch.cat(deltas).double(), torch.cat(weights).double()
        nan = torch.tensor(math.nan, dtype=torch.float64)
        local = torch.stack([delta.sum(), torch.tensor(len(delta)), delta.max() if len(delta) else nan, weight.sum(),
                             torch.tensor(len(weight)), weight.min() if len(weight) else nan,
                             weight.max() if len(weight) else nan]).double()[None]
        every = self.dp.gather(local.to(self.accelerator.device)).cpu()

        def over_ranks(column: int, reduce) -> float:  # TRL's nanmin / nanmax over the ranks (0 when none)
            values = every[:, column][~torch.isnan(every[:, column])]
            return reduce(values).item() if len(values) else 0.0

        return {"sampling/sampling_logp_difference/mean": (every[:, 0].sum() / every[:, 1].sum().clamp(min=1)).item(),
                "sampling/sampling_logp_difference/max": over_ranks(2, torch.max),
                "sampling/importance_sampling_ratio/min": over_ranks(5, torch.min),
                "sampling/importance_sampling_ratio/mean": (every[:, 3].sum() / every[:, 4].sum().clamp(min=1)).item(),
                "sampling/importance_sampling_ratio/max": over_ranks(6, torch.max)}

    # ------------------------------------------------------------------------------------------- the records
    def write_rows(self, window: int, completions: list[Completion], prompts, texts: list[str]) -> None:
        """This window's completions, every rank's, as rows of rollouts.jsonl (written by the main process)."""
        step = self.plan.first_step(window)
        names = [f.name for f in self.funcs]
        rows = [{"step": step + (c.row % (self.plan.micro_batch * self.plan.steps_per_generation))
                 // (self.plan.micro_batch * self.plan.accum), "window": window, "group": c.group,
                 "prompt_ids": p.ids, "completion_ids": c.completion_ids, "prompt": p.text, "completion": t,
                 "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, c.rewards)},
                 "reward": None if math.isnan(c.reward) else c.reward, "advantage": c.advantage,
                 "truncated": c.truncated, "row": c.row, "policy_version": c.policy_version,
                 "behaviour_logps": c.behaviour_values(), **self.tool_columns(c), **self.image_columns(p)}
                for c, p, t in zip(completions, prompts, texts)]
        rows = gather_object(rows) if self.accelerator.num_processes > 1 else rows
        if self.accelerator.is_main_process:
            seen, unique = set(), []
            for row in sorted(rows, key=lambda r: r["row"]):
                if row["row"] not in seen:
                    seen.add(row["row"])
                    unique.append(row)
            with self.file.open("a") as f:
                for row in unique:
                    f.write(json.dumps(row) + "\n")
            self.latest_rows = unique

    def tool_columns(self, c) -> dict:
        """A rollout row's tool-calling columns: tool_mask (1 = a token the model sampled, 0 = a tool result's,
        never trained; as long as completion_ids) and the executed calls in order (name, arguments, result, failed,
        kept)."""
        if self.tooling is None:
            return {}
        return {"tool_mask": c.tool_mask, "tool_calls": c.tool_calls}

    def truncate_rows(self, before_window: int) -> None:
        """On resume: keep the rows of the windows generated before the checkpoint's next window."""
        if self.accelerator.is_main_process:
            keep_through(self.file, before_window - 1, key="window")

    def reward_metrics(self, per_func: torch.Tensor, rewards: torch.Tensor, zero_std: torch.Tensor,
                       lengths: torch.Tensor) -> dict[str, float]:
        """TRL's reward and completion metrics of one window (all ranks)."""
        out = {}
        for k, f in enumerate(self.funcs):
            out[f"rewards/{f.name}/mean"] = torch.nanmean(per_func[:, k]).item()
            out[f"rewards/{f.name}/std"] = nanstd(per_func[:, k]).item()
        out["reward"] = torch.nanmean(rewards).item()
        out["reward_std"] = nanstd(rewards).item()
        out["frac_reward_zero_std"] = zero_std.float().mean().item()
        length, truncated = lengths[:, 0], lengths[:, 1].bool()
        out["completions/mean_length"] = length.mean().item()
        out["completions/min_length"] = length.min().item()
        out["completions/max_length"] = length.max().item()
        out["completions/clipped_ratio"] = truncated.float().mean().item()
        return out

    def completions_table(self, rows: list[dict]) -> Table:
        """log_completions: TRL's W&B completions table of the latest generation batch, every process's completions:
        step (here the optimizer step that trains the completion), prompt, completion, one column per reward function
        (None where it gave no reward), advantage."""
        names = [f.name for f in self.funcs]
        return Table(["step", "prompt", "completion", *names, "advantage"],
                     [[r["step"], r["prompt"], r["completion"], *(r["rewards"][n] for n in names), r["advantage"]]
                      for r in rows])

    def metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The metrics since the last call: the windows' reward metrics averaged (TRL averages per generation) and
        the loss's token-weighted kl / entropy / clip ratios summed over every rank (`reduce`: dp.sum)."""
        out = {}
        if self.generated_metrics:
            for name in self.generated_metrics[0]:
                out[name] = sum(m[name] for m in self.generated_metrics) / len(self.generated_metrics)
        self.generated_metrics = []
        if self.recipe.log_completions and self.latest_rows:
            out["completions"] = self.completions_table(self.latest_rows)
            self.latest_rows = []
        sums = self.loss_fn.pop_sums()
        for name in sorted(sums):
            value, count = reduce(sums[name].to(self.accelerator.device)).tolist()
            out[name] = value / count if count else None
        for name, value in sorted(self.loss_fn.pop_extremes().items()):  # TRL's nanmin / nanmax over the ranks
            every = self.dp.gather(value.reshape(1).to(self.accelerator.device)).cpu()
            every = every[~torch.isnan(every)]
            out[name] = (every.max() if name.endswith("max") else every.min()).item() if len(every) else 0.0
        return out
