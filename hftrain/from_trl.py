"""TRL `SFTConfig` / transformers `TrainingArguments` fields in a recipe: mapped when hftrain has their meaning,
refused with what hftrain does instead otherwise. Never ignored.

Most shared concepts already carry the same name as a Recipe field (learning_rate, eval_steps, packing,
eval_strategy, data_seed, ...) and need nothing here. This module covers the names hftrain spells differently
or holds elsewhere (activation_checkpointing, model_init_kwargs, project, fractional warmup_steps), values that
are hftrain's behaviour already (average_tokens_across_devices: true, packing_strategy: bfd), and the fields
with no equivalent, each with its reason. The list was made from TRL 1.16's SFTConfig (135 fields).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PARALLELISM = ("parallelism comes from the accelerate config you launch with (accelerate_configs/, or "
               "launch_preset): DDP, FSDP2, DeepSpeed ZeRO and tensor parallelism are chosen there")
LOADER = "hftrain's data loader is set by dataloader_num_workers and dataloader_pin_memory only"
LOGGING = "hftrain logs every logging_steps optimizer steps and at the first and last step"
EVALUATION = ("hftrain evaluates by eval_strategy / eval_steps and at the end, on the held-out or eval dataset, "
              "and logs eval_loss (a token-weighted mean)")

# Fields refused whatever their value, with the reason.
REFUSED: dict[str, str] = {
    **dict.fromkeys(("fsdp", "fsdp_config", "deepspeed", "accelerator_config", "parallelism_config", "ddp_backend",
                     "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
                     "local_rank", "use_cpu"), PARALLELISM),
    "hub_always_push": "hftrain's push_to_hub (Trainer's hub_* fields) skips a save whose previous upload is still "
                       "running, as Trainer does without hub_always_push, and pushes again at the next save",
    **dict.fromkeys(("dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataloader_multiprocessing_context", "remove_unused_columns", "label_names",
                     "length_column_name"), LOADER),
    **dict.fromkeys(("log_level", "log_level_replica", "log_on_each_node", "trackio_space_id", "trackio_bucket_id",
                     "trackio_static_space_id", "skip_memory_metrics", "debug"), LOGGING),
    **dict.fromkeys(("eval_delay", "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
                     "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "bf16_full_eval",
                     "fp16_full_eval", "eval_packing"), EVALUATION),
    **dict.fromkeys(("load_best_model_at_end", "metric_for_best_model", "greater_is_better"),
                    "hftrain keeps the final model; every evaluation's eval_loss is in metrics.jsonl and checkpoints "
                    "are kept by save_strategy / save_steps / save_total_limit, so pick the best one from those"),
    "save_only_model": "hftrain checkpoints always hold the optimizer, scheduler and data position, so a resumed "
                       "run continues exactly; output_dir/final holds the model alone",
    "save_on_each_node": "hftrain saves once, from the main process, to a shared output_dir",
    "enable_jit_checkpoint": "hftrain saves a checkpoint by itself when SIGTERM, SIGINT or SIGUSR1 asks it to stop",
    "restore_callback_states_from_checkpoint": "hftrain has no callbacks; a checkpoint restores the whole run state",
    "ignore_data_skip": "hftrain resumes at the exact micro-batch, without replaying the data before it",
    "auto_find_batch_size": "hftrain checks memory before loading (python -m hftrain.estimate) instead of retrying",
    "full_determinism": "hftrain seeds data order and dropout from seed/data_seed; full determinism of kernels is "
                        "PyTorch's (torch.use_deterministic_algorithms)",
    "tf32": "hftrain leaves TF32 at PyTorch's default",
    "torch_compile_backend": "hftrain compiles each decoder block with torch.compile's default backend "
                             "(torch_compile, torch_compile_mode)",
    "torch_empty_cache_steps": "hftrain has no periodic CUDA cache emptying",
    "liger_kernel_config": "hftrain's use_liger_kernel is the fused linear cross-entropy only",
    "optim_target_modules": "hftrain's optimizers (optim) take every trainable parameter",
    "optim_args": "hftrain's optimizers take their settings from the recipe (adam_beta1/2, adam_epsilon, "
                  "weight_decay, sgd_momentum)",
    "neftune_noise_alpha": "hftrain does not add NEFTune embedding noise",
    "activation_offloading": "hftrain does not offload activations; use gradient_checkpointing",
    "use_cache": "hftrain always trains without the KV cache",
    "dataset_kwargs": "hftrain tokenizes every dataset itself (skip_prepare_dataset has no equivalent); see "
                      "docs/data.md",
    "eos_token": "hftrain uses the tokenizer's EOS token; change it in the tokenizer or the chat template",
    "pad_token": "hftrain uses the tokenizer's pad token (EOS when it has none); padding is never trained",
    "pad_to_multiple_of": "hftrain pads each micro-batch to its longest row",
    "padding_free": "use packing: true (hftrain keeps packed examples apart by position_ids, which is "
                    "padding-free attention)",
    "dataloader_drop_last": "hftrain never drops examples: an epoch's last optimizer step is shorter",
    "dataset_test_split": "hftrain evaluates on eval_dataset_name (its split: eval_split) or on a fixed-seed "
                          "carve-out of the training set (validation_split_percentage); for TRL's behaviour set "
                          "eval_dataset_name to the dataset_name and eval_split to this split",
    "lora_target_parameters": "hftrain adapts the layers named in lora_target_modules (all-linear also adapts a "
                              "mixture of experts' fused expert weights); parameter-level targets are not exposed",
}


def _only(expected: Any, reason: str) -> Callable[[Any], dict[str, Any]]:
    """A field whose accepted value is hftrain's own behaviour: nothing to set; any other value is refused."""

    def check(value: Any) -> dict[str, Any]:
        if value != expected and not (expected is None and value in ({}, [])):
            raise ValueError(reason)
        return {}

    return check


def _checkpointing_kwargs(value: Any) -> dict[str, Any]:
    if value not in (None, {}) and dict(value) != {"use_reentrant": False}:
        raise ValueError("hftrain checkpoints with use_reentrant=False and nothing else; remove the field")
    return {}


def _model_init_kwargs(value: Any) -> dict[str, Any]:
    """from_pretrained arguments hftrain has as recipe fields; the rest would be dropped, so they are refused."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping of from_pretrained arguments, got {value!r}")
    names = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
             "revision": "model_revision", "trust_remote_code": "trust_remote_code",
             "output_router_logits": "router_aux_loss_coef"}
    reasons = {
        "device_map": "hftrain places the model by its parallelism strategy",
        "quantization_config": "use load_in_4bit / load_in_8bit with the bnb_4bit_* fields",
        "use_cache": "hftrain always trains without the KV cache",
    }
    out, refused = {}, []
    for key, item in value.items():
        if key in names:
            if names[key] == "dtype" and item == "auto":
                refused.append("dtype 'auto' (hftrain loads in an explicit dtype: float32, bfloat16 or float16)")
            elif key == "output_router_logits":
                out.update(MAPPED[key](item))
            else:
                out[names[key]] = str(item).removeprefix("torch.") if names[key] == "dtype" else item
        else:
            refused.append(f"{key!r} ({reasons.get(key, 'not a setting hftrain passes to from_pretrained')})")
    if refused:
        raise ValueError(f"hftrain maps dtype/torch_dtype, attn_implementation, revision, trust_remote_code and "
                         f"output_router_logits; "
                         f"refused: {'; '.join(refused)}")
    return out


def _loss_type(value: Any) -> dict[str, Any]:
    """SFTConfig's loss_type nll is hftrain's sft loss (nothing to set); DPOConfig's, GRPOConfig's and KTOConfig's
    values are the recipe's own."""
    if value == "nll":
        return {}
    if value in ("sigmoid", "ipo", "hinge", "dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "kto",
                 "apo_zero_unpaired"):
        return {"loss_type": value}
    raise ValueError("hftrain's sft loss is the negative log-likelihood (nll) of the trained tokens, its dpo "
                     "losses are sigmoid, ipo and hinge, its grpo losses dapo, grpo, bnpo, dr_grpo, cispo and sapo "
                     "(TRL's luspo and vespo are not written), its kto "
                     "losses kto and apo_zero_unpaired")


# Fields translated into Recipe fields (a function of the value; ValueError names why a value is refused).
MAPPED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "activation_checkpointing": lambda v: {"gradient_checkpointing": v},
    "activation_checkpointing_kwargs": _checkpointing_kwargs,
    "gradient_checkpointing_kwargs": _checkpointing_kwargs,
    "model_init_kwargs": _model_init_kwargs,
    "project": lambda v: {"project_name": v},
    # transformers' model-config switch for the router loss: hftrain adds it whenever router_aux_loss_coef != 0
    "output_router_logits": lambda v: {} if v else {"router_aux_loss_coef": 0.0},
    "shuffle_dataset": lambda v: {"train_sampling_strategy": "random"} if v else {},
    "average_tokens_across_devices": _only(True, "hftrain always divides by the number of trained tokens of the "
                                                 "whole step, across micro-batches and processes"),
    "logging_strategy": _only("steps", LOGGING),
    "logging_first_step": _only(True, LOGGING),
    "logging_nan_inf_filter": _only(True, "hftrain skips a step with a non-finite loss by nan_policy and counts "
                                          "it in nan_skipped_steps"),
    "include_num_input_tokens_seen": lambda v: {},  # hftrain always logs trained_tokens, the count TRL means
    # Informational in TrainingArguments (the Trainer reads none of them; do_eval follows eval_strategy).
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), lambda v: {}),
    "eval_on_start": _only(False, EVALUATION),
    "label_smoothing_factor": _only(0.0, "hftrain's loss is plain token cross-entropy"),
    "loss_type": _loss_type,
    "packing_strategy": _only("bfd", "hftrain packs whole examples best-fit decreasing (bfd) and never splits one "
                                     "across rows"),
    "truncation_mode": _only("keep_start", "hftrain keeps the start (overlong_examples: truncate ends on the last "
                                           "complete turn) or drops the example (overlong_examples: drop)"),
    "lr_scheduler_kwargs": _only(None, "hftrain's schedules (lr_scheduler_type) take no extra arguments"),
    "dataloader_in_order": _only(True, "hftrain's data order is fixed by train_sampling_strategy and data_seed"),
    # TRL's CLI (ModelConfig / ScriptArguments)
    "lora_modules_to_save": lambda v: {"modules_to_save": v} if v else {},
    "use_bnb_nested_quant": lambda v: {"bnb_4bit_use_double_quant": v},
    "lora_task_type": _only("CAUSAL_LM", "hftrain trains causal language models (lora_task_type CAUSAL_LM)"),
    "dataset_streaming": _only(False, "hftrain tokenizes and caches the whole dataset before training (a mixture's "
                                      "weights and the epoch's order need its size); max_samples takes a part of it"),
    "ignore_bias_buffers": _only(False, "hftrain's DDP wrapper never broadcasts buffers, which is what TRL's "
                                        "workaround for boolean mask buffers switches off"),
}


def translate(values: dict[str, Any], fields: dict) -> tuple[dict[str, Any], list[str]]:
    """(recipe values with TRL names mapped, a problem per refused field or contradiction).

    A fractional `warmup_steps` (transformers 5 reads values below 1 as a ratio of the total steps) becomes
    warmup_ratio. A mapped value that contradicts a recipe field set to something else is a problem, not a choice.
    """
    out = {k: v for k, v in values.items() if k in fields and k not in MAPPED}
    problems = []
    warmup = out.get("warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1:
        out["warmup_ratio"] = out.pop("warmup_steps")
    for key, value in values.items():
        if key in out or key == "warmup_steps":
            continue
        if key in REFUSED:
            problems.append(f"{key} (a TRL/TrainingArguments field) is not accepted: {REFUSED[key]}")
        elif key in MAPPED:
            try:
                mapped = MAPPED[key](value)
            except ValueError as exc:
                problems.append(f"{key}={value!r} (a TRL/TrainingArguments field) is not accepted: {exc}")
                continue
            for name, item in mapped.items():
                if name in values and values[name] != item:
                    problems.append(f"{key} sets {name}={item!r} but the recipe also sets {name}={values[name]!r}; "
                                    "keep one")
                out[name] = item
        else:
            out[key] = value  # unknown: the caller reports it with a did-you-mean
    return out, problems
