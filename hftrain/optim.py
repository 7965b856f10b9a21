"""Optimizer and learning-rate schedule builders.

Schedules are functions of the optimizer step n = 1..total (never of micro-batches or ranks):
warmup rises linearly to the peak at step `warmup` (step 1 already trains, at peak/warmup), then
`linear` / `cosine` decay towards 0 without reaching it at the last step, `constant_with_warmup`
stays at the peak. The scheduler is stepped by the loop once per optimizer step and is not passed
through `accelerator.prepare` (whose wrapper would step it once per process).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hftrain.config import Recipe

BNB_ADAMW = {"adamw_bnb_8bit": (8, False), "paged_adamw_8bit": (8, True), "paged_adamw_32bit": (32, True)}


def build_optimizer(recipe: Recipe, model: nn.Module, learning_rate: float | None = None,
                    allow_empty: bool = False) -> torch.optim.Optimizer:
    """AdamW (torch's for-each or fused implementation) or SGD, with weight decay on matrices only (never on
    biases and norm weights), or bitsandbytes AdamW; at `learning_rate` (the scaled one) or the recipe's.
    `allow_empty`: a model part without trained parameters (a pipeline stage whose layers hold no adapter) gets an
    optimizer of one empty group, which steps nothing but carries the learning rate the schedule sets.

    bitsandbytes AdamW (as transformers' `adamw_bnb_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`) keeps 8-bit
    optimizer state for tensors of 4096+ elements and 32-bit state for smaller ones; paging needs CUDA and is a
    no-op elsewhere.
    """
    learning_rate = recipe.learning_rate if learning_rate is None else learning_rate
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]] or (groups[1:] if allow_empty else [])
    adam = {"lr": learning_rate, "betas": (recipe.adam_beta1, recipe.adam_beta2), "eps": recipe.adam_epsilon}
    if recipe.optim == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate, momentum=recipe.sgd_momentum)
    if recipe.optim in BNB_ADAMW:
        import bitsandbytes as bnb

        bits, paged = BNB_ADAMW[recipe.optim]
        return bnb.optim.AdamW(groups, **adam, optim_bits=bits, is_paged=paged)
    # fused=None (not False) for adamw_torch: torch then keeps its own default (foreach on CUDA)
    return torch.optim.AdamW(groups, **adam, fused=True if recipe.optim == "adamw_torch_fused" else None)


def scaled_learning_rate(recipe: Recipe, effective_batch_size: int) -> tuple[float, dict | None]:
    """The peak learning rate for this effective batch (`scale_lr`), and the record of the scaling (None: none)."""
    if recipe.scale_lr == "none":
        return recipe.learning_rate, None
    ratio = effective_batch_size / recipe.base_batch_size
    factor = ratio if recipe.scale_lr == "linear" else math.sqrt(ratio)
    learning_rate = recipe.learning_rate * factor
    return learning_rate, {"rule": recipe.scale_lr, "base_batch_size": recipe.base_batch_size,
                           "effective_batch_size": effective_batch_size, "base_learning_rate": recipe.learning_rate,
                           "factor": factor, "learning_rate": learning_rate}


def set_peak_learning_rate(scheduler, learning_rate: float) -> None:
    """After a resume: the restored schedule continues at its step with this run's peak learning rate (the
    checkpoint's scheduler and optimizer states carry the peak of the run that saved them)."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * lr_lambda(scheduler.last_epoch)


def lr_factor(kind: str, step: int, total: int, warmup: int) -> float:
    """Multiplier of the peak learning rate used by optimizer step `step` (1-based)."""
    if step <= warmup:
        return step / warmup
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup - 1) / max(1, total - warmup)  # 0 at the first decay step, < 1 at the last
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def stepping_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose param groups the update reads, inside accelerate's and DeepSpeed's wrappers.

    The schedule must write its learning rates there: under ZeRO offload accelerate replaces the client AdamW with
    DeepSpeedCPUAdam (built on the same param-group dicts, until loading a checkpoint gives it new ones), and a
    schedule made on the AdamW would then go on writing into dicts nothing reads."""
    inner, candidate = optimizer, optimizer
    while candidate is not None:
        if isinstance(candidate, torch.optim.Optimizer):
            inner = candidate
        candidate = getattr(candidate, "optimizer", None)
    return inner


def build_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer, total_steps: int):
    """The learning-rate schedule over the innermost optimizer of `optimizer` (call it on the prepared one)."""
    optimizer = stepping_optimizer(optimizer)
    warmup = recipe.warmup_for(total_steps)
    # LambdaLR calls the function with 0 for the first optimizer step.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: lr_factor(recipe.lr_scheduler_type, index + 1, total_steps, warmup)
    )
