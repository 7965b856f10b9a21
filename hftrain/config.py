"""The recipe: one typed schema, YAML presets, CLI overrides and up-front validation.

Field names follow transformers `TrainingArguments`, TRL `SFTConfig` / `ModelConfig` and peft
`LoraConfig` wherever the concept is the same, so a TRL recipe moves over almost unchanged.
Each field's `help` becomes `--help`. `load_recipe` reports every problem at once (unknown keys,
wrong types, bad values, impossible combinations) before any model or dataset is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hftrain import from_trl
from hftrain.errors import ConfigError, first_line
from hftrain.layout import FINAL_DIR, PREFIX

TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW: state exp_avg, exp_avg_sq
OPTIMIZERS = (*TORCH_ADAMW, "sgd", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
DEFAULT_RECIPE_NOTE = "with no --config, the embedded default recipe (tiny offline model, shipped chat data) is used"

# Files shipped inside the package, laid out as in the repository (there, hftrain/shipped/ holds symlinks to the
# top-level folders; a built wheel holds copies), so that an installed hftrain works from any folder.
SHIPPED = Path(__file__).resolve().parent / "shipped"
PRESET_DIR = SHIPPED / "accelerate_configs"  # the launch presets; their deepspeed_config_file is ds_configs/<name>.json
DEFAULT_MODEL = SHIPPED / "models" / "tiny-llama"  # the embedded default: a tiny random Llama (0.16M parameters)
DEFAULT_DATASET = SHIPPED / "data" / "chat.jsonl"  # and the demo chat data


def _f(default: Any, help: str, *, group: str, choices: tuple | None = None, **kw) -> Any:
    """A recipe field: default, help text (shown by --help), group heading, allowed values."""
    meta = {"help": help, "group": group, "choices": choices}
    if isinstance(default, (list, dict)):  # mutable defaults: a fresh copy per Recipe
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _cadence(action: str, every: str, none: str, note: str) -> Any:
    """eval_strategy / save_strategy: TrainingArguments' IntervalStrategy values, documented alike."""
    return _f("steps", f"When to {action} (TrainingArguments' name): steps (every {every} when set), epoch (after "
              f"every epoch) or no ({none}). {note}", group="logging", choices=("steps", "epoch", "no"))


@dataclass
class DatasetSource:
    """One dataset of a mixture."""

    name: str
    config: str | None = None
    split: str = "train"
    weight: float = 1.0
    format: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)


@dataclass
class Recipe:
    # ----------------------------------------------------------------------------- model
    model_name_or_path: str = _f(
        str(DEFAULT_MODEL),
        "Hub model id (org/name) or local folder, loaded with AutoModelForCausalLM.from_pretrained. Default: the tiny "
        "offline model shipped inside hftrain.",
        group="model",
    )
    tokenizer_name_or_path: str | None = _f(
        None, "Tokenizer id or folder; defaults to model_name_or_path.", group="model"
    )
    model_revision: str = _f("main", "Hub revision (branch, tag or commit) of the model.", group="model")
    trust_remote_code: bool = _f(
        False, "Allow model code from the hub repository to run. Off unless you trust the repository.", group="model"
    )
    dtype: str = _f(
        "float32",
        "dtype the weights are loaded in. Keep float32 for mixed-precision training (bf16 autocast keeps "
        "fp32 master weights); bfloat16 halves memory but trains in pure bf16.",
        group="model",
        choices=("float32", "bfloat16", "float16"),
    )
    attn_implementation: str | None = _f(
        None, "Attention kernel: eager, sdpa, flash_attention_2 (CUDA only; needs the flash-attn package: pip install "
        "flash-attn --no-build-isolation). Default: the model's choice. All three keep packed examples apart "
        "(packing: true): transformers' flash attention finds examples from position_ids only in a batch of one row, "
        "so hftrain hands it each packed micro-batch flattened into one row.",
        group="model", choices=(None, "eager", "sdpa", "flash_attention_2"),
    )
    use_liger_kernel: bool = _f(
        False, "Liger's Triton kernels (CUDA only; pip install liger-kernel==0.8.5, or the [cuda] extra): RMSNorm, "
        "SwiGLU/GeGLU and RoPE patched into the loaded model, and the output projection fused with the "
        "cross-entropy (chunked internally, gradients computed in forward), so the logits of a micro-batch are never "
        "materialised in fp32. For the architectures whose logits are lm_head(hidden); excludes loss_chunk_tokens.",
        group="model",
    )
    gradient_checkpointing: bool = _f(
        False, "Recompute activations in backward (non-reentrant) to save memory at ~30% more compute.",
        group="model",
    )
    loss_chunk_tokens: int = _f(
        0, "Compute the output projection and cross-entropy over this many trained tokens at a time, recomputing "
        "each chunk's logits in backward, so that the fp32 logits of a whole micro-batch never exist at once "
        "(they take tokens x vocabulary x 4 bytes, several GB for 100k+ vocabularies). 0: one chunk. Costs one "
        "more output projection per chunk in backward; for the architectures whose logits are lm_head(hidden).",
        group="model",
    )
    torch_compile: bool = _f(
        False, "Compile the model's repeated blocks (each decoder layer) with torch.compile, in place: parameter "
        "names and checkpoints are unchanged. The first steps take longer (compiling; one recompile when sequence "
        "lengths start to vary, after which shapes are dynamic), later steps run faster; worth it for runs of many "
        "steps. CPU needs a C++ compiler (inductor).", group="model",
    )
    torch_compile_mode: str | None = _f(
        None, "torch.compile mode with torch_compile: default, reduce-overhead (CUDA graphs), max-autotune, "
        "max-autotune-no-cudagraphs. Default: torch's default.", group="model",
        choices=(None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    freeze_vision_tower: bool = _f(
        True, "Image-text models: the vision tower gets no gradient (full fine-tuning) and no LoRA adapters "
        "(all-linear). No effect on text models. See docs/vision.md.", group="model",
    )
    freeze_projector: bool = _f(
        True, "Image-text models: the projector between the vision tower and the language model (LLaVA's "
        "multi_modal_projector, Qwen's merger, Idefics3's connector) gets no gradient and no LoRA adapters "
        "(all-linear). No effect on text models.", group="model",
    )
    # ------------------------------------------------------------------------------ data
    dataset_name: str = _f(
        str(DEFAULT_DATASET),
        "Hub dataset id, local data file (.json/.jsonl/.csv/.parquet) or a saved `datasets` folder. Default: the "
        "chat data shipped inside hftrain.",
        group="data",
    )
    dataset_config: str | None = _f(None, "Hub dataset configuration name.", group="data")
    dataset_train_split: str = _f("train", "Split used for training.", group="data")
    eval_dataset_name: str | None = _f(
        None, "Separate eval dataset (same forms as dataset_name). Default: carve-out of the training set.",
        group="data",
    )
    eval_split: str = _f("train", "Split of eval_dataset_name used for evaluation.", group="data")
    validation_split_percentage: float = _f(
        5.0, "Percent of the training set held out for evaluation (fixed seed) when no eval_dataset_name; "
        "0 disables evaluation.", group="data",
    )
    dataset_format: str = _f(
        "auto", "Data format; auto detects it from the columns (see docs/data.md for each format's shape).",
        group="data", choices=("auto", "text", "prompt_completion", "alpaca", "messages", "sharegpt", "preference"),
    )
    dataset_columns: dict[str, str] = _f(
        {}, "Rename columns before format detection, {dataset_column: expected_column}, e.g. {question: prompt}.",
        group="data",
    )
    dataset_mixture: list[DatasetSource] = _f(
        [], "Train on several datasets instead of dataset_name: a list of {name, config, split, weight, columns, "
        "format}; weight 0.5 keeps a fixed-seed half of a dataset, 2.0 repeats it twice.", group="data",
    )
    dataset_text_field: str = _f("text", "Column holding raw text for plain causal-LM data.", group="data")
    dataset_messages_field: str = _f(
        "messages", "Column holding chat messages ({role, content} lists).", group="data"
    )
    chat_template_path: str | None = _f(
        None, "Jinja chat template file to use instead of the tokenizer's. Without either, chat data gets a "
        "ChatML template whose <|im_start|>/<|im_end|> tokens are added (embeddings resized) and <|im_end|> "
        "becomes EOS.", group="data",
    )
    assistant_only_loss: bool = _f(
        True, "For chat data, train on assistant turns only (their end-of-turn token included).", group="data"
    )
    train_on_turns: str = _f(
        "all", "With assistant_only_loss, which assistant turns are trained: all (each in the context the model "
        "sees when it writes it; a template that rewrites earlier turns, e.g. strips past <think> reasoning, "
        "splits a conversation into one example per turn) or last (the final assistant turn only, one example "
        "per conversation). See docs/data.md.", group="data", choices=("all", "last"),
    )
    completion_only_loss: bool = _f(
        True, "For prompt/completion and alpaca data, train on the completion only (EOS included).", group="data"
    )
    max_length: int = _f(512, "Maximum tokens per example (before packing).", group="data")
    overlong_examples: str = _f(
        "truncate", "Examples longer than max_length: truncate (chat: at the last complete assistant turn that "
        "fits, else at max_length) or drop.", group="data", choices=("truncate", "drop"),
    )
    packing: bool = _f(
        False, "Pack examples into rows of max_length tokens (best-fit decreasing), padding-free, with position_ids "
        "restarting per example so no token attends across examples.", group="data",
    )
    max_samples: int | None = _f(None, "Use at most this many training examples (after the eval carve-out).",
                                 group="data")
    dataset_num_proc: int | None = _f(None, "Processes for tokenization (datasets.map num_proc).", group="data")
    dataloader_num_workers: int = _f(0, "Worker processes for batch collation.", group="data")
    dataloader_pin_memory: bool = _f(
        True, "Collate batches into pinned (page-locked) memory so the copy to the GPU can overlap compute "
        "(non_blocking). CUDA only; no effect on CPU.", group="data",
    )
    streaming: bool = _f(
        False, "Stream the training set instead of tokenizing all of it before step 1: a datasets IterableDataset "
        "(a data file, a folder of data files, a saved datasets folder or a hub id) read, tokenized, masked and packed "
        "on the fly, with flat memory and start-up; the checkpoint holds the stream's position, so a resume continues "
        "exactly. Needs max_steps. Ranks read disjoint shards when the shard count is a multiple of the data-parallel "
        "processes, else every rank reads the whole stream. The eval set stays map-style. See docs/data.md.",
        group="data",
    )
    shuffle_buffer_size: int = _f(
        1000, "streaming with train_sampling_strategy random: raw examples held in a buffer from which each next one "
        "is drawn at random (seeded from data_seed; saved in checkpoints). Larger mixes more, costs memory.",
        group="data",
    )
    max_bad_rows: int = _f(
        10, "streaming: raw examples that cannot be read as the dataset's format (a missing column, a wrong type, no "
        "assistant turn) are skipped and counted per logging window; past this many the run stops with a checkpoint "
        "and names the first.", group="data",
    )
    # ------------------------------------------------------------------------- objective
    objective: str = _f(
        "sft", "What the loop minimises: sft (next-token cross-entropy over trained tokens), dpo (Direct Preference "
        "Optimization on chosen/rejected pairs against a reference model) or simpo (SimPO: reference-free, "
        "length-normalised). dpo and simpo need preference data (chosen, rejected and optionally prompt columns); "
        "see docs/preference.md.", group="objective", choices=("sft", "dpo", "simpo"),
    )
    beta: float = _f(
        0.1, "dpo/simpo temperature: how far the policy may move from the reference (dpo) or the reward scale "
        "(simpo; its paper uses 2.0-2.5).", group="objective",
    )
    loss_type: str = _f(
        "sigmoid", "dpo loss (TRL's names): sigmoid (the DPO paper), ipo (squared, per-token-normalised log-ratios, "
        "as TRL), hinge (SLiC).", group="objective", choices=("sigmoid", "ipo", "hinge"),
    )
    label_smoothing: float = _f(
        0.0, "Probability that a pair's preference is flipped (conservative DPO / SimPO), in [0, 0.5); for "
        "loss_type sigmoid and simpo. TRL 1.16's DPOTrainer ignores it for sigmoid: compare with 0.",
        group="objective",
    )
    simpo_gamma: float = _f(0.5, "simpo target reward margin (TRL's simpo_gamma).", group="objective")
    precompute_ref_log_probs: bool = _f(
        False, "dpo: compute the reference log-probs of every training and eval pair once, before training, with the "
        "starting model under the launch's own strategy, then train without a reference model in memory (saves the "
        "frozen copy of full fine-tuning). Saved in every checkpoint and restored on resume.",
        group="objective",
    )
    max_prompt_length: int | None = _f(
        None, "Preference data: keep at most this many prompt tokens (the last ones, next to the answer).",
        group="objective",
    )
    max_completion_length: int | None = _f(
        None, "Preference data: cut each completion to this many tokens (from the end). max_length then caps "
        "prompt + completion; a pair whose prompt leaves no completion token is dropped and counted.",
        group="objective",
    )
    # ---------------------------------------------------------------------- optimisation
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
        "(8-bit optimizer state for tensors of 4096+ elements, 32-bit below; 'paged' only pages on CUDA).",
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
    # ------------------------------------------ parameter-efficient fine-tuning (peft LoRA/DoRA) and QLoRA
    # Names as in TRL ModelConfig / peft LoraConfig / transformers BitsAndBytesConfig.
    use_peft: bool = _f(
        False, "Train LoRA adapters (peft) on a frozen base instead of every weight; the final folder then holds "
        "the adapter only (merge it with `python -m hftrain.merge`).", group="peft",
    )
    lora_r: int = _f(16, "LoRA rank.", group="peft")
    lora_alpha: int = _f(32, "LoRA scaling numerator: updates are scaled by lora_alpha / lora_r "
                         "(lora_alpha / sqrt(lora_r) with use_rslora).", group="peft")
    lora_dropout: float = _f(
        0.05, "Dropout on the LoRA input. Mixture-of-experts models whose experts are fused 3-D weights (adapted "
        "through peft's ParamWrapper, which has no dropout) train with 0, as the start-up output says.", group="peft",
    )
    lora_target_modules: list[str] = _f(
        ["all-linear"], "Modules that get adapters: all-linear (every linear layer but the output head) or module "
        "names such as q_proj,k_proj,v_proj,o_proj.", group="peft",
    )
    use_dora: bool = _f(False, "Weight-decomposed LoRA (DoRA): also trains a magnitude per output feature.",
                        group="peft")
    use_rslora: bool = _f(False, "Rank-stabilised LoRA scaling lora_alpha / sqrt(lora_r).", group="peft")
    modules_to_save: list[str] = _f(
        [], "Modules trained in full and saved with the adapter, e.g. lm_head,embed_tokens.", group="peft"
    )
    load_in_4bit: bool = _f(
        False, "QLoRA: load the frozen base in 4 bits (bitsandbytes); needs use_peft.", group="quantization"
    )
    load_in_8bit: bool = _f(False, "Load the frozen base in 8 bits (bitsandbytes LLM.int8); needs use_peft.",
                            group="quantization")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type.", group="quantization", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = _f(
        False, "Also quantize the 4-bit scaling constants (~0.4 bit per weight saved).", group="quantization"
    )
    bnb_4bit_compute_dtype: str = _f(
        "float32", "dtype 4-bit weights are dequantized to for each matmul (bfloat16 is faster on GPUs).",
        group="quantization", choices=("float32", "bfloat16", "float16"),
    )
    bnb_4bit_quant_storage: str = _f(
        "uint8", "Container dtype of packed 4-bit weights. Under FSDP it must equal `dtype` so that every "
        "parameter shards alike.", group="quantization", choices=("uint8", "float32", "bfloat16", "float16"),
    )
    # ----------------------------------------------------------------- logging & saving
    logging_steps: int = _f(10, "Log training metrics every N optimizer steps (and at the first step).",
                            group="logging")
    eval_strategy: str = _cadence("evaluate", "eval_steps", "never; nothing is held out then",
                                  "Any but no also evaluates at the end.")
    eval_steps: int | None = _f(None, "Evaluate every N optimizer steps (eval_strategy steps); always at the end.",
                                group="logging")
    save_strategy: str = _cadence("save checkpoint-N", "save_steps", "no checkpoints",
                                  "The final model is saved all the same.")
    save_steps: int | None = _f(None, "Save checkpoint-N every N optimizer steps (save_strategy steps).",
                                group="logging")
    checkpoint_preflight: bool = _f(
        True, "When the run saves periodic checkpoints (save_strategy epoch, or steps with save_steps): before step "
        "1, save a checkpoint of the initial state under the real strategy and process count, load it back, check "
        "that weights and optimizer state are unchanged and that the disk holds another checkpoint of that size, "
        "then delete it and print the save and load times. A run whose checkpoints would not save or load stops "
        "there instead of at its first save.", group="logging",
    )
    async_checkpointing: bool | None = _f(
        None, "Write periodic checkpoints in the background: training waits only while the state is copied to CPU "
        "memory (one more copy of it stays there), at most one save is in flight, and checkpoint-N appears only once "
        "complete. Works with one process, DDP and FSDP2 (sharded state dicts); DeepSpeed and tensor-parallel runs "
        "save synchronously and say why. Preemption, NaN-stop and final saves wait for the one in flight. Unset "
        "(default): on for FSDP2 (each rank stages only its shard), off for one process and DDP (the copy is the "
        "whole model and optimizer state on rank 0, and a local disk's page cache already absorbs the write: "
        "docs/benchmarks.md); set true for slow or network storage.",
        group="logging",
    )
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints (oldest removed first).",
                                      group="logging")
    resume_from_checkpoint: str | None = _f(
        None, "'latest' (newest checkpoint in output_dir) or a checkpoint folder to continue from.", group="logging"
    )
    report_to: list[str] = _f(
        ["none"], "Trackers: wandb, tensorboard, mlflow (needs the mlflow package), or none. metrics.jsonl is "
        "always written.", group="logging"
    )
    project_name: str = _f("hftrain", "Tracker project (W&B project).", group="logging")
    run_name: str | None = _f(None, "Tracker run name; defaults to the output_dir name.", group="logging")
    # ------------------------------------------------------------ monitoring (see the run)
    wandb_tags: list[str] = _f([], "W&B run tags (comma-separated on the command line).", group="monitoring")
    wandb_group: str | None = _f(None, "W&B run group, e.g. one sweep or one experiment family.", group="monitoring")
    disable_tqdm: bool = _f(False, "Hide the progress bar (metrics.jsonl and trackers are unaffected).",
                            group="monitoring")
    straggler_threshold: float = _f(
        0.2, "Warn when a rank's own throughput (tokens per second of data wait + forward time, the parts of a "
        "step in which it waits for nobody) is this fraction below the other ranks' median in two logging "
        "windows in a row.", group="monitoring",
    )
    profile_steps: int = _f(
        0, "Record a torch.profiler trace of this many optimizer steps (from profile_start_step) into "
        "output_dir/profile, one Chrome/TensorBoard trace per rank; 0 = off.", group="monitoring",
    )
    profile_start_step: int = _f(3, "First optimizer step traced when profile_steps > 0 (skip warm-up steps).",
                                 group="monitoring")
    device_peak_tflops: float | None = _f(
        None, "Peak dense bf16 TFLOP/s of one device, for MFU. Default: looked up from the GPU name (H100, A100, "
        "L4, ...); on CPU or an unknown GPU MFU is logged only when this is set.", group="monitoring",
    )
    cost_per_gpu_hour: float | None = _f(
        None, "Price of one device-hour; when set, the run logs its cost (device_hours x price).", group="monitoring"
    )
    # ----------------------------------------------------------------------- parallelism
    # The strategy itself comes from the launch preset (accelerate_configs/); the recipe records which
    # preset it was sized for and why, and `hftrain launch` uses that preset when --preset is not given.
    launch_preset: str | None = _f(
        None, "Name of the accelerate_configs preset this recipe is sized for (e.g. zero3); `hftrain launch` "
        "uses it when --preset is not given, and the run logs it next to what really runs.", group="parallelism",
    )
    launch_preset_reason: str | None = _f(
        None, "Why that preset, e.g. the model-state memory estimate against the GPU memory (the run logs its "
        "own estimate for the strategy it runs).", group="parallelism",
    )
    tp_size: int = _f(
        1, "Tensor-parallel degree: load the model with transformers' DistributedConfig(tp_size=N), its predefined "
        "tensor-parallel plan (tp_plan 'auto'), so each linear layer is sharded over N processes that see the same "
        "batches. Needs a DDP-type preset (e.g. tp) with N processes, or a multiple of N for data-parallel copies "
        "of the split model (hftrain averages their gradients). 1 = off.",
        group="parallelism",
    )
    sp_size: int = _f(
        1, "Sequence-parallel degree (DeepSpeed Ulysses / ALST): each sequence is split over N consecutive processes "
        "that exchange attention heads by all-to-all, so activation memory per process is about 1/N. Needs a "
        "DeepSpeed preset (cpu_sp, zero3_sp) with a multiple of N processes (the remaining factor is "
        "data-parallel) and attention heads divisible by N. docs/long-context.md. 1 = off.",
        group="parallelism",
    )
    cp_size: int = _f(
        1, "Context-parallel degree (torch ring attention through accelerate's ParallelismConfig): each sequence is "
        "split over N consecutive processes that pass key/value blocks around a ring, so activation memory per "
        "process is about 1/N. Needs an FSDP2 preset on CUDA GPUs (fsdp2_cp) with a multiple of N processes (the "
        "remaining factor is data-parallel), sdpa attention and unpacked rows. docs/long-context.md. 1 = off.",
        group="parallelism",
    )
    # pipeline parallelism (hftrain/parallel/pipeline.py, docs/pipeline.md): one contiguous block
    pp_size: int = _f(
        1, "Pipeline-parallel degree: the model's layers split into N stages by its pp plan (base_model_pp_plan), one "
        "per process (two with Interleaved1F1B), run by torch.distributed.pipelining. Needs a DDP-type preset "
        "(cpu_pp on CPU, pp on GPUs) with N processes, or a multiple of N for data-parallel copies of the pipeline. "
        "docs/pipeline.md. 1 = off.", group="parallelism",
    )
    pp_schedule: str = _f(
        "1F1B", "Pipeline schedule (torch's names): 1F1B (one forward, one backward: few activations in flight), "
        "GPipe (all forwards, then all backwards), Interleaved1F1B (two stages per process: bubble halved). "
        "ZBVZeroBubble and DualPipeV are refused (not wired yet, docs/pipeline.md).", group="parallelism",
        choices=("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"),
    )
    pp_microbatches: int | None = _f(
        None, "Microbatches per pipeline step: each per-device batch is split into this many along its rows (padded "
        "with target-less rows to a multiple of it). Default: 2 x the pipeline stages. Bubble: (stages-1)/"
        "microbatches.", group="parallelism",
    )

    # ------------------------------------------------------------------ derived values
    @property
    def order_seed(self) -> int:
        """The seed of everything data: order, eval hold-out and mixture sampling."""
        return self.seed if self.data_seed is None else self.data_seed

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump(self, path: Path) -> None:
        """Write the resolved recipe as YAML (a checkpoint's hftrain_config.yaml)."""
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
TYPES = typing.get_type_hints(Recipe)  # resolved annotations (they are strings under __future__ annotations)
TRACKERS = ("wandb", "tensorboard", "mlflow", "none")


# --------------------------------------------------------------------------- coercion
def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for annotations like `int | None`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


_TRUE, _FALSE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}


def _coerce(name: str, value: Any, from_cli: bool) -> Any:
    """Convert `value` to the field's type or raise ValueError with a readable reason."""
    tp, optional = _base_type(TYPES[name])
    if value is None or (optional and from_cli and isinstance(value, str) and value.lower() in {"none", "null"}):
        if optional:  # `--eval_steps none` unsets; for other fields "none" is a value (`--report_to none`)
            return None
        raise ValueError("may not be empty")
    if typing.get_origin(tp) is dict:
        value = yaml.safe_load(value) if isinstance(value, str) else value  # CLI: --dataset_columns '{a: b}'
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"expected a mapping of strings, got {value!r}")
        return dict(value)
    if typing.get_args(tp) == (DatasetSource,):
        value = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ValueError("expected a list of {name, config, split, weight, columns, format} mappings")
        return [_dataset_source(i, v) for i, v in enumerate(value)]
    if typing.get_origin(tp) is list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"expected a list of strings, got {value!r}")
        return [i.strip() for i in items if i.strip()]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads `1e-4` as a string: accept it as a number
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported field type {tp} for {name}")  # a bug in the schema, not user input


def _dataset_source(index: int, value: dict) -> DatasetSource:
    known = {f.name for f in dataclasses.fields(DatasetSource)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"entry {index} has unknown key(s) {unknown}; keys are {sorted(known)}")
    if "name" not in value:
        raise ValueError(f"entry {index} has no name")
    try:
        source = DatasetSource(**value)
        source.weight = float(source.weight)
    except (TypeError, ValueError):
        raise ValueError(f"entry {index}: weight must be a number, got {value.get('weight')!r}") from None
    if not isinstance(source.columns, dict):
        raise ValueError(f"entry {index}: columns must be a mapping")
    return source


# ------------------------------------------------------------------------ validation
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow")


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`)."""
    return (path.startswith((".", "/", "~")) or path.count("/") > 1 or path.lower().endswith(DATA_SUFFIXES)
            or os.path.exists(path))


def validate(recipe: Recipe) -> list[str]:
    """Every problem with the recipe's values and combinations; [] when it is usable."""
    r, problems = recipe, []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    for name, f in FIELDS.items():
        choices = f.metadata["choices"]
        if choices and getattr(r, name) not in choices:
            shown = ", ".join(str(c) for c in choices if c is not None)
            problems.append(f"{name}={getattr(r, name)!r} is not one of: {shown}")
    bad_trackers = [t for t in r.report_to if t not in TRACKERS]
    need(not bad_trackers, f"report_to has unknown tracker(s) {bad_trackers}; use {', '.join(TRACKERS)}")
    need(not ("none" in r.report_to and len(r.report_to) > 1), "report_to mixes 'none' with trackers")

    need(r.max_steps > 0 or r.num_train_epochs > 0, "set max_steps > 0 or num_train_epochs > 0 (both are off)")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps"):
        need(getattr(r, name) >= 1, f"{name} must be >= 1, got {getattr(r, name)}")
    for kind in ("eval", "save"):
        strategy, steps = getattr(r, f"{kind}_strategy"), getattr(r, f"{kind}_steps")
        need(steps is None or strategy == "steps", f"{kind}_steps={steps} applies to {kind}_strategy=steps, but "
             f"{kind}_strategy={strategy}; remove {kind}_steps or set {kind}_strategy: steps")
    need(not (r.eval_strategy == "no" and r.eval_dataset_name), "eval_strategy=no never evaluates, but "
         "eval_dataset_name is set; remove one")
    for name in ("eval_steps", "save_steps", "save_total_limit", "max_samples"):
        value = getattr(r, name)
        need(value is None or value >= 1, f"{name} must be >= 1 or unset, got {value}")
    need(r.max_length >= 2, f"max_length must be >= 2 tokens, got {r.max_length}")
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
    need(0 <= r.validation_split_percentage < 100,
         f"validation_split_percentage must be in [0, 100), got {r.validation_split_percentage}")
    need(not (r.eval_dataset_name and r.validation_split_percentage not in (0, 5.0)),
         "eval_dataset_name and validation_split_percentage are both set; the carve-out is only used "
         "without eval_dataset_name")
    need(r.dataloader_num_workers >= 0, "dataloader_num_workers must be >= 0")
    need(r.ddp_timeout >= 1, f"ddp_timeout must be >= 1 second, got {r.ddp_timeout}")
    need(not (r.bf16 and r.fp16), "bf16 and fp16 are both true; choose one")
    need(not (r.fp16 and r.dtype == "bfloat16"), "fp16 mixed precision with dtype=bfloat16 weights; use bf16")
    problems += _validate_data(r)
    problems += _streaming_problems(r)
    problems += _objective_problems(r)
    problems += _validate_performance(r)
    problems += _monitoring_problems(r)

    problems += peft_problems(r)

    if _looks_local(r.model_name_or_path) and not Path(r.model_name_or_path).expanduser().is_dir():
        problems.append(f"model_name_or_path {r.model_name_or_path!r} is not a folder; give a local model "
                        "folder or a hub id (org/name). scripts/make_tiny_model.py builds an offline one")
    for name in ("dataset_name", "eval_dataset_name"):
        path = getattr(r, name)
        if path and _looks_local(path) and not Path(path).expanduser().exists():
            problems.append(f"{name} {path!r} does not exist; give a data file, a saved dataset folder or a hub id")

    return problems


def _validate_data(r: Recipe) -> list[str]:
    problems = []
    default_dataset = FIELDS["dataset_name"].default
    if r.dataset_mixture and r.dataset_name != default_dataset:
        problems.append("dataset_name and dataset_mixture are both set; list every dataset in dataset_mixture")
    formats = FIELDS["dataset_format"].metadata["choices"]
    for i, source in enumerate(r.dataset_mixture):
        if source.weight <= 0:
            problems.append(f"dataset_mixture entry {i} ({source.name}) has weight {source.weight}; use > 0")
        if source.format not in formats:
            problems.append(f"dataset_mixture entry {i} has format {source.format!r}; use one of {', '.join(formats)}")
        if _looks_local(source.name) and not Path(source.name).expanduser().exists():
            problems.append(f"dataset_mixture entry {i}: {source.name!r} does not exist")
    if r.train_on_turns == "last" and not r.assistant_only_loss:
        problems.append("train_on_turns=last picks the assistant turn to train, but assistant_only_loss=false trains "
                        "every token; set assistant_only_loss: true or leave train_on_turns at all")
    if r.chat_template_path and not Path(r.chat_template_path).is_file():
        problems.append(f"chat_template_path {r.chat_template_path!r} is not a file")
    if r.dataset_num_proc is not None and r.dataset_num_proc < 1:
        problems.append(f"dataset_num_proc must be >= 1 or unset, got {r.dataset_num_proc}")
    return problems


def _streaming_problems(r: Recipe) -> list[str]:
    """`streaming: true` and what a stream of unknown length cannot do."""
    problems = []
    if r.shuffle_buffer_size < 1:
        problems.append(f"shuffle_buffer_size must be >= 1, got {r.shuffle_buffer_size}")
    if r.max_bad_rows < 0:
        problems.append(f"max_bad_rows must be >= 0, got {r.max_bad_rows}")
    if not r.streaming:
        return problems
    why = "with streaming: true the training set is a stream of unknown length"
    if r.max_steps <= 0:
        problems.append(f"{why}, so epochs cannot be counted: set max_steps")
    for kind in ("eval", "save"):
        if getattr(r, f"{kind}_strategy") == "epoch":
            problems.append(f"{kind}_strategy=epoch: {why}; use {kind}_strategy: steps with {kind}_steps")
    if r.train_sampling_strategy == "group_by_length":
        problems.append(f"train_sampling_strategy=group_by_length sorts the whole set by length, but {why}; use "
                        "random (a shuffle buffer) or sequential")
    if r.precompute_ref_log_probs:
        problems.append(f"precompute_ref_log_probs computes every training pair's reference once, but {why}; "
                        "turn one of them off")
    if r.dataloader_num_workers > 0:
        problems.append("dataloader_num_workers > 0 with streaming: true is not supported yet (collation runs in the "
                        "training process); set dataloader_num_workers: 0")
    return problems


def _objective_problems(r: Recipe) -> list[str]:
    """dpo / simpo settings and what a preference objective cannot be combined with."""
    problems, preference = [], r.objective != "sft"
    if r.beta <= 0:
        problems.append(f"beta must be > 0, got {r.beta}")
    if not 0 <= r.label_smoothing < 0.5:
        problems.append(f"label_smoothing must be in [0, 0.5), got {r.label_smoothing}")
    if r.label_smoothing > 0 and not (r.objective == "simpo" or (r.objective == "dpo" and r.loss_type == "sigmoid")):
        problems.append(f"label_smoothing={r.label_smoothing} applies to objective dpo with loss_type sigmoid, or "
                        f"simpo; here objective={r.objective}, loss_type={r.loss_type}")
    if r.precompute_ref_log_probs and r.objective != "dpo":
        problems.append(f"precompute_ref_log_probs computes dpo's reference, but objective={r.objective}")
    if r.loss_type != "sigmoid" and r.objective != "dpo":
        problems.append(f"loss_type={r.loss_type} is a dpo loss, but objective={r.objective}; set objective: dpo")
    for name in ("max_prompt_length", "max_completion_length"):
        value = getattr(r, name)
        if value is not None and (value < 1 or not preference):
            problems.append(f"{name}={value} needs objective dpo or simpo and a value >= 1")
    if not preference:
        return problems
    if r.packing:
        problems.append(f"packing with objective={r.objective} is refused: a pair's chosen and rejected must be "
                        "compared as whole sequences, one per row; set packing: false")
    if r.use_liger_kernel or r.loss_chunk_tokens:
        problems.append(f"objective={r.objective} needs each sequence's log-probability; use_liger_kernel and "
                        "loss_chunk_tokens compute one summed cross-entropy: turn them off")
    if r.dataset_format not in ("auto", "preference"):
        problems.append(f"objective={r.objective} trains on preference pairs: dataset_format must be auto or "
                        f"preference, got {r.dataset_format}")
    return problems


def _validate_performance(r: Recipe) -> list[str]:
    """Speed options that cannot work together."""
    problems = []
    if r.loss_chunk_tokens < 0:
        problems.append(f"loss_chunk_tokens must be >= 0 (0 = no chunking), got {r.loss_chunk_tokens}")
    if r.torch_compile_mode is not None and not r.torch_compile:
        problems.append(f"torch_compile_mode={r.torch_compile_mode} is set but torch_compile is false; set "
                        "torch_compile: true or remove torch_compile_mode")
    if r.torch_compile and r.tp_size > 1:
        problems.append("torch_compile with tp_size > 1 is refused: compiling transformers' tensor-parallel layers "
                        "(DTensor weights) fails in backward with torch 2.13 (a RecursionError in a view's backward); "
                        "use tensor parallelism or torch_compile, not both")
    if r.packing and r.train_sampling_strategy == "group_by_length":
        problems.append("train_sampling_strategy=group_by_length with packing=true has nothing to group: packed rows "
                        "all hold close to max_length tokens; use random with packing, or turn packing off")
    return problems


def check_output_dir(r: Recipe) -> list[str]:
    """Problems with where a training run writes and resumes (not needed to preview data)."""
    problems = []
    out = Path(r.output_dir)
    if r.resume_from_checkpoint not in (None, "latest") and not Path(r.resume_from_checkpoint).is_dir():
        problems.append(f"resume_from_checkpoint {r.resume_from_checkpoint!r} is not a checkpoint folder")
    if out.is_file():
        problems.append(f"output_dir {r.output_dir!r} is a file")
    elif r.resume_from_checkpoint is None and not r.overwrite_output_dir and _holds_a_run(out):
        problems.append(f"output_dir {r.output_dir!r} already holds a run; resume it with "
                        "resume_from_checkpoint=latest, pick another output_dir, or set overwrite_output_dir=true")
    return problems + _parallelism_problems(r)


def _parallelism_problems(r: Recipe) -> list[str]:
    """The parallelism group: the recorded preset must be one that ships."""
    problems = []
    if r.launch_preset is not None and not (PRESET_DIR / f"{r.launch_preset}.yaml").is_file():
        shipped = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
        problems.append(f"launch_preset={r.launch_preset!r} is not a shipped preset; use one of: {shipped}")
    for name in ("tp_size", "sp_size", "cp_size"):
        if getattr(r, name) < 1:
            problems.append(f"{name} must be >= 1 (1 = off), got {getattr(r, name)}")
    if sum(size > 1 for size in (r.tp_size, r.sp_size, r.cp_size)) > 1:
        problems.append(f"tp_size={r.tp_size}, sp_size={r.sp_size} and cp_size={r.cp_size}: hftrain runs one of "
                        "tensor, sequence (Ulysses) or context (ring) parallelism at a time; set the others to 1")
    for name in ("sp_size", "cp_size"):
        if getattr(r, name) > 1 and r.objective != "sft":
            problems.append(f"{name}={getattr(r, name)} with objective={r.objective} is not supported: preference "
                            "losses need each row's whole log-probability on one process; use data parallelism")
    problems += _pipeline_problems(r)
    if r.launch_preset_reason is not None and r.launch_preset is None:
        problems.append("launch_preset_reason is set but launch_preset is not; name the preset it explains")
    return problems


def _pipeline_problems(r: Recipe) -> list[str]:
    """pp_size / pp_schedule / pp_microbatches, from the recipe alone (the launch and the model's layers are checked
    in the preflight: parallel.pipeline.pipeline_problems)."""
    if r.pp_size < 1:
        return [f"pp_size must be >= 1 (1 = off), got {r.pp_size}"]
    if r.pp_size == 1:
        return []
    problems = []
    sizes = {"tp_size": r.tp_size, "sp_size": r.sp_size, "cp_size": r.cp_size}
    others = [f"{name}={size}" for name, size in sizes.items() if size > 1]
    if others:
        problems.append(f"pp_size={r.pp_size} with {', '.join(others)}: pipeline parallelism composes only with "
                        "data-parallel copies so far (pp x tp and pp x sp/cp are not built, docs/pipeline.md); set "
                        "them to 1")
    if r.objective != "sft":
        problems.append(f"pp_size={r.pp_size} with objective={r.objective}: a preference loss needs both rows of a "
                        "pair and the reference's log-probabilities on the last stage, which hftrain's pipeline does "
                        "not carry; use data parallelism or tensor parallelism")
    if r.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        problems.append(f"pp_schedule={r.pp_schedule} is not available: it needs two stages per process placed in a V "
                        "and a backward split into input and weight gradients, which hftrain's stages do not provide "
                        "yet; use Interleaved1F1B (bubble (p-1)/(2m)) or 1F1B")
    if r.pp_microbatches is not None and r.pp_microbatches < 1:
        problems.append(f"pp_microbatches must be >= 1 or unset, got {r.pp_microbatches}")
    elif r.pp_microbatches is not None and r.pp_schedule != "GPipe" and r.pp_microbatches < r.pp_size:
        problems.append(f"pp_microbatches={r.pp_microbatches} with pp_schedule={r.pp_schedule}: 1F1B-type schedules "
                        f"need at least as many microbatches as processes in the pipeline ({r.pp_size}); raise it")
    if r.packing:
        problems.append(f"pp_size={r.pp_size} with packing: the packed documents' position_ids would have to travel "
                        "between stages, which hftrain's pipeline does not send yet; use packing: false")
    if r.use_liger_kernel or r.loss_chunk_tokens:
        problems.append(f"pp_size={r.pp_size} with use_liger_kernel / loss_chunk_tokens: the last stage computes the "
                        "plain token loss (NeMo's fused loss silently did nothing under pp, NeMo Automodel #2681); "
                        "turn them off")
    if r.torch_compile:
        problems.append(f"pp_size={r.pp_size} with torch_compile is not tested under hftrain's pipeline; turn it off")
    return problems


def _monitoring_problems(r: Recipe) -> list[str]:
    problems = []
    if r.wandb_tags or r.wandb_group:
        if "wandb" not in r.report_to:
            problems.append("wandb_tags / wandb_group are set but report_to does not include wandb")
        if any(len(t) > 64 for t in r.wandb_tags):
            problems.append("wandb_tags must be at most 64 characters each (a W&B limit)")
    if not 0 < r.straggler_threshold < 1:
        problems.append(f"straggler_threshold must be in (0, 1) (a fraction of the median rank's throughput), "
                        f"got {r.straggler_threshold}")
    if r.profile_steps < 0 or r.profile_start_step < 1:
        problems.append(f"profile_steps must be >= 0 and profile_start_step >= 1, got {r.profile_steps} and "
                        f"{r.profile_start_step}")
    for name in ("device_peak_tflops", "cost_per_gpu_hour"):
        value = getattr(r, name)
        if value is not None and value <= 0:
            problems.append(f"{name} must be > 0 or unset, got {value}")
    return problems


# ------------------------------------------------- peft / quantization combinations
def peft_problems(r: Recipe) -> list[str]:
    """Impossible or silently ineffective LoRA / QLoRA settings, judged from the recipe alone."""
    problems = []
    if r.use_peft:
        if r.lora_r < 1:
            problems.append(f"lora_r must be >= 1, got {r.lora_r}")
        if r.lora_alpha <= 0:
            problems.append(f"lora_alpha must be > 0, got {r.lora_alpha}")
        if not 0 <= r.lora_dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1), got {r.lora_dropout}")
        if not r.lora_target_modules:
            problems.append("lora_target_modules is empty; use all-linear or name the layers (q_proj,v_proj,...)")
        elif "all-linear" in r.lora_target_modules and len(r.lora_target_modules) > 1:
            problems.append(f"lora_target_modules {r.lora_target_modules} mixes all-linear with layer names; "
                            "give either all-linear or the names")
        if r.tp_size > 1:
            problems.append(f"use_peft with tp_size={r.tp_size} is refused: peft's LoRA layers wrap transformers' "
                            "tensor-parallel linear layers without being sharded themselves, so the first row-parallel "
                            "layer (o_proj) gets a shard of the input features its adapter was not made for and the "
                            "forward fails (peft 0.21, transformers 5.23); train adapters with data parallelism "
                            "(DDP, ZeRO, FSDP2)")
    else:
        switches = [name for name in ("use_dora", "use_rslora", "load_in_4bit", "load_in_8bit") if getattr(r, name)]
        switches += ["modules_to_save"] if r.modules_to_save else []
        if switches:
            quantized = " (quantized weights cannot be trained directly: that is QLoRA)" if (
                r.load_in_4bit or r.load_in_8bit) else ""
            problems.append(f"{', '.join(switches)} only apply to adapter training{quantized}; set use_peft: true, "
                            f"or remove {', '.join(switches)} for full fine-tuning")
    if r.load_in_4bit and r.load_in_8bit:
        problems.append("load_in_4bit and load_in_8bit are both true; choose one")
    return problems


def _holds_a_run(out: Path) -> bool:
    return out.is_dir() and any(out.glob(f"{PREFIX}*")) or (out / FINAL_DIR).exists()


# -------------------------------------------------------------------------- loading
def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name.lstrip("-").replace("-", "_"), FIELDS, n=3, cutoff=0.75)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _coerce_all(values: dict[str, Any], from_cli: bool) -> tuple[dict[str, Any], list[str]]:
    """Typed values for known keys, and a problem for each unknown key or wrong type."""
    values, problems = from_trl.translate(values, FIELDS)
    clean = {}
    for key, value in values.items():
        if key not in FIELDS:
            problems.append(f"unknown key {key!r}{_did_you_mean(key)}")
            continue
        try:
            clean[key] = _coerce(key, value, from_cli)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    return clean, problems


def recipe_from_dict(values: dict[str, Any], source: str = "recipe", for_training: bool = True) -> Recipe:
    """Build a validated Recipe from a mapping (e.g. a YAML file), or raise ConfigError with every problem."""
    clean, problems = _coerce_all(values, from_cli=False)
    recipe = Recipe(**clean)
    problems += validate(recipe)  # wrongly typed fields keep their defaults here
    problems += check_output_dir(recipe) if for_training else []
    if problems:
        raise ConfigError(problems, source)
    return recipe


def recipe_subset(values: dict[str, Any], names: tuple[str, ...], source: str) -> Recipe:
    """A Recipe with the typed `names` taken from `values` and defaults elsewhere, without path validation: for
    tools that read a finished run's hftrain_config.yaml (whose output_dir holds that run)."""
    clean, problems = _coerce_all({k: v for k, v in values.items() if k in names}, from_cli=False)
    if problems:
        raise ConfigError(problems, source)
    return Recipe(**clean)


def read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"cannot read recipe file {path!r}: {exc.strerror}"], "command line") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path} is not valid YAML: {first_line(exc)}"], f"recipe {path}") from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} must be a mapping of field: value"], f"recipe {path}")
    return data


def build_arg_parser(prog: str = "hftrain.finetune") -> argparse.ArgumentParser:
    """`--config recipe.yaml` plus `--<field> value` for every field; field docs become --help."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Fine-tune a causal LM. Fields come from --config (YAML) and are overridden by --<field> "
        f"value on the command line; {DEFAULT_RECIPE_NOTE}.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="Recipe YAML file.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, f in FIELDS.items():
        group = groups.setdefault(f.metadata["group"], parser.add_argument_group(f.metadata["group"]))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        tp, _ = _base_type(TYPES[name])
        kind = {bool: "BOOL", int: "INT", float: "FLOAT"}.get(tp) or {list: "LIST", dict: "MAP"}.get(
            typing.get_origin(tp), "STR")
        extra = {"nargs": "?", "const": "true"} if tp is bool else {}
        text = f"{f.metadata['help']} (default: {default})".replace("%", "%%")  # argparse formats help with %
        group.add_argument(f"--{name}", metavar=kind, help=text, **extra)
    return parser


def load_recipe(argv: list[str] | None = None, for_training: bool = True, prog: str = "hftrain.finetune") -> Recipe:
    """Parse `--config` + overrides into a validated Recipe, or raise ConfigError listing every problem.

    `for_training` adds the output_dir / resume checks, which a data preview does not need.
    """
    args, unknown = build_arg_parser(prog).parse_known_args(argv)
    config_path = getattr(args, "config", None)
    source = f"recipe {config_path}" if config_path else "command line"
    problems = []
    for i, item in enumerate(unknown):  # a value right after an unknown flag belongs to it
        if item.startswith("-"):
            problems.append(f"unknown argument {item!r}{_did_you_mean(item)}")
        elif i == 0 or not unknown[i - 1].startswith("-"):
            problems.append(f"unexpected value {item!r} (fields are given as --name value)")
    cli_values = {k: v for k, v in vars(args).items() if k != "config"}
    from_cli, cli_problems = _coerce_all(cli_values, from_cli=True)
    file_values = read_yaml(config_path) if config_path else {}
    # a file value overridden on the command line is not used, so its problems do not count
    from_file, file_problems = _coerce_all({k: v for k, v in file_values.items() if k not in cli_values},
                                           from_cli=False)
    problems += file_problems + cli_problems
    recipe = Recipe(**{**from_file, **from_cli})
    problems += validate(recipe)  # wrongly typed fields keep their defaults here
    problems += check_output_dir(recipe) if for_training else []
    if problems:
        raise ConfigError(problems, source)
    return recipe



