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

from hftrain.compat.deepspeed import whole_ndim
from hftrain.config import Recipe
from hftrain.fields.muon import WHOLE_MATRICES

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
    if recipe.optim == "muon":
        return MuonWithAdamW(recipe, model, learning_rate)
    groups = decay_groups(recipe, params, allow_empty)
    adam = adamw_settings(recipe, learning_rate)
    if recipe.optim == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate, momentum=recipe.sgd_momentum)
    if recipe.optim in BNB_ADAMW:
        import bitsandbytes as bnb

        bits, paged = BNB_ADAMW[recipe.optim]
        return bnb.optim.AdamW(groups, **adam, optim_bits=bits, is_paged=paged)
    # fused=None (not False) for adamw_torch: torch then keeps its own default (foreach on CUDA)
    return torch.optim.AdamW(groups, **adam, fused=True if recipe.optim == "adamw_torch_fused" else None)


def decay_groups(recipe: Recipe, params: list[nn.Parameter], allow_empty: bool = False) -> list[dict]:
    """Weight decay on matrices (ndim >= 2), none on biases and norm weights; empty groups left out. The dimensions
    are those of the whole parameter: ZeRO-3 loads the model partitioned, each parameter's `.data` an empty 1-D
    tensor, which would put every matrix among the undecayed."""
    matrix = [whole_ndim(p) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix, strict=True) if m], "weight_decay": recipe.weight_decay},
        {"params": [p for p, m in zip(params, matrix, strict=True) if not m], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]] or (groups[1:] if allow_empty else [])


def adamw_settings(recipe: Recipe, learning_rate: float) -> dict:
    return {"lr": learning_rate, "betas": (recipe.adam_beta1, recipe.adam_beta2), "eps": recipe.adam_epsilon}


HEAD_NAMES = ("score", "classifier")  # transformers' sequence-classification heads (get_output_embeddings: None)


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trained parameters of `model` for Muon (the hidden 2-D weight matrices) and for AdamW (the rest): every
    nn.Embedding's weight, the output head of each transformers model inside (`get_output_embeddings()`, or its
    `score` / `classifier` classification head), and every parameter that is not 2-D (norms, biases, 3-D fused
    experts, convolutions) go to AdamW, as Muon's authors and Moonlight do. A tied head is the embedding itself."""
    outside = set()
    for module in model.modules():
        heads = [module] if isinstance(module, nn.Embedding) else []
        if hasattr(module, "get_output_embeddings") and hasattr(module, "get_input_embeddings"):
            heads += [module.get_output_embeddings(), *(getattr(module, name, None) for name in HEAD_NAMES)]
        outside |= {id(p) for head in heads if isinstance(head, nn.Module) for p in head.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in params if p.ndim == 2 and id(p) not in outside]
    chosen = {id(p) for p in hidden}
    return hidden, [p for p in params if id(p) not in chosen]


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the other parameters (`muon_split`), as one
    optimizer: its param_groups are the two optimizers' own group dicts (Muon's first), so the schedule sets the
    learning rate of both, and its state is theirs (one dict, the parameters disjoint), so one state_dict holds both
    optimizers' states and a checkpoint restores them together.

    Moonlight's recipe ('Muon is Scalable for LLM Training'): one learning rate and weight decay for both, Muon's update
    of an A x B matrix scaled by 0.2 x sqrt(max(A, B)) (adjust_lr_fn match_rms_adamw) so that its RMS matches AdamW's.
    Weight decay as hftrain's AdamW: on every matrix (Muon's included), not on norms and biases."""

    def __init__(self, recipe: Recipe, model: nn.Module, learning_rate: float) -> None:
        hidden, rest = muon_split(model)
        self.parts: list[torch.optim.Optimizer] = []
        if hidden:
            self.parts.append(torch.optim.Muon(
                hidden, lr=learning_rate, weight_decay=recipe.weight_decay, momentum=recipe.muon_momentum,
                nesterov=recipe.muon_nesterov, ns_steps=recipe.muon_ns_steps, adjust_lr_fn=recipe.muon_adjust_lr))
        if rest:
            self.parts.append(torch.optim.AdamW(decay_groups(recipe, rest), **adamw_settings(recipe, learning_rate)))
        self.split = (sum(p.numel() for p in hidden), len(hidden), sum(p.numel() for p in rest), len(rest))
        super().__init__([group for part in self.parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point the two optimizers at this one's group dicts and state (after construction and after a load)."""
        start = 0
        for part in self.parts:
            part.param_groups = self.param_groups[start:start + len(part.param_groups)]
            part.state = self.state
            start += len(part.param_groups)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces this optimizer's group dicts and state
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def describe(self) -> str:
        """The start-up line: which parameters each optimizer trains."""
        muon_elements, matrices, adamw_elements, tensors = self.split
        rest = (f"AdamW on {tensors} other tensors ({adamw_elements:,} parameters: embeddings, head, norms, biases)"
                if tensors else "nothing trained left for AdamW")
        return f"optim muon: torch.optim.Muon on {matrices} hidden matrices ({muon_elements:,} parameters), {rest}"


def optimizer_notes(optimizer: torch.optim.Optimizer) -> list[str]:
    """Start-up lines about the optimizer built (none for a single torch or bitsandbytes optimizer)."""
    return [optimizer.describe()] if isinstance(optimizer, MuonWithAdamW) else []


def muon_launch_problems(recipe: Recipe, kind: str, zero_stage: int | None) -> list[str]:
    """optim: muon under a launch whose processes hold shards of the weight matrices (the preflight's check)."""
    if recipe.optim != "muon":
        return []
    sharding = {"fsdp2": "FSDP2 shards every parameter over the processes",
                "deepspeed": f"DeepSpeed ZeRO-{zero_stage} flattens the parameters and partitions them (and the "
                "optimizer's work) over the processes"}.get(kind)
    return [] if sharding is None else [f"optim: muon with {kind} is refused ({sharding}): {WHOLE_MATRICES}"]


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
