"""What the loop minimises: one module per objective family, chosen by the recipe's `objective` through
`OBJECTIVES` (the loop calls `objective_for(recipe)`'s hooks, `base.Objective`, and never branches on the name).

- `sft.py`: `sft`, the summed token cross-entropy (`sft.CausalLMTokenLoss`); the loop divides by the step's
  trained tokens.
- `preference.py`: `dpo` / `simpo`, `PreferenceLoss`, the summed loss of preference pairs; the loop divides by the
  step's pairs.
- `orpo.py`: `orpo`, `ORPOLoss`: TRL's ORPO (chosen-row NLL, prompt included, minus beta x log sigmoid(log odds)),
  reference-free; the NLL is the mean over the step's chosen tokens, the odds-ratio term over its pairs.
- `kto.py`: `kto`, `KTOLoss`: TRL's KTO on unpaired feedback against a reference (as dpo's), its KL reference
  point estimated over the optimizer step's whole batch in a no-grad pass before the step (`prepare_step`).
- `reward.py`: `reward`, `RewardLoss`: a reward model (the base as a one-output sequence classifier) trained with
  TRL's RewardTrainer loss, -log sigmoid(r_chosen - r_rejected - margin) (+ center_rewards_coefficient's term), the
  mean over the step's pairs.
- `reference.py`: the reference models an objective compares with (adapters disabled, a frozen copy, precomputed
  log-probs and their cross-run cache).
- `distill.py`: `distill`, `DistillLoss`: the generalized JSD to a frozen teacher's next-token distributions per
  trained token (the teacher's logits made one chunk of tokens at a time); the loop divides by the step's tokens.
- `embedding.py`: `embedding`, `EmbeddingLoss`: a bi-encoder (AutoModel, pooled and normalised) trained with
  sentence-transformers' MultipleNegativesRankingLoss, the candidates gathered over data-parallel ranks; the loop
  divides by the step's anchors. Its final folder is sentence-transformers' layout (`add_files`).
- `reranker.py`: `reranker`, `RerankerLoss`: a cross-encoder (a one-output sequence classifier, or a causal LM's
  yes/no logits: `reranker_head: yes_no`, the Qwen3-Reranker form) trained with
  sentence-transformers' CrossEncoder losses (binary cross-entropy on labelled pairs, listwise cross-entropy of a
  positive against its hard negatives); the loop divides by the step's rows.
- `grpo.py`: `grpo`, online RL (generation windows, rewards, TRL's GRPO loss; pieces in hftrain/rl/). It plugged in
  the way any objective does: a module with its `Objective` subclass, one entry in `OBJECTIVES`,
  the name in the recipe's `objective` choices, its fields and rules in `hftrain/fields/objectives.py`
  (`problems`, re-exported here); see docs/modules.md, "Plug-in points".

Every loss module returns a *sum* and says what it sums over (`loss_units(batch)`): the loop adds those units
over all micro-batches and data-parallel ranks of the optimizer step and divides once, so k micro-batches of b,
k ranks of b and one batch of k*b give the same update (TRL averages per micro-batch instead).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.fields.objectives import problems
from hftrain.loss import ObjectiveLoss
from hftrain.objectives.base import Objective
from hftrain.objectives.distill import Distill
from hftrain.objectives.embedding import Embedding
from hftrain.objectives.grpo import GRPO
from hftrain.objectives.kto import KTO
from hftrain.objectives.orpo import ORPO
from hftrain.objectives.preference import PAIR_STATS, Preference, PreferenceLoss, pair_losses
from hftrain.objectives.reference import AdapterReference, FrozenReference, PrecomputedReference, build_reference
from hftrain.objectives.reranker import Reranker
from hftrain.objectives.reward import Reward
from hftrain.objectives.sft import SFT

__all__ = ["OBJECTIVES", "PAIR_STATS", "AdapterReference", "FrozenReference", "Objective", "PrecomputedReference",
           "PreferenceLoss", "build_loss", "build_reference", "objective_for", "pair_losses", "problems"]

OBJECTIVES: dict[str, Objective] = {
    "sft": SFT(),
    "dpo": Preference("dpo", needs_reference=True),
    "simpo": Preference("simpo", needs_reference=False),
    "orpo": ORPO(),
    "kto": KTO(),
    "reward": Reward(),
    "grpo": GRPO(),
    "distill": Distill(),
    "embedding": Embedding(),
    "reranker": Reranker(),
}


def objective_for(recipe: Recipe) -> Objective:
    """The registered objective of `recipe.objective` (the recipe's choices are validated against the same names)."""
    return OBJECTIVES[recipe.objective]


def build_loss(recipe: Recipe, lm: nn.Module, device: torch.device,
               copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> ObjectiveLoss:
    """The loss module of the recipe's objective around the built model."""
    return objective_for(recipe).build_loss(recipe, lm, device, copy_model)
