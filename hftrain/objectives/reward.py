"""Reward models (recipe `objective: reward`): a scalar score per sequence trained on preference pairs, as TRL 1.16's
RewardTrainer computes it (trl/trainer/reward_trainer.py).

The base is loaded as `AutoModelForSequenceClassification` with `num_labels: 1` (`model.load_base_model`): the causal
LM's body plus a `score` head (hidden -> 1, drawn at load), whose value at each sequence's last real token is its
reward (the model's own pooling: the last token that is not the pad token, `config.pad_token_id` = the collator's
pad id, set in `prepare`). Per pair, with r_c and r_r the chosen and rejected rewards and m the pair's `margin`
column (0 without one):

    loss = -log sigmoid(r_c - r_r - m) + center_rewards_coefficient x (r_c + r_r)^2

TRL takes the mean over each micro-batch; here each micro-batch returns its sum and the loop divides by the optimizer
step's pairs (all micro-batches and data-parallel ranks), so accumulation and processes leave the step unchanged and a
step of one micro-batch on one process is TRL's. Metrics (TRL's names): `accuracy` (share of pairs with r_c > r_r),
`margin` (mean r_c - r_r), `mean_reward` (mean of every score), each over the logging window's pairs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.model import pad_token_id
from hftrain.objectives.preference import Preference, PreferenceLoss
from hftrain.run_parts import ModelRun, TrainRun

# per-pair statistics summed over a window and divided by its pairs when logged (TRL's names)
REWARD_STATS = ("accuracy", "margin", "mean_reward")


def reward_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                       center_coefficient: float | None) -> torch.Tensor:
    """RewardTrainer's loss of each pair (its `compute_loss` before the mean), from the two rows' scores."""
    delta = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(delta)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def attention_mask(input_ids: torch.Tensor, pad_id: int | None, real_tokens: torch.Tensor | None) -> torch.Tensor:
    """1 on each right-padded row's real tokens: the collator's `real_tokens`, else every token up to the row's last
    non-pad one (the model's pooling rule). The first token always counts, so that a filler row (an empty
    micro-batch's padding) attends to something."""
    if real_tokens is None:
        positions = torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device)
        length = torch.where(input_ids != pad_id, positions, 1).amax(dim=1) if pad_id is not None else \
            torch.full((len(input_ids),), input_ids.shape[1], device=input_ids.device)
        real_tokens = positions[None] <= length[:, None]
    mask = real_tokens.long()
    mask[:, 0] = 1
    return mask


class RewardLoss(PreferenceLoss):
    """Wraps a sequence-classification model with one label so that `forward` returns the *sum* of the micro-batch's
    pair losses (the loop divides by the step's pairs). Rows are b chosen then b rejected (`data.Collator`)."""

    headline = ("loss", "accuracy")

    def __init__(self, lm: nn.Module, recipe: Recipe):
        super().__init__(lm, recipe, reference=None)
        self.head_only = False  # the model's own forward: its score head and pooling

    def scores(self, input_ids: torch.Tensor, real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's reward in fp32: the model's output at its last non-pad token, the whole rendered sequence
        (what the chat template writes after the completion included, as TRL scores it); the attention mask covers
        the real tokens, as TRL's collator makes it."""
        mask = attention_mask(input_ids, self.lm.config.pad_token_id, real_tokens)
        return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.squeeze(-1).float()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                real_tokens: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                margin: torch.Tensor | None = None) -> torch.Tensor:
        """`margin`: each pair's margin column (the data's optional `margin`), or None."""
        rewards = self.scores(input_ids, real_tokens)
        half = len(input_ids) // 2
        chosen, rejected = rewards[:half], rewards[half:]
        losses = reward_pair_losses(chosen, rejected, None if margin is None else margin.to(chosen.dtype),
                                    self.recipe.center_rewards_coefficient)
        real = (labels[:half, 1:] != IGNORE_INDEX).any(dim=1).to(losses.dtype)
        with torch.no_grad():
            stats = torch.stack([(chosen > rejected).to(real.dtype), chosen - rejected, (chosen + rejected) / 2]) @ real
            self.stats = stats if self.stats is None else self.stats + stats
        return (losses * real).sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Sums of REWARD_STATS over the pairs since the last call (detached, this rank)."""
        stats, self.stats = self.stats, None
        return {} if stats is None else dict(zip(REWARD_STATS, stats.double()))


class Reward(Preference):
    """reward: `RewardLoss` around the sequence-classification model; no reference."""

    eval_headline = "eval_accuracy"
    completes_eval_prompts = writes_text = False  # a reward model scores text, it does not write any

    def __init__(self):
        super().__init__("reward", needs_reference=False)

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> RewardLoss:
        return RewardLoss(lm, recipe)

    def prepare(self, run: ModelRun) -> None:
        """The model reads each score at the last token that is not `config.pad_token_id`: the collator's pad id,
        so that the saved folder pools as training did; the collators mark each row's real tokens."""
        config = run.parts.loss.lm.config
        config.get_text_config().pad_token_id = config.pad_token_id = pad_token_id(run.tokenizer)
        for collator in (run.data.collator, run.data.eval_collator):
            if collator is not None:  # the attention mask of each row's real tokens
                collator.mark_real_tokens = True
        return None

    def notes(self, run: TrainRun) -> list[str]:
        recipe, tokenizer = run.recipe, run.tokenizer
        center = recipe.center_rewards_coefficient
        margin = " - margin" if "margin" in run.data.train_set.column_names else ""
        lines = [f"objective reward: a new score head (num_labels 1) on {type(run.parts.loss.lm).__name__} in place of "
                 "the language-model head; loss "
                 f"-log sigmoid(r_chosen - r_rejected{margin})"
                 f"{f' + {center:g} x (r_chosen + r_rejected)^2' if center is not None else ''}, the mean over the "
                 "step's pairs"]
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            lines.append("this tokenizer pads with its EOS token, so each score is read at the last token before the "
                         "trailing EOS tokens (as TRL and AutoModelForSequenceClassification do with this tokenizer); "
                         "a tokenizer with a pad token of its own (tokenizer_name_or_path) reads it at the EOS")
        return lines
