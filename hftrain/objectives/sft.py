"""Supervised fine-tuning (recipe `objective: sft`): `CausalLMTokenLoss`, the summed cross-entropy of the trained
tokens; the loop divides by the step's trained tokens. A mixture-of-experts model's router loss composes onto it
(`router_loss.RouterLoss`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hftrain.attention import VARLEN
from hftrain.compat.transformers import attn_implementation
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.loss import ObjectiveLoss
from hftrain.model import HEAD_ONLY_MODEL_TYPES, liger_fused_linear_cross_entropy
from hftrain.objectives.base import Objective
from hftrain.router_loss import RouterLoss, router_loss


class CausalLMTokenLoss(ObjectiveLoss):
    """The causal LM's *summed* next-token cross-entropy over the trained tokens.

    The loop divides by the global number of trained tokens of the optimizer step, which makes gradient accumulation
    and data parallelism exact. For known architectures logits are computed only at trained positions (prompt and
    padding positions never need them), in fp32 for a stable softmax, optionally `chunk_tokens` trained tokens at a
    time, or not at all with `fused_cross_entropy` (Liger's fused projection + cross-entropy); any other model takes
    its own full-logits path. With a `router` (a mixture-of-experts model's router loss) its term is added in
    training.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int = 0, fused_cross_entropy: bool = False,
                 router: RouterLoss | None = None):
        super().__init__(lm, router)
        self.chunk_tokens = chunk_tokens  # > 0: logits of this many trained tokens at a time (head-only models)
        # transformers' flash attention tells packed examples apart by their position_ids only in a batch of one
        # row (`_is_packed_sequence`); with more rows it would attend across them. One row of rows x length is exact.
        # varlen takes the documents' boundaries over the flattened micro-batch: one row keeps the compiled blocks'
        # batch dimension at 1 whatever the rows per micro-batch (no recompile when a short last step has fewer).
        self.flatten_packed = str(attn_implementation(lm.config)).startswith(("flash_attention", VARLEN))
        self.fused_ce = None
        if fused_cross_entropy:
            head = lm.get_output_embeddings()
            if not (self.head_only and isinstance(head, nn.Linear)):
                raise HftrainError(
                    f"use_liger_kernel needs a {'/'.join(sorted(HEAD_ONLY_MODEL_TYPES))} model whose output head is a "
                    f"plain Linear layer, got {lm.config.model_type!r} with {type(head).__name__}: the fused loss "
                    "reads the head's weight directly, so an adapter or a trained copy of lm_head would be ignored; "
                    "remove lm_head from lora_target_modules / modules_to_save, or set use_liger_kernel: false"
                )
            self.fused_ce = liger_fused_linear_cross_entropy()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, real_tokens: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, **model_inputs: torch.Tensor) -> torch.Tensor:
        """`position_ids` restarting inside a row mark packed examples (block-diagonal attention); `real_tokens`
        (not padding) is needed only for the router loss. `shift_labels` instead of `labels`: the target of every
        position, already shifted (a sequence-parallel shard, whose last target is the next shard's first token).
        `model_inputs`: whatever else the model takes as it is (an image-text processor's pixel_values,
        attention_mask, image_grid_thw, ...: hftrain.data.image_chats; the packed documents' boundaries for varlen
        attention, cu_seq_lens_q and the rest: data.batching.Collator's `mark_documents`)."""
        targets = labels[:, 1:] if shift_labels is None else shift_labels
        trained = targets != IGNORE_INDEX
        rows = input_ids.shape
        if position_ids is not None and self.flatten_packed:
            input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False, **model_inputs}
        router = self.router if self.training else None
        if router is not None:
            inputs.update(router.model_kwargs)
            if router.routing_pass:  # the same call as below, so that dropout draws the same numbers
                outputs = (self.lm.get_decoder() if self.head_only else self.lm)(**inputs)
                return router.routing_counts(outputs.router_logits, real_tokens, trained)
        if not self.head_only:
            outputs = self.lm(**inputs)
            logits = outputs.logits.reshape(*rows, -1)[:, :targets.shape[1]][trained]
            loss = F.cross_entropy(logits.float(), targets[trained], reduction="sum")
        else:
            outputs = self.lm.get_decoder()(**inputs)
            hidden = outputs.last_hidden_state.reshape(*rows, -1)[:, :targets.shape[1]][trained]
            if not self.chunk_tokens or len(hidden) <= self.chunk_tokens:
                loss = self._head_loss(hidden, targets[trained])
            else:
                chunks = zip(hidden.split(self.chunk_tokens), targets[trained].split(self.chunk_tokens), strict=True)
                loss = sum(torch.utils.checkpoint.checkpoint(self._head_loss, h, t, use_reentrant=False)
                           for h, t in chunks)
        if router is not None:
            loss = router.add(loss, outputs.router_logits, real_tokens, trained.sum())
        return loss

    @property
    def loss_path(self) -> str:
        if self.fused_ce is not None:
            return "Liger fused linear cross-entropy"
        if not self.head_only:
            return "full logits (the model's own head)"
        return f"chunked {self.chunk_tokens} tokens" if self.chunk_tokens else "logits at trained positions"

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        loss = loss_sum / max(units, 1)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(units)}

    def _head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.lm.get_output_embeddings()
        # A micro-batch without trained tokens (an epoch's last step, short of rows; an all-prompt example) takes the
        # plain path: Liger's chunking divides by a chunk size of 0 when it gets no rows (ZeroDivisionError on CUDA).
        if self.fused_ce is not None and len(hidden):
            return self.fused_ce(head.weight, hidden, targets, head.bias)
        logits = head(hidden)
        return F.cross_entropy(logits.float(), targets, reduction="sum")


class SFT(Objective):
    name = "sft"

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> CausalLMTokenLoss:
        return CausalLMTokenLoss(lm, recipe.loss_chunk_tokens, recipe.use_liger_kernel,
                                 router_loss(lm, recipe.router_aux_loss_coef, recipe.router_aux_loss_scope, device))
