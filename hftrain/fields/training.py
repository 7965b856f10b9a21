"""The training group: steps, batches, the optimizer and its schedule, precision, seeds, what a NaN does, and the
rules judged from the recipe alone (`problems`)."""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW: state exp_avg, exp_avg_sq
OPTIMIZERS = (*TORCH_ADAMW, "sgd", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "muon")


@dataclass
class TrainingFields:
    output_dir: str = _f("outputs/tiny-chat", "Where checkpoints, metrics.jsonl and the final model go (relative: to "
                         "the current folder).",
                         group="training")
    overwrite_output_dir: bool = _f(
        False, "Allow training into an output_dir that already holds another run (its files are replaced).",
        group="training",
    )
    max_steps: int = _f(-1, "Total optimizer steps; > 0 overrides num_train_epochs.", group="training")
    num_train_epochs: float = _f(1.0, "Epochs to train when max_steps <= 0 (fractions allowed).", group="training")
    per_device_train_batch_size: int = _f(8, "Examples per process per micro-batch.", group="training")
    per_device_eval_batch_size: int = _f(8, "Examples per process per evaluation batch.", group="training")
    gradient_accumulation_steps: int = _f(
        1, "Micro-batches per optimizer step. Effective batch = per_device x processes x this.", group="training"
    )
    learning_rate: float = _f(5e-5, "Peak learning rate.", group="training")
    scale_lr: str = _f(
        "none", "Scale learning_rate with the effective batch (per_device x processes x accumulation): linear "
        "(x effective/base_batch_size, Goyal et al.), sqrt (x its square root, common for Adam) or none. The scaled "
        "value is printed at start, recorded in hftrain_state.json (lr_scaling) and logged as learning_rate; a "
        "resume follows the resumed run's effective batch.", group="training", choices=("none", "linear", "sqrt"),
    )
    base_batch_size: int | None = _f(
        None, "The effective batch, in examples, that learning_rate was tuned for (needed by scale_lr linear/sqrt).",
        group="training",
    )
    lr_scheduler_type: str = _f(
        "linear", "Schedule after warmup.", group="training",
        choices=("constant", "constant_with_warmup", "linear", "cosine"),
    )
    warmup_steps: int = _f(0, "Linear warmup length in optimizer steps (excludes warmup_ratio).", group="training")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of total steps (excludes warmup_steps).", group="training")
    weight_decay: float = _f(0.0, "Decoupled weight decay (AdamW); not applied to biases and norms.",
                             group="training")
    adam_beta1: float = _f(0.9, "AdamW beta1.", group="training")
    adam_beta2: float = _f(0.999, "AdamW beta2.", group="training")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.", group="training")
    sgd_momentum: float = _f(0.0, "Momentum for optim: sgd (0 = plain SGD).", group="training")
    router_aux_loss_coef: float | None = _f(
        None, "Mixture-of-experts models: weight of the router load-balancing loss added to the training loss, "
        "as TRL's SFTTrainer does (its name). Default: the model config's own coefficient (0.001 for Mixtral and "
        "Qwen3-MoE); 0 turns it off. Logged as aux_loss; evaluation reports the token cross-entropy alone.",
        group="training",
    )
    router_aux_loss_scope: str = _f(
        "micro_batch", "Mixture-of-experts models: what the router load-balancing loss averages over. micro_batch: "
        "each micro-batch's own aux, weighted by its trained tokens (as HF's Trainer; splitting a batch changes the "
        "aux slightly, it is a product of two batch means). step: exactly the aux of the whole optimizer step over "
        "all micro-batches and data-parallel ranks (k micro-batches of b on n ranks equal one batch of k*n*b), at "
        "the cost of one extra no-grad forward per micro-batch (a routing pass before the step trains).",
        group="training", choices=("micro_batch", "step"),
    )
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.",
                              group="training")
    optim: str = _f(
        "adamw_torch",
        "Optimizer: adamw_torch, adamw_torch_fused (the same AdamW as one fused kernel per parameter group, CPU and "
        "CUDA), sgd, or bitsandbytes adamw_bnb_8bit / paged_adamw_8bit / paged_adamw_32bit "
        "(8-bit optimizer state for tensors of 4096+ elements, 32-bit below; 'paged' only pages on CUDA), or muon: "
        "torch.optim.Muon on the hidden 2-D weight matrices and torch AdamW on the embeddings, the head, norms and "
        "biases, at the one learning_rate and weight_decay (Moonlight's recipe; the muon_* fields, docs/muon.md).",
        group="training", choices=OPTIMIZERS,
    )
    train_sampling_strategy: str = _f(
        "random", "random: shuffled each epoch from `seed`; sequential: the dataset's own order; group_by_length: "
        "shuffled, then rows of similar length share an optimizer step (windows of 50 global batches sorted by "
        "length, batch order shuffled), so right padding wastes little compute when packing is off.",
        group="training", choices=("random", "sequential", "group_by_length"),
    )
    seed: int = _f(42, "Seed for model-independent randomness (data order, dropout).", group="training")
    data_seed: int | None = _f(
        None, "Seed of the data alone (order, eval hold-out, mixture sampling), as TRL's data_seed; default: seed.",
        group="training",
    )
    nan_policy: str = _f(
        "stop", "A step whose loss or gradient norm is NaN/inf: stop (checkpoint of the last good step, clear error) "
        "or skip_step (no update, counted in nan_skipped_steps).", group="training", choices=("stop", "skip_step"),
    )
    ddp_timeout: int = _f(
        1800, "Seconds a rank waits in a collective (e.g. while rank 0 tokenizes a large dataset) before failing.",
        group="training",
    )
    bf16: bool = _f(False, "bfloat16 mixed precision (CPU and GPU).", group="training")
    fp16: bool = _f(False, "float16 mixed precision with loss scaling (CUDA only).", group="training")


def problems(r) -> list[str]:
    """The training fields' values and combinations."""
    problems = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    need(r.max_steps > 0 or r.num_train_epochs > 0, "set max_steps > 0 or num_train_epochs > 0 (both are off)")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        need(getattr(r, name) >= 1, f"{name} must be >= 1, got {getattr(r, name)}")
    need(r.learning_rate > 0, f"learning_rate must be > 0, got {r.learning_rate}")
    need(r.scale_lr == "none" or (r.base_batch_size or 0) >= 1, f"scale_lr={r.scale_lr} scales learning_rate "
         f"from the batch it was tuned for: set base_batch_size (>= 1 examples), got {r.base_batch_size}")
    need(r.scale_lr != "none" or r.base_batch_size is None, f"base_batch_size={r.base_batch_size} only applies "
         "with scale_lr linear or sqrt; set scale_lr or remove base_batch_size")
    need(r.warmup_steps >= 0, f"warmup_steps must be >= 0, got {r.warmup_steps}")
    need(0 <= r.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {r.warmup_ratio}")
    need(not (r.warmup_steps > 0 and r.warmup_ratio > 0),
         "warmup_steps and warmup_ratio are both set; keep one (warmup_steps=0 or warmup_ratio=0)")
    need(not (r.lr_scheduler_type == "constant" and (r.warmup_steps > 0 or r.warmup_ratio > 0)),
         "lr_scheduler_type=constant has no warmup; use constant_with_warmup or set warmup to 0")
    need(r.router_aux_loss_coef is None or r.router_aux_loss_coef >= 0,
         f"router_aux_loss_coef must be >= 0 or unset, got {r.router_aux_loss_coef}")
    need(r.router_aux_loss_scope == "micro_batch" or (r.router_aux_loss_coef != 0 and r.objective == "sft"),
         "router_aux_loss_scope=step makes the router load-balancing loss exact over a step, but there is none here "
         f"(router_aux_loss_coef={r.router_aux_loss_coef}, objective={r.objective}; it needs a coefficient > 0 or "
         "the model's own, and objective sft); remove router_aux_loss_scope")
    need(r.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0 disables clipping), got {r.max_grad_norm}")
    need(r.weight_decay >= 0, f"weight_decay must be >= 0, got {r.weight_decay}")
    need(0 <= r.adam_beta1 < 1 and 0 <= r.adam_beta2 < 1, "adam_beta1 and adam_beta2 must be in [0, 1)")
    need(r.adam_epsilon > 0, f"adam_epsilon must be > 0, got {r.adam_epsilon}")
    need(r.sgd_momentum >= 0, f"sgd_momentum must be >= 0, got {r.sgd_momentum}")
    need(not (r.sgd_momentum > 0 and r.optim != "sgd"), "sgd_momentum is set but optim is not sgd")
    need(r.ddp_timeout >= 1, f"ddp_timeout must be >= 1 second, got {r.ddp_timeout}")
    need(not (r.bf16 and r.fp16), "bf16 and fp16 are both true; choose one")
    need(not (r.packing and r.train_sampling_strategy == "group_by_length"),
         "train_sampling_strategy=group_by_length with packing=true has nothing to group: packed rows all hold close "
         "to max_length tokens; use random with packing, or turn packing off")
    return problems
