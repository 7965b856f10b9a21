"""Preference objectives (recipe `objective: dpo` or `simpo`): the summed loss of preference pairs; the loop divides
by the step's pairs.

Preference micro-batches hold b pairs as 2b rows, the b chosen rows then the b rejected rows (`data.Collator`),
run in one forward. A row's log-probability is the sum of its completion tokens' log-probs
(`reference.sequence_log_probs`). dpo compares with a reference (`reference.build_reference`), simpo needs none.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, Collator
from hftrain.errors import HftrainError
from hftrain.loss import ObjectiveLoss
from hftrain.model import pad_token_id
from hftrain.objectives.base import Objective
from hftrain.objectives.reference import (
    AdapterReference,
    FrozenReference,
    build_reference,
    precompute_reference_log_probs,
    reference_values,
    sequence_log_probs,
)
from hftrain.parallel.launch import phase
from hftrain.router_loss import router_loss
from hftrain.run_parts import ModelRun, TrainRun

# per-pair statistics summed over a window and divided by its pairs when logged (TRL's metric names)
PAIR_STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected")



def pair_losses(recipe: Recipe, chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                rejected_len: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None):
    """(loss, chosen reward, rejected reward) per pair, from summed log-probs and completion lengths.

    dpo: log-ratios r = log pi - log ref; sigmoid -(1-e) log s(b d) - e log s(-b d) with d = r_c - r_r (e =
    label_smoothing), hinge relu(1 - b d), ipo (r_c/len_c - r_r/len_r - 1/(2b))^2; rewards b r.
    simpo: d = log pi_c/len_c - log pi_r/len_r - gamma/b, the sigmoid loss of d; rewards b log pi/len.
    """
    beta, eps = recipe.beta, recipe.label_smoothing
    if recipe.objective == "simpo":
        chosen_avg, rejected_avg = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
        delta = chosen_avg - rejected_avg - recipe.simpo_gamma / beta
        loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        return loss, beta * chosen_avg, beta * rejected_avg
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if recipe.loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif recipe.loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    else:  # ipo, normalised per completion token as TRL (and the IPO authors' results) do
        per_token = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        loss = (per_token - 1 / (2 * beta)) ** 2
    return loss, beta * chosen_ratio, beta * rejected_ratio


class PreferenceLoss(ObjectiveLoss):
    """Wraps a causal LM so that `forward` returns the *sum* of the micro-batch's pair losses (dpo or simpo).

    Padding pairs (the filler of an empty micro-batch) have no trained token and count neither in the loss nor in
    `loss_units`. The per-pair statistics of PAIR_STATS are summed (detached) until `pop_stats`.
    """

    unit = "pairs"
    examples_name = "pairs"  # logged as pairs_per_second next to samples_per_second

    def __init__(self, lm: nn.Module, recipe: Recipe, reference: AdapterReference | FrozenReference | None):
        super().__init__(lm)
        if (router := router_loss(lm, recipe.router_aux_loss_coef)) is not None:
            raise HftrainError(
                f"objective={recipe.objective} on a mixture-of-experts model: the router load-balancing loss is "
                f"not defined per pair in hftrain yet; set router_aux_loss_coef: 0 (the model's config has "
                f"{router.coef})"
            )
        self.recipe = recipe
        self.reference = reference  # a plain object: its model stays out of this module's parameters
        self.stats = None
        self.collecting = False  # True while precomputing: forward returns each row's log-prob instead of a loss

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Real pairs in the micro-batch: chosen rows with a trained token."""
        chosen = batch["labels"][: len(batch["labels"]) // 2, 1:]
        return (chosen != IGNORE_INDEX).any(dim=1).sum()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                real_tokens: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                image_tokens: torch.Tensor | None = None, **model_inputs: torch.Tensor) -> torch.Tensor:
        """`ref_logps`: each row's precomputed reference log-prob (precompute_ref_log_probs). `model_inputs`: an
        image-text processor's outputs (pixel_values, attention_mask, ...: hftrain.data.image_pairs), given to the
        policy and the reference alike; `image_tokens` (image pairs) is not needed here: the labels leave those
        tokens out."""
        logps, lengths = sequence_log_probs(self.lm, self.head_only, input_ids, labels, **model_inputs)
        if self.collecting:
            return logps.detach()
        ref = ref_logps
        if ref is None and isinstance(self.reference, (AdapterReference, FrozenReference)):
            ref = self.reference.log_probs(input_ids, labels, **model_inputs)
        if ref is None and self.recipe.objective == "dpo":
            raise HftrainError("dpo needs the reference log-probs of this batch, and none were computed")
        half = len(input_ids) // 2
        chosen, rejected = logps[:half], logps[half:]
        ref_chosen, ref_rejected = (ref[:half], ref[half:]) if ref is not None else (None, None)
        losses, chosen_reward, rejected_reward = pair_losses(self.recipe, chosen, rejected, lengths[:half],
                                                             lengths[half:], ref_chosen, ref_rejected)
        real = (lengths[:half] > 0).to(losses.dtype)
        with torch.no_grad():
            stats = torch.stack([chosen_reward, rejected_reward, (chosen_reward > rejected_reward).to(losses.dtype),
                                 chosen_reward - rejected_reward, chosen, rejected]) @ real
            self.stats = stats if self.stats is None else self.stats + stats
        return (losses * real).sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Sums of PAIR_STATS over the pairs since the last call (detached, this rank)."""
        stats, self.stats = self.stats, None
        return {} if stats is None else dict(zip(PAIR_STATS, stats.double()))

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": loss_sum / max(units, 1), "eval_pairs": int(units),
                **{f"eval_{name}": value / max(units, 1) for name, value in stats.items()}}


class Preference(Objective):
    """dpo (against a reference) or simpo (reference-free): `PreferenceLoss` around the model."""

    def __init__(self, name: str, needs_reference: bool):
        self.name, self.needs_reference = name, needs_reference

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> PreferenceLoss:
        reference = build_reference(recipe, lm, device, copy_model) if self.needs_reference else None
        return PreferenceLoss(lm, recipe, reference)

    def prepare(self, run: ModelRun) -> dict[str, torch.Tensor] | None:
        """dpo's frozen copy placed like the policy; with precompute_ref_log_probs, the reference log-probs."""
        if hasattr(run.parts.loss.reference, "prepare"):
            run.parts.loss.reference.prepare(run.backend)
        return precompute_reference(run) if run.recipe.precompute_ref_log_probs else None

    def notes(self, run: TrainRun) -> list[str]:
        """The preference objective, its settings and its reference, in words."""
        recipe = run.recipe
        reference = getattr(run.parts.loss.reference, "describe", lambda: "none (reference-free)")()
        loss = f" ({recipe.loss_type})" if recipe.objective == "dpo" else ""
        return [f"objective {recipe.objective}{loss}, beta {recipe.beta:g}; reference: {reference}; the loss is the "
                "mean over the step's pairs"]


def precompute_reference(run: ModelRun) -> dict[str, torch.Tensor]:
    """dpo's reference log-probs of every training and eval pair of the run (`reference_values`: from the resumed
    checkpoint, the cross-run cache, or one pass of the prepared starting model), handed to the collators."""
    sets = {"train": (run.data.train_set, run.data.collator), "eval": (run.data.eval_set, run.data.eval_collator)}
    sets = {name: pair for name, pair in sets.items() if pair[0] is not None}

    def compute() -> dict[str, torch.Tensor]:
        with phase(run.accelerator, "precomputing reference log-probs", run.recipe.ddp_timeout):
            values = {name: precompute_reference_log_probs(
                run.model, run.parts.loss, data, Collator(data, pad_token_id(run.tokenizer)), run.dp,
                run.recipe.per_device_eval_batch_size, run.accelerator.device)
                for name, (data, _) in sets.items()}
        run.backend.release(run.model)  # FSDP2: the root's weights gathered by the forwards, resharded
        return values

    values, run.parts.loss.reference.source = reference_values(
        run.recipe, {name: data for name, (data, _) in sets.items()}, run.accelerator, run.resume_from, compute)
    for name, (_, collator) in sets.items():
        collator.reference = values[name].cpu()
    run.parts.loss.reference.what = f"{sum(len(data) for data, _ in sets.values())} pairs"
    return values
