"""ORPO (recipe `objective: orpo`): Odds Ratio Preference Optimization, reference-free, as TRL 1.16's ORPOTrainer
computes it (trl/experimental/orpo/orpo_trainer.py).

loss = NLL(chosen rows) - beta x mean over pairs of log sigmoid(log odds), with a row's log-prob the *mean* over its
completion tokens and log odds = (logp_c - logp_r) - (log(1 - exp logp_c) - log(1 - exp logp_r)).
The NLL term is TRL's: the token mean of the chosen rows' cross-entropy over *all* their tokens after the first,
prompt included (not only the completion). TRL takes that mean per micro-batch; here it is the mean over the
optimizer step's chosen tokens (all micro-batches and data-parallel ranks, counted in `prepare_step`), and the
odds-ratio term the mean over the step's pairs, so accumulation and processes leave the step unchanged, and a step
of one micro-batch on one process is TRL's. On an image-text model (image pairs: hftrain.data.image_pairs) the
image tokens are never NLL targets (TRL's ORPOTrainer takes no images).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.objectives.preference import PAIR_STATS, Preference, PreferenceLoss
from hftrain.run_parts import TrainRun

# per-pair statistics (summed, divided by the window's pairs when logged), TRL's names; nll_loss is summed per
# micro-batch as its share of the step's token mean x the step's pairs, so the logged value is the step's mean
ORPO_STATS = (*PAIR_STATS, "log_odds_ratio", "log_odds_chosen", "nll_loss")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (log(-expm1) near 0, log1p(-exp) far below)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(beta: float, chosen: torch.Tensor, rejected: torch.Tensor):
    """(beta x log sigmoid(log odds), log odds) per pair, from mean completion log-probs (TRL's odds_ratio_loss)."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return beta * F.logsigmoid(log_odds), log_odds


def real_lengths(trained: torch.Tensor) -> torch.Tensor:
    """Real tokens per row from its shifted trained-label mask: the position after its last trained label (1 for a
    filler row; an empty micro-batch's filler is one token wide, so the mask may have no column at all)."""
    positions = torch.arange(1, trained.shape[1] + 1, device=trained.device)
    return F.pad(torch.where(trained, positions, 0), (1, 0)).amax(dim=1) + 1


def nll_targets(labels: torch.Tensor, image_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, L-1]: the targets of the NLL term, positions 1..len-1 of each chosen row (rows are b chosen then b
    rejected), as TRL's labels (input_ids where attention_mask is 1) shifted by one; an image-text model's image
    tokens (`image_tokens`, hftrain.data.image_pairs) are never targets."""
    trained = labels[:, 1:] != IGNORE_INDEX
    positions = torch.arange(trained.shape[1], device=labels.device)
    chosen_row = torch.arange(len(labels), device=labels.device) < len(labels) // 2
    mask = (positions[None] < (real_lengths(trained) - 1)[:, None]) & chosen_row[:, None]
    return mask & ~image_tokens[:, 1:] if image_tokens is not None else mask


def orpo_token_log_probs(lm: nn.Module, head_only: bool, input_ids: torch.Tensor, labels: torch.Tensor,
                         image_tokens: torch.Tensor | None = None, **model_inputs: torch.Tensor):
    """(per-row summed completion log-prob, completion tokens per row, summed chosen-row NLL, its tokens), fp32.

    Rows are b chosen then b rejected (`data.Collator`), right-padded. A row's real length is the position after its
    last trained label (truncation keeps the completion at the end). The NLL covers `nll_targets`. `model_inputs`:
    an image-text processor's outputs (pixel_values, attention_mask, ...)."""
    targets, trained = input_ids[:, 1:], labels[:, 1:] != IGNORE_INDEX
    nll_mask = nll_targets(labels, image_tokens)
    needed = trained | nll_mask
    inputs = {"input_ids": input_ids, "use_cache": False, **model_inputs}
    if head_only:
        hidden = lm.get_decoder()(**inputs).last_hidden_state[:, :-1][needed]
        logits = lm.get_output_embeddings()(hidden)
    else:
        logits = lm(**inputs).logits[:, :-1][needed]
    token_logps = -F.cross_entropy(logits.float(), targets[needed], reduction="none")
    full = torch.zeros(targets.shape, dtype=token_logps.dtype, device=input_ids.device)
    full = full.index_put((needed.nonzero(as_tuple=True)), token_logps)
    return (full * trained).sum(dim=1), trained.sum(dim=1), -(full * nll_mask).sum(), nll_mask.sum()


class ORPOLoss(PreferenceLoss):
    """Wraps a causal LM so that `forward` returns the micro-batch's share of the step's ORPO loss x the step's
    pairs (the loop divides by those). Training: `prepare_step` counts the step's pairs and chosen NLL tokens first.
    Evaluation: `forward` returns the odds-ratio part, the NLL sums go to `eval_metrics` as statistics."""

    def __init__(self, lm: nn.Module, recipe: Recipe):
        super().__init__(lm, recipe, reference=None)
        self.nll_scale = None  # training: the step's pairs / its chosen NLL tokens

    def prepare_step(self, model: nn.Module, micro_batches: list[dict[str, torch.Tensor]],
                     reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The step's pairs and chosen-row NLL tokens over all its micro-batches and data-parallel ranks."""
        local = torch.zeros(2, dtype=torch.long, device=micro_batches[0]["input_ids"].device)
        for batch in micro_batches:
            labels = batch["labels"]
            trained = labels[: len(labels) // 2, 1:] != IGNORE_INDEX
            local += torch.stack([trained.any(dim=1).sum(), nll_targets(labels, batch.get("image_tokens")).sum()])
        pairs, tokens = reduce(local).tolist()
        self.nll_scale = pairs / max(tokens, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                real_tokens: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                image_tokens: torch.Tensor | None = None, **model_inputs: torch.Tensor) -> torch.Tensor:
        sums, lengths, nll_sum, nll_tokens = orpo_token_log_probs(self.lm, self.head_only, input_ids, labels,
                                                                  image_tokens, **model_inputs)
        half = len(input_ids) // 2
        # a filler pair (an empty micro-batch's) has no completion: a mean log-prob of -1 keeps its odds finite, and
        # `real` then keeps it out of the loss and the statistics (0 would be log(1 - 1) = -inf, and NaN x 0 = NaN)
        means = torch.where(lengths > 0, sums / lengths.clamp(min=1), -1.0)
        chosen, rejected = means[:half], means[half:]
        ratio, log_odds = odds_ratio_terms(self.recipe.beta, chosen, rejected)
        real = (lengths[:half] > 0).to(ratio.dtype)
        beta = self.recipe.beta
        train = self.training and self.nll_scale is not None
        nll_part = nll_sum * self.nll_scale if train else nll_sum.new_zeros(())
        with torch.no_grad():
            chosen_reward, rejected_reward = beta * chosen, beta * rejected
            per_pair = torch.stack([chosen_reward, rejected_reward, (chosen_reward > rejected_reward).to(real.dtype),
                                    chosen_reward - rejected_reward, chosen, rejected, ratio / beta, log_odds]) @ real
            extra = [nll_part.detach()] if train else [nll_sum.detach(), nll_tokens.to(real.dtype)]
            stats = torch.cat([per_pair, torch.stack(extra)])
            self.stats = stats if self.stats is None else self.stats + stats
        return nll_part - (ratio * real).sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Training: sums of ORPO_STATS since the last call; evaluation: the pair statistics and the NLL's
        (nll_sum, nll_tokens)."""
        stats, self.stats = self.stats, None
        if stats is None:
            return {}
        names = ORPO_STATS if len(stats) == len(ORPO_STATS) else (*ORPO_STATS[:-1], "nll_sum", "nll_tokens")
        return dict(zip(names, stats.double()))

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        """eval_loss = the eval set's chosen-token NLL mean - beta x its mean log sigmoid(log odds)."""
        nll = stats.pop("nll_sum", 0.0) / max(stats.pop("nll_tokens", 0.0), 1)
        return {"eval_loss": nll + loss_sum / max(units, 1), "eval_pairs": int(units), "eval_nll_loss": nll,
                **{f"eval_{name}": value / max(units, 1) for name, value in stats.items()}}


class ORPO(Preference):
    """orpo: `ORPOLoss` around the model, no reference."""

    def __init__(self):
        super().__init__("orpo", needs_reference=False)

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> ORPOLoss:
        return ORPOLoss(lm, recipe)

    def notes(self, run: TrainRun) -> list[str]:
        images = ", image tokens left out" if run.processor is not None else ""
        return [f"objective orpo, beta {run.recipe.beta:g}; reference: none (reference-free); the loss is the NLL "
                f"token mean over the step's chosen rows (prompt tokens included, as TRL{images}) - beta x the mean "
                "log sigmoid(log odds) over its pairs"]
