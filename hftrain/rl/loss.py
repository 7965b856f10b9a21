"""GRPO's loss over fixed rollouts, as TRL 1.16 computes it (`GRPOTrainer._compute_loss` and the advantages of
`_generate_and_score_completions`), written so that the loop's one normalisation makes it exact under gradient
accumulation and across processes.

Notation: a generation batch of N completions (all processes, all micro-batches of a generation window), G
completions per prompt (`num_generations`), m the completion mask (tokens after the first EOS, and truncated
completions with `mask_truncated_completions`, excluded), logp the per-token log-probs of the sampled tokens from
logits divided by the sampling temperature.

- Advantages (`group_advantages`, over the whole generation batch): R = sum_k w_k r_k (None -> NaN, nan-summed;
  a completion whose every function returned None gets advantage 0). `group`: A = (R - group mean) / (group std +
  1e-4), std with Bessel's correction; `batch`: the std is the whole batch's, the mean still the group's; `none`:
  A = R - group mean.
- RLOO's advantages (`leave_one_out_advantages`, advantage_estimator rloo; TRL's RLOOTrainer): R as above, minus
  beta x sum_t m (logp_gen - ref) (the first-order KL of the log-probs at generation, summed per completion; then
  no KL term in the loss); A = R - (sum of the group's other scored R) / (its scored count - 1); with
  normalize_advantages A = (A - nanmean(A)) / (nanstd(A) + 1e-4) over the whole generation batch; NaN (unscored,
  or a group with one scored completion) -> 0.
- Ratio (`per_token_loss`): token level rho = exp(logp - logp_old); sequence level (GSPO) one ratio per completion,
  exp(sum_t m (logp - logp_old) / max(1, sum_t m)). logp_old is logp.detach() on the first pass over a rollout
  (the value 1, the gradient of rho) and the stored log-probs of that first pass on later ones (num_iterations > 1).
- Per token, by loss_type (rho [B, T] at token level, [B, 1] at sequence level, broadcast over the tokens):
    dapo, grpo, bnpo, dr_grpo   l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A)
    cispo (MiniMax-M1)          l = -sg(min(rho, epsilon_high)) A logp: the ratio (stop-gradient, sg) clipped from
                                    above at epsilon_high itself (not 1 + epsilon_high; the paper's epsilon_max,
                                    TRL recommends 5.0), the gradient that of logp
    sapo (Soft Adaptive PO)     l = -sigmoid(tau (rho - 1)) 4 / tau A, tau = sapo_temperature_pos where A > 0, else
                                    sapo_temperature_neg: a smooth gate instead of the hard clip
  plus beta * KL with KL = exp(ref - logp) - (ref - logp) - 1, multiplied by rho (TRL's use_bias_correction_kl, on
  by default).
- vLLM's importance-sampling correction (use_vllm, `vllm_importance_sampling_ratio`, computed once per rollout at
  generation): w from d = m (logp_old - logp_vllm) (NaN -> 0), per token (token_*) or summed per completion
  (sequence_*), w = exp(d) clamped to [clip_min, clip_max] (*_truncate) or set to 0 outside it (*_mask); l is
  multiplied by w before the beta KL term is added (TRL's `_generate_and_score_completions` / `_compute_loss`).
- Aggregation (`micro_batch_loss` returns a sum, `loss_units` what it is a sum over; the loop adds both over the
  micro-batches and processes of an optimizer step and divides once):
    dapo, cispo  sum m l             / completion tokens of the step on all processes (TRL: num_items_in_batch of
                                       the generation batch / processes x accumulation / steps_per_generation, the
                                       same number when a generation window is one optimizer step)
    grpo, sapo  sum_i (sum_t m l / max(1, sum_t m))  / completions of the step (TRL: the mean over the micro-batch's
                                       completions / accumulation, averaged over processes: the same for equal
                                       micro-batches)
    dr_grpo  sum m l / max_completion_length      / completions of the step
    bnpo     b x (sum m l / max(1, sum m))         / completions of the step: TRL's per-micro-batch token mean,
                                       averaged over the micro-batches (so, as in TRL, it depends on the split)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo")
TOKEN_NORMALISED = ("dapo", "cispo")  # loss types whose step's sum is divided by its completion tokens
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass(frozen=True)
class LossSettings:
    """The recipe fields the loss reads (GRPOConfig's names; epsilon_high None means epsilon)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int = 512
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim)
    return torch.sqrt(variance * count / (count - 1))


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reward R, advantage A, whether the std used was zero) of each completion of a whole generation batch.

    `rewards_per_func`: [N, K], NaN where a function returned None; rows are grouped by prompt, G consecutive rows
    each. R is NaN for a completion that no function scored (it is left out of its group's mean and std, and its
    advantage is 0)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group; for none only to report groups whose rewards were all equal
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 \
            else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return rewards, torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def leave_one_out_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                             normalize: bool, kl: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLOOTrainer's (reward R without the KL penalty, advantage A, whether the group's std of the penalised rewards
    is zero) of each completion of a whole generation batch; `kl` [N]: beta x each completion's summed first-order
    KL, subtracted from R before the baseline (None: beta 0)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    penalised = rewards if kl is None else rewards - kl.to(rewards)
    grouped = penalised.view(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = penalised - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    return rewards, torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def completion_log_probs(logits: torch.Tensor, tokens: torch.Tensor,
                         temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each sampled token, entropy of each position's distribution) from the logits that predicted
    them, divided by the sampling temperature as TRL does, in fp32. logits [B, T, V], tokens [B, T]."""
    logps = F.log_softmax(logits.float() / temperature, dim=-1)
    token_logps = logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return token_logps, entropy


def token_log_probs(lm: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
                    **model_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token [B, L-1] from the logits / temperature, fp32; the entropies, detached).
    `model_inputs`: an image-text model's inputs beside the tokens (pixel_values, ...: hftrain.rl.images)."""
    logits = lm(input_ids=input_ids, use_cache=False, **model_inputs).logits[:, :-1]
    return completion_log_probs(logits, input_ids[:, 1:], temperature)


VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def vllm_importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                                   mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's correction for the mismatch between the sampler (vLLM) and the trained model: [B, T] (token_*) or
    [B, 1] (sequence_*) weights of each token's loss, from the trained model's log-probs at generation `old_logps`
    and vLLM's log-probs of the sampled tokens `sampling_logps` (NaN where vLLM gave none: no correction there)."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask.to(old_logps.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode={mode}; one of {', '.join(VLLM_IMPORTANCE_SAMPLING_MODES)}")


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The advantages broadcast over a completion's tokens: [B] -> [B, 1]; already per token (a sequence-parallel
    slice's concatenated rows, [1, T]) as they are."""
    return advantages if advantages.dim() == like.dim() else advantages.unsqueeze(-1)


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                   advantages: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
                   sampling_weights: torch.Tensor | None = None, log_ratio: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss [B, T], importance ratio [B, T] or [B, 1] (sequence level), per-token KL or None).

    `old_logps` None: this is the first pass over the rollout (the ratio's value is 1, its gradient that of logp).
    `sampling_weights`: vLLM's importance-sampling correction (`vllm_importance_sampling_ratio`), or None.
    `log_ratio`: each token's log-ratio when computed by the caller (a sequence-parallel slice's sequence-level
    ratios, each completion's mean gathered over the slices), used as it is."""
    old = logps.detach() if old_logps is None else old_logps
    given = log_ratio is not None
    log_ratio = logps - old if log_ratio is None else log_ratio
    mask = mask.to(logps.dtype)
    if settings.importance_sampling_level == "sequence" and not given:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = per_token(advantages, logps)
    if settings.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=settings.upper).detach() * adv * logps
    elif settings.loss_type == "sapo":
        tau = torch.where(adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg).to(ratio.dtype)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.upper)
        loss = -torch.min(ratio * adv, clipped * adv)
    if sampling_weights is not None:
        loss = loss * sampling_weights
    kl = None
    if settings.beta != 0.0:
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio  # use_bias_correction_kl (TRL's default)
        loss = loss + settings.beta * kl
    return loss, ratio, kl


def micro_batch_loss(loss: torch.Tensor, mask: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """The micro-batch's share of the step's loss, as a sum over `loss_units` (module docstring's table)."""
    mask = mask.to(loss.dtype)
    if loss.shape[-1] == 1 and mask.shape[-1] != 1:
        loss = loss.expand_as(mask)
    return aggregate((loss * mask).sum(-1), mask, settings)


def aggregate(summed: torch.Tensor, mask: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """`micro_batch_loss` from each completion's summed token loss `summed` [B] and the micro-batch's mask [B, T]."""
    mask = mask.to(summed.dtype)
    if settings.loss_type in TOKEN_NORMALISED:
        return summed.sum()
    if settings.loss_type in ("grpo", "sapo"):
        return (summed / mask.sum(-1).clamp(min=1.0)).sum()
    if settings.loss_type == "dr_grpo":
        return summed.sum() / settings.max_completion_length
    if settings.loss_type == "bnpo":
        return len(mask) * summed.sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss_type {settings.loss_type!r}")


def loss_units(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What `micro_batch_loss` sums over: completion tokens (dapo, cispo) or completions (the others), int64."""
    if loss_type in TOKEN_NORMALISED:
        return mask.sum().long()
    return torch.tensor(len(mask), dtype=torch.long, device=mask.device)


def clip_statistics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    settings: LossSettings) -> dict[str, torch.Tensor]:
    """Sums and counts behind TRL's clip_ratio/low_mean, high_mean and region_mean (token-weighted, or one value per
    completion at sequence level): {name: (sum, count)} to be added over micro-batches and processes. cispo: TRL's
    cispo_clip_ratio (ratio > epsilon_high where A > 0) instead; sapo clips nothing, so none (as TRL)."""
    adv = per_token(advantages, mask)
    weights = mask.to(torch.float64) if ratio.shape[-1] != 1 else torch.ones_like(ratio, dtype=torch.float64)
    count = weights.sum()
    if settings.loss_type == "sapo":
        return {}
    if settings.loss_type == "cispo":
        flags = (("cispo_clip_ratio", (ratio > settings.upper) & (adv > 0)),)
    else:
        low = (ratio < 1 - settings.epsilon_low) & (adv < 0)
        high = (ratio > 1 + settings.upper) & (adv > 0)
        flags = (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high), ("clip_ratio/region_mean", low | high))
    return {name: torch.stack([(flag.to(torch.float64) * weights).sum(), count]) for name, flag in flags}
