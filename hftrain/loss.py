"""`ObjectiveLoss`: what every objective's loss module is to the loop, and how add-ons compose onto it.

An objective's loss module (sft's `CausalLMTokenLoss`, `PreferenceLoss`, `ORPOLoss`, `KTOLoss`, `RewardLoss`,
`DistillLoss`, `GRPOLoss`) is a `model.WrapsCausalLM` (the causal LM under `lm`: the one module the parallelism
backends prepare, so that the loss runs inside DDP's / FSDP2's / DeepSpeed's forward) whose `forward` returns a *sum*
over what `loss_units(batch)` counts (tokens, pairs, completions); the loop adds those units over every micro-batch
and data-parallel rank of the optimizer step and divides once. `pop_stats` gives the objective's own statistics per
unit, `eval_metrics` its evaluation row.

Add-ons: the mixture-of-experts router loss (`router_loss.RouterLoss`) is held as `router` (None without one) and
added by the objective's forward where it calls the model (sft: `CausalLMTokenLoss`); the loop sees only what this
class exposes of it: `needs_real_tokens` (the collator marks padding), `notes` (its start-up line), `prepare_step`
(its routing pass) and `pop_token_stats` (its `aux_loss`, per trained token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hftrain.attention import VARLEN
from hftrain.compat.transformers import attn_implementation
from hftrain.data import IGNORE_INDEX
from hftrain.model import HEAD_ONLY_MODEL_TYPES, WrapsCausalLM
from hftrain.router_loss import RouterLoss


class ObjectiveLoss(WrapsCausalLM):
    """The loss module contract the loop calls (see the module's doc); subclasses implement `forward`,
    `loss_units`, `eval_metrics` and, if they have statistics, `pop_stats`."""

    unit = "tokens"  # what the summed loss is normalised by
    examples_name = "samples"  # what one example of the data is called in throughput metrics (samples_per_second)
    headline = ("loss",)  # the logged metrics the progress display and the closing line show

    def __init__(self, lm: nn.Module, router: RouterLoss | None = None):
        super().__init__()
        self.lm = lm
        self.router = router  # a plain object: no parameters, no state dict entries
        # a decoder whose logits the loss computes itself, at the positions it needs (hftrain.model)
        self.head_only = lm.config.model_type in HEAD_ONLY_MODEL_TYPES

    @property
    def loss_path(self) -> str:
        """How the loss reaches the logits, for the start-up line (sft's token loss says more)."""
        return "full logits"

    @property
    def needs_documents(self) -> bool:
        """Whether packed batches must carry their documents' boundaries (data.batching.Collator's
        `mark_documents`): the model attends with hftrain.attention's varlen."""
        return attn_implementation(self.lm.config) == VARLEN

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the micro-batch's summed loss counts (the loop divides the step's sum by their total)."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """The objective's per-unit statistics summed since the last call (the same names on every rank)."""
        return {}

    def forward_shapes(self, batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """(rows, positions) of each forward this loss runs over the micro-batch: what the run counts as processed
        tokens and FLOPs (metrics.RunMeter). The collated batch, padding included: the model runs over all of it."""
        rows, width = batch["input_ids"].shape
        return [(rows, width)]

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        """The evaluation row from the eval set's summed loss, its units and the summed statistics."""
        raise NotImplementedError

    # ----------------------------------------------------------------- what the add-ons show the loop
    @property
    def needs_real_tokens(self) -> bool:
        """Whether batches must mark their real (not padding) tokens: the router loss excludes padding."""
        return self.router is not None

    def notes(self) -> list[str]:
        """The add-ons' start-up lines."""
        return [self.router.note()] if self.router is not None else []

    def prepare_step(self, model: nn.Module, micro_batches: list[dict[str, torch.Tensor]],
                     reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Called by the loop before an optimizer step's micro-batches train, with `model` (this module as the
        parallelism backend prepared it) and `reduce` (a sum over the data-parallel ranks): the router loss's
        routing pass (scope step). An objective that counts the step first (orpo, kto) extends it."""
        if self.router is not None and self.training:
            self.router.prepare_step(model, micro_batches, reduce)

    def pop_token_stats(self) -> dict[str, torch.Tensor]:
        """The add-ons' statistics per trained token summed since the last call (the router loss's aux_loss), the
        same names on every rank; the loop logs each summed over the ranks, divided by the window's trained tokens."""
        return self.router.pop_stats() if self.router is not None else {}
