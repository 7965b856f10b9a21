"""The mixture-of-experts router load-balancing loss: an add-on an objective's loss module composes onto its own
loss (`loss.ObjectiveLoss`'s `router`), not a part of any one objective. The loop sees only its metric (`aux_loss`,
per trained token, through `ObjectiveLoss.pop_token_stats`) and its start-up line.

The model's load-balancing loss is added in training, over real tokens only (`real_tokens`: padding excluded, packed
examples counted token by token). `router_aux_loss_scope`:
- `micro_batch` (HF Trainer's way): the model's own `load_balancing_loss_func` of each micro-batch, weighted by its
  trained tokens: the step loss is the token cross-entropy plus coef x the token-weighted mean of the micro-batches'
  aux losses, HF's `outputs.loss` for a step of one micro-batch.
- `step`: the aux of the whole optimizer step, all micro-batches and data-parallel ranks as one batch. The aux
  experts x sum_e f_e x P_e has its gradient through P_e (mean router probability) only, and f_e (share of top-k
  assignments) is fixed by the routing: `prepare_step` takes the step's f_e in one no-grad routing pass, then each
  micro-batch adds experts x sum_e f_e x (its probability sums / the step's slots), which sum to the step's aux
  exactly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hftrain.errors import HftrainError
from hftrain.model import router_coefficient


def router_aux(lm: nn.Module, coef: float | None):
    """(coefficient, aux(router_logits, real_tokens), experts, top_k) of a mixture-of-experts model's load-balancing
    loss (`router_coefficient`); (0.0, None, 0, 0) for a dense model."""
    hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    used = router_coefficient(hf.config, coef)
    if used is None:
        if coef:
            raise HftrainError(f"router_aux_loss_coef={coef} is set but {type(hf).__name__} is not a "
                               "mixture-of-experts model with a router loss; remove router_aux_loss_coef")
        return 0.0, None, 0, 0
    family = next(c for c in type(hf).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the loaded class
    balance = importlib.import_module(family.__module__).load_balancing_loss_func
    experts, top_k = hf.num_experts, hf.num_experts_per_tok
    return (used, lambda router_logits, real_tokens: balance(router_logits, experts, top_k, real_tokens),
            experts, top_k)


def routing_statistics(router_logits: tuple[torch.Tensor, ...], real_tokens: torch.Tensor | None,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k assignments per expert, router probability sums per expert, routed (layer, token) slots) over every
    layer's real tokens, summed as transformers' `load_balancing_loss_func` sums them: its aux is
    experts x sum_e (assignments_e / slots) x (probability_e / slots). Assignments carry no gradient."""
    counts = probs = slots = 0
    for layer in router_logits:
        weights = layer.softmax(dim=-1)
        chosen = F.one_hot(weights.topk(top_k, dim=-1).indices, weights.shape[-1]).sum(dim=1).float()
        real = torch.ones_like(chosen[:, :1]) if real_tokens is None else real_tokens.reshape(-1, 1).float()
        counts = counts + (chosen * real).sum(dim=0)
        probs = probs + (weights.float() * real).sum(dim=0)
        slots = slots + real.sum()
    return counts.detach(), probs, slots


class RouterLoss:
    """The router loss of one mixture-of-experts model (`router_loss` builds it, or says there is none).

    A loss module that composes it asks the model for its router logits in training (`model_kwargs`), adds
    `add(loss, ...)` to its own micro-batch loss, and in `prepare_step` lets it run the step's routing pass, during
    which its forward returns `routing_counts` instead of a loss (`routing_pass`)."""

    def __init__(self, coef: float, aux_fn: Callable, experts: int, top_k: int, scope: str, device: torch.device):
        self.coef, self.aux_fn, self.experts, self.top_k, self.scope = coef, aux_fn, experts, top_k, scope
        self.device = device  # where a rank that routed no real token puts its zero (every rank sums one)
        self.step_routing = None  # scope step: [assignments per expert..., slots, trained tokens] of the whole step
        self.routing_pass = False  # True during `prepare_step`: the loss's forward returns `routing_counts`
        self.aux_sum = None  # detached sum of aux x trained tokens since the last `pop_stats`

    model_kwargs = {"output_router_logits": True}  # what the model must be asked for in training

    def add(self, loss: torch.Tensor, router_logits: tuple[torch.Tensor, ...], real_tokens: torch.Tensor | None,
            tokens: torch.Tensor) -> torch.Tensor:
        """`loss` plus coef x this micro-batch's aux term x the tokens the loop divides by; an all-padding filler
        row has no routing and adds nothing."""
        if real_tokens is not None and not real_tokens.any():
            return loss
        return loss + self.coef * self._aux(router_logits, real_tokens, tokens)

    def _aux(self, router_logits: tuple[torch.Tensor, ...], real_tokens: torch.Tensor | None,
             tokens: torch.Tensor) -> torch.Tensor:
        """This micro-batch's aux term times the tokens the loop divides by (its own trained tokens for scope
        micro_batch; the step's for scope step, whose terms sum to the step's aux)."""
        if self.scope == "micro_batch":
            aux = self.aux_fn(router_logits, real_tokens) * tokens
        else:
            if self.step_routing is None:
                raise HftrainError("router_aux_loss_scope: step needs the step's routing (prepare_step) before the "
                                   "micro-batches train")
            counts, slots, step_tokens = self.step_routing[:-2], self.step_routing[-2], self.step_routing[-1]
            _, probs, _ = routing_statistics(router_logits, real_tokens, self.top_k)
            share = (counts / slots.clamp(min=1)).to(probs.dtype) * probs / slots.clamp(min=1).to(probs.dtype)
            aux = self.experts * share.sum() * step_tokens.to(probs.dtype)
        self.aux_sum = aux.detach() + (0 if self.aux_sum is None else self.aux_sum)
        return aux

    def routing_counts(self, router_logits: tuple[torch.Tensor, ...], real_tokens: torch.Tensor | None,
                       trained: torch.Tensor) -> torch.Tensor:
        """What the routing pass returns for one micro-batch: assignments per expert, routed slots, trained tokens."""
        counts, _, slots = routing_statistics(router_logits, real_tokens, self.top_k)
        return torch.cat([counts.double(), torch.stack([torch.as_tensor(slots).double(), trained.sum().double()])])

    def prepare_step(self, model: nn.Module, micro_batches: list[dict[str, torch.Tensor]],
                     reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Before an optimizer step's micro-batches train. Scope step: one no-grad routing pass over them through
        `model` (the loss module as the parallelism backend prepared it), with the random state restored after it
        so that the training forwards route the same way; `reduce` sums over the data-parallel ranks."""
        if self.scope != "step":
            return
        device = micro_batches[0]["input_ids"].device
        self.routing_pass = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                local = sum(model(**batch) for batch in micro_batches)
        finally:
            self.routing_pass = False
        self.step_routing = reduce(local)  # all-reduce: assignments, slots and trained tokens of the whole step

    def note(self) -> str:
        """The start-up line of the router loss."""
        exact = ("exact over the whole step (router_aux_loss_scope step: one extra no-grad forward per micro-batch)"
                 if self.scope == "step" else "per micro-batch as HF's Trainer (router_aux_loss_scope micro_batch)")
        return (f"router load-balancing loss added with coefficient {self.coef} (router_aux_loss_coef; 0 turns "
                f"it off), {exact}, logged as aux_loss")

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """{"aux_loss": the detached sum of aux x trained tokens since the last call}, in float64: the loop sums it
        over the ranks and divides by the trained tokens. A rank that routed no real token gives a zero."""
        aux, self.aux_sum = self.aux_sum, None
        return {"aux_loss": (torch.zeros((), device=self.device) if aux is None else aux).double()}


def router_loss(lm: nn.Module, coef: float | None, scope: str = "micro_batch",
                device: torch.device | None = None) -> RouterLoss | None:
    """The router loss of `lm` with the recipe's `router_aux_loss_coef` (`coef`; None: the model config's) and
    `router_aux_loss_scope`, or None where there is none (a dense model, or coefficient 0). Refused: a coefficient
    for a dense model, scope step without a router loss."""
    used, aux_fn, experts, top_k = router_aux(lm, coef)
    if scope == "step" and used == 0:
        raise HftrainError("router_aux_loss_scope: step makes the router load-balancing loss exact over a step, "
                           f"but {type(lm).__name__} adds none (a dense model, or coefficient 0); remove "
                           "router_aux_loss_scope or set router_aux_loss_coef > 0")
    if used <= 0:
        return None
    return RouterLoss(used, aux_fn, experts, top_k, scope, torch.device("cpu") if device is None else device)
