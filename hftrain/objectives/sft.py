"""Supervised fine-tuning (recipe `objective: sft`): `model.CausalLMTokenLoss`, the summed cross-entropy of the
trained tokens; the loop divides by the step's trained tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.model import CausalLMTokenLoss
from hftrain.objectives.base import Objective


class SFT(Objective):
    name = "sft"

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> CausalLMTokenLoss:
        return CausalLMTokenLoss(lm, recipe.loss_chunk_tokens, recipe.use_liger_kernel, recipe.router_aux_loss_coef,
                                 recipe.router_aux_loss_scope)
