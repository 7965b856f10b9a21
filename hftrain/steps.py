"""The loop's own accounting of its optimizer steps: what one step gives back (`StepResult`: loss sum, the loss's
units, tokens, examples, gradient norm, the objective's statistics) and the steps since the last logged row
(`Window`), whose mean per unit over every rank is the logged loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def add_stats(total: dict[str, torch.Tensor], more: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: total.get(name, 0) + more.get(name, 0) for name in {*total, *more}}


def summed_stats(dp, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The objective's statistics summed over the data-parallel ranks (one collective; every rank has the same
    names: they come from the loss module, not from the data)."""
    names = sorted(stats)
    return dict(zip(names, dp.sum(torch.stack([stats[n] for n in names])).tolist())) if names else {}


@dataclass
class StepResult:
    """One optimizer step as the loop accounts for it."""

    loss: torch.Tensor  # this rank's summed loss over the step's micro-batches (router loss included)
    units: int  # what the loss is normalised by (trained tokens, or pairs), over the data-parallel ranks
    tokens: int  # trained tokens of the step over the data-parallel ranks
    examples: int  # examples (pairs) of the step over the data-parallel ranks
    grad_norm: float | None
    updated: bool  # False: a non-finite gradient norm, nothing applied (nan_policy skip_step)
    learning_rate: float
    stats: dict[str, torch.Tensor] | None = None  # the objective's per-unit statistics, summed on this rank
    token_stats: dict[str, torch.Tensor] | None = None  # the add-ons' per-token statistics (aux_loss x tokens)


@dataclass
class Window:
    """The steps since the last logged row: the logged loss is their mean per unit (token or pair) over every rank."""

    loss: torch.Tensor  # this rank's summed loss of the updated steps (summed over ranks when logged)
    units: int = 0  # the loss's units of the updated steps, over the data-parallel ranks
    tokens: int = 0  # trained tokens of the updated steps, over the data-parallel ranks
    examples: int = 0
    stats: dict[str, torch.Tensor] | None = None  # this rank's summed objective statistics of the updated steps
    token_stats: dict[str, torch.Tensor] | None = None  # this rank's summed per-token statistics (router loss)

    def add(self, step: StepResult) -> None:
        if step.updated:
            self.loss += step.loss
            self.units += step.units
            self.tokens += step.tokens
            self.stats = add_stats(self.stats or {}, step.stats or {})
            self.token_stats = add_stats(self.token_stats or {}, step.token_stats or {})
        self.examples += step.examples

    def reset(self) -> None:
        self.loss.zero_()
        self.units = self.tokens = self.examples = 0
        self.stats = self.token_stats = None
