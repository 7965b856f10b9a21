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
import re
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hftrain import from_trl
from hftrain.errors import ConfigError, first_line
from hftrain.fields import recipe_field as _f
from hftrain.fields.data import DataFields, DatasetSource, looks_local
from hftrain.fields.data import problems as data_problems
from hftrain.fields.distill import DISTILL_DEFAULTS, DistillFields
from hftrain.fields.distill import problems as distill_problems
from hftrain.fields.evaluation import EvaluationFields
from hftrain.fields.evaluation import problems as evaluation_problems
from hftrain.fields.fp8 import FP8Fields
from hftrain.fields.fp8 import problems as fp8_problems
from hftrain.fields.grpo import OBJECTIVE_DEFAULTS, GRPOFields
from hftrain.fields.grpo import problems as grpo_problems
from hftrain.fields.hub import SECRET_FIELDS, HubFields
from hftrain.fields.hub import problems as hub_problems
from hftrain.fields.hub import unused as hub_unused
from hftrain.fields.monitoring import MonitoringFields
from hftrain.fields.monitoring import problems as monitoring_problems
from hftrain.fields.muon import MuonFields
from hftrain.fields.muon import problems as muon_problems
from hftrain.fields.objectives import ObjectiveFields
from hftrain.fields.objectives import problems as objective_problems
from hftrain.fields.parallel import ParallelFields
from hftrain.fields.parallel import problems as parallel_problems
from hftrain.fields.peft import PeftFields
from hftrain.fields.peft import problems as peft_problems
from hftrain.fields.qat import QATFields
from hftrain.fields.qat import problems as qat_problems
from hftrain.options import is_bool_word, parse_bool
from hftrain.paths import DEFAULT_DATASET as DEFAULT_DATASET  # `as`: re-exported (shipped paths, in hftrain.paths)
from hftrain.paths import DEFAULT_MODEL, FINAL_DIR, RECIPE_DIR, complete_checkpoints, holds_a_run
from hftrain.paths import PRESET_DIR as PRESET_DIR
from hftrain.paths import SHIPPED as SHIPPED

TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW: state exp_avg, exp_avg_sq
OPTIMIZERS = (*TORCH_ADAMW, "sgd", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "muon")
DEFAULT_RECIPE_NOTE = ("with no --config, each field takes the default shown (the tiny offline model and the chat "
                       "data shipped inside hftrain); `hftrain launch`, `hftrain finetune` and `hftrain data` with no "
                       "--config use the demo recipe tiny-chat instead")
# fields that name a file or folder: a relative one that is not under the current folder may be a shipped file
PATH_FIELDS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name", "eval_dataset_name",
               "chat_template_path", "teacher_model_name_or_path")


def _cadence(action: str, every: str, none: str, note: str) -> Any:
    """eval_strategy / save_strategy: TrainingArguments' IntervalStrategy values, documented alike."""
    return _f("steps", f"When to {action} (TrainingArguments' name): steps (every {every} when set), epoch (after "
              f"every epoch) or no ({none}). {note}", group="logging", choices=("steps", "epoch", "no"))


@dataclass
class ModelFields:
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
        "flash-attn --no-build-isolation) or varlen (torch's own variable-length FlashAttention, "
        "torch.nn.attention.varlen: CUDA, bf16/fp16, packing; each packed document attends as its own sequence, by "
        "the packer's boundaries, with no mask, so a row costs the sum of its documents' causal squares instead of "
        "the row's). Default: varlen where it can run (CUDA, bf16 or fp16, packing: true, llama, mistral, mixtral, "
        "qwen2, qwen3, phi3, olmo2 or gemma, without sp_size, pp_size, log_completions or eval_tasks), else the "
        "model's choice (sdpa: packed rows get a block-diagonal mask). Every kernel keeps packed examples apart: "
        "transformers' flash attention finds examples from position_ids only in a batch of one row, so hftrain hands "
        "it (and varlen) each packed micro-batch flattened into one row. The start-up line names the one in use.",
        group="model", choices=(None, "eager", "sdpa", "flash_attention_2", "varlen"),
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
        "names and checkpoints are unchanged. Shapes are dynamic from the first compile, so varying lengths (and "
        "packed documents) do not recompile. The first step takes longer (it compiles; the start-up reports its "
        "time), later steps run faster; worth it for runs of many steps. CPU needs a C++ compiler (inductor).",
        group="model",
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


@dataclass
class LoggingFields:
    logging_steps: int = _f(10, "Log training metrics every N optimizer steps (and at the first step).",
                            group="logging")
    eval_strategy: str = _cadence("evaluate", "eval_steps", "never; nothing is held out, and eval_steps and "
                                  "eval_dataset_name are not used",
                                  "Any but no also evaluates at the end.")
    eval_steps: int | None = _f(None, "Evaluate every N optimizer steps (eval_strategy steps); always at the end.",
                                group="logging")
    save_strategy: str = _cadence("save checkpoint-N", "save_steps", "no checkpoints; save_steps is not used",
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


@dataclass
class Recipe(HubFields, ParallelFields, MonitoringFields, EvaluationFields, LoggingFields, QATFields, PeftFields,
             MuonFields, FP8Fields, TrainingFields,
             DistillFields, GRPOFields, ObjectiveFields, DataFields, ModelFields):
    """One flat, typed schema: every field of every group (declared per group, in this order: model, data,
    objective, training, peft and quantization, logging, evaluation, monitoring, parallelism, hub; dataclasses collect
    the bases' fields from the last base to the first)."""

    # ------------------------------------------------------------------ derived values
    @property
    def order_seed(self) -> int:
        """The seed of everything data: order, eval hold-out and mixture sampling."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def reads_eval_dataset(self) -> bool:
        """eval_dataset_name is loaded: set, and evaluation not turned off (eval_strategy no)."""
        return bool(self.eval_dataset_name) and self.eval_strategy != "no"

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_record(self) -> dict[str, Any]:
        """The recipe as the run's files record it: credentials (hub_token) left out, written as null."""
        return {**self.to_dict(), **dict.fromkeys(SECRET_FIELDS)}

    def dump(self, path: Path) -> None:
        """Write the resolved recipe as YAML (a checkpoint's hftrain_config.yaml), without credentials."""
        path.write_text(yaml.safe_dump(self.to_record(), sort_keys=False), encoding="utf-8")


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


def _coerce(name: str, value: Any, from_cli: bool) -> Any:
    """Convert `value` to the field's type or raise ValueError with a readable reason."""
    tp, optional = _base_type(TYPES[name])
    word = value[0] if isinstance(value, list) and len(value) == 1 else value  # a list field's words (nargs +)
    if value is None or (optional and from_cli and isinstance(word, str) and word.lower() in {"none", "null"}):
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
        return _coerce_list(typing.get_args(tp)[0], value, from_cli)
    return _coerce_scalar(tp, value, name)


# what an item of each type is called in a problem ("expected a list of numbers")
_NOUNS = {bool: ("true or false", "true/false values"), int: ("an integer", "integers"),
          float: ("a number", "numbers"), str: ("a string", "strings")}


def _coerce_list(item_type: type, value: Any, from_cli: bool) -> list:
    """A list field, every item read as `item_type` (YAML `[1.0, 0.5]`; on the command line `--f 1.0 0.5`, `--f
    1.0,0.5` or `--f '[1.0, 0.5]'`), or ValueError naming the first item that is not one."""
    words = [value] if isinstance(value, str) else value
    if isinstance(value, str) or from_cli and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = words
        if len(value) == 1 and value[0].lstrip().startswith("["):  # a YAML flow list: --reward_weights '[1, 0.5]'
            try:
                value = yaml.safe_load(value[0])
            except yaml.YAMLError:
                raise ValueError(f"expected a list of {_NOUNS[item_type][1]}, got {value[0]!r}") from None
        else:  # argparse hands over the words (nargs +), each may hold comma-separated items
            value = [item.strip() for word in value for item in word.split(",") if item.strip()]
    if not isinstance(value, list):
        raise ValueError(f"expected a list of {_NOUNS[item_type][1]}, got {value!r}")
    items = []
    for i, item in enumerate(value, 1):
        if item_type is str and not isinstance(item, str):  # YAML read it as another type: refuse, do not guess
            raise ValueError(f"expected a list of strings; item {i} is {item!r} (quote it)")
        try:
            items.append(_coerce_scalar(item_type, item.strip() if isinstance(item, str) else item))
        except ValueError:
            raise ValueError(f"expected a list of {_NOUNS[item_type][1]}; item {i} is {item!r}, not "
                             f"{_NOUNS[item_type][0]}") from None
    return [item for item in items if item != ""] if item_type is str else items


def _coerce_scalar(tp: Any, value: Any, name: str = "") -> Any:
    """`value` as a bool, int, float or str (a field, or an item of a list field), or ValueError."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and is_bool_word(value):  # the words every command's yes/no options take
            return parse_bool(value)
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


def with_objective_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """`values` plus the objective's own defaults (fields.grpo.OBJECTIVE_DEFAULTS: TRL's GRPOConfig differs from
    DPOConfig there) for the fields they leave unset."""
    defaults = {**OBJECTIVE_DEFAULTS, "distill": DISTILL_DEFAULTS}
    return {**defaults.get(values.get("objective"), {}), **values}


# ------------------------------------------------------------------------ validation
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
    for kind in ("eval", "save"):  # `no` turns the cadence off whatever its steps say (unused_settings notes them)
        strategy, steps = getattr(r, f"{kind}_strategy"), getattr(r, f"{kind}_steps")
        need(steps is None or strategy != "epoch", f"{kind}_steps={steps} applies to {kind}_strategy=steps, but "
             f"{kind}_strategy=epoch; remove {kind}_steps (on the command line: --{kind}_steps null) or set "
             f"{kind}_strategy: steps")
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
    problems += data_problems(r)
    problems += objective_problems(r)
    problems += grpo_problems(r)
    problems += distill_problems(r)
    problems += _validate_performance(r)
    problems += monitoring_problems(r)
    problems += muon_problems(r)
    problems += qat_problems(r)
    problems += fp8_problems(r)
    problems += hub_problems(r)
    problems += evaluation_problems(r)

    problems += peft_problems(r)

    if looks_local(r.model_name_or_path) and not Path(r.model_name_or_path).expanduser().is_dir():
        problems.append(f"model_name_or_path {r.model_name_or_path!r} is not a folder; give a local model "
                        "folder or a hub id (org/name). scripts/make_tiny_model.py builds an offline one")
    for name in ("dataset_name", "eval_dataset_name"):
        path = getattr(r, name)
        if path and looks_local(path) and not Path(path).expanduser().exists():
            problems.append(f"{name} {path!r} does not exist; give a data file, a saved dataset folder or a hub id")

    return problems


def unused_settings(r: Recipe) -> list[str]:
    """Start-up notes for settings that a cadence or push_to_hub turned off leaves without effect (they stay in the
    resolved recipe as given: `--eval_strategy no` on a recipe with eval_steps needs nothing more)."""
    unused = {"eval": [name for name in ("eval_steps", "eval_dataset_name") if getattr(r, name) is not None],
              "save": [name for name in ("save_steps", "save_total_limit") if getattr(r, name) is not None]}
    return [f"{kind}_strategy no: {', '.join(f'{name}={getattr(r, name)}' for name in names)} not used"
            for kind, names in unused.items() if names and getattr(r, f"{kind}_strategy") == "no"] + hub_unused(r)


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
    if r.use_liger_kernel and r.tp_size > 1:
        problems.append(f"use_liger_kernel with tp_size={r.tp_size} is refused: Liger's fused loss reads "
                        "lm_head.weight directly, and under tensor parallelism that is a DTensor holding 1/tp_size of "
                        "the vocabulary (transformers' tp plan splits the head), which its Triton kernel cannot "
                        "take as the whole head; use tensor parallelism or Liger, not both")
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
    elif r.resume_from_checkpoint is None and not r.overwrite_output_dir and holds_a_run(out):
        problems.append(_holds_a_run_problem(r.output_dir, out))
    return problems + parallel_problems(r)


def _holds_a_run_problem(name: str, out: Path) -> str:
    """What to do with an output_dir that holds a run: resume is offered only when a checkpoint can be resumed
    (resume_from_checkpoint=latest refuses a folder without one, so advising it there is a dead end)."""
    start_over = "set overwrite_output_dir=true to start over in it (its files are replaced)"
    if resumable := complete_checkpoints(out):
        return (f"output_dir {name!r} already holds a run (its newest checkpoint: {resumable[-1].name}); resume it "
                f"with resume_from_checkpoint=latest, pick another output_dir, or {start_over}")
    held = "a final model" if (out / FINAL_DIR).exists() else "checkpoints that were never completed"
    return (f"output_dir {name!r} already holds a run ({held}) but no complete checkpoint to resume from; pick "
            f"another output_dir, or {start_over}")


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
    return with_shipped_paths(clean), problems


def shipped_path(value: str) -> str:
    """A relative path that is not under the current folder but is one of the files shipped inside hftrain
    (models/tiny-llama, data/chat.jsonl...: the repository's recipes name them so) becomes that shipped file's
    absolute path, so that a shipped recipe, or a copy of one, runs from any folder as from the repository. Anything
    else (an existing path, an absolute one, a hub id) is returned unchanged."""
    path = Path(value)
    if path.is_absolute() or value.startswith("~") or path.exists() or not (SHIPPED / path).exists():
        return value
    return str(SHIPPED / path)


def with_shipped_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with `shipped_path` applied to the PATH_FIELDS and to dataset_mixture's names."""
    values = {key: shipped_path(value) if key in PATH_FIELDS and isinstance(value, str) else value
              for key, value in values.items()}
    if isinstance(values.get("dataset_mixture"), list):
        values["dataset_mixture"] = [dataclasses.replace(source, name=shipped_path(source.name))
                                     for source in values["dataset_mixture"]]
    return values


def recipe_from_dict(values: dict[str, Any], source: str = "recipe", for_training: bool = True) -> Recipe:
    """Build a validated Recipe from a mapping (e.g. a YAML file), or raise ConfigError with every problem."""
    clean, problems = _coerce_all(values, from_cli=False)
    return _validated(clean, problems, source, for_training)


def _validated(values: dict[str, Any], problems: list[str], source: str, for_training: bool,
               command_line: list[str] | None = None) -> Recipe:
    """The Recipe of coerced `values` (with the objective's defaults for the fields they leave unset), or ConfigError
    with `problems` (the coercion's) and every problem validation finds, under `source`; `command_line`: the
    problems of the command line's own words (unknown flags, values of the wrong type), reported as the command
    line's before them."""
    recipe = Recipe(**with_objective_defaults(values))
    problems = problems + validate(recipe)  # wrongly typed fields keep their defaults here
    problems += check_output_dir(recipe) if for_training else []
    if problems or command_line:
        raise ConfigError(groups=[("command line", command_line or []), (source, problems)])
    return recipe


def recipe_subset(values: dict[str, Any], names: tuple[str, ...], source: str) -> Recipe:
    """A Recipe with the typed `names` taken from `values` and defaults elsewhere, without path validation: for
    tools that read a finished run's hftrain_config.yaml (whose output_dir holds that run)."""
    clean, problems = _coerce_all({k: v for k, v in values.items() if k in names}, from_cli=False)
    if problems:
        raise ConfigError(problems, source)
    return Recipe(**with_objective_defaults(clean))


def shipped_recipes() -> list[Path]:
    """The recipes shipped inside hftrain (the repository's recipes/), by name."""
    return sorted(RECIPE_DIR.glob("*.yaml"), key=lambda path: path.stem)


def recipe_file(name: str) -> str:
    """`--config`'s value: a recipe file; else a shipped recipe, by name (`tiny-dpo`) or by its path in the repository
    (`recipes/tiny-dpo.yaml`, as the docs write it), so that both work from any folder."""
    path = Path(name).expanduser()
    if path.is_file():
        return name
    if not path.is_absolute() and ".." not in path.parts:
        for shipped in (SHIPPED / path, RECIPE_DIR / path, RECIPE_DIR / f"{name}.yaml"):
            if shipped.is_file():
                return str(shipped)
    names = ", ".join(p.stem for p in shipped_recipes())
    raise ConfigError([f"cannot read recipe file {name!r}: there is no such file, nor a recipe of that name among "
                       f"those shipped with hftrain ({names}; `hftrain recipes` describes them)"], "command line")


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


# What `--help` shows of each group: one line on the group, then its commonly used fields (every field: --help GROUP,
# --help all); tests/unit/test_config.py checks that each group and each named field exists.
HELP_GROUPS = {
    "model": ("what loads and how: model, dtype, attention kernel, memory savers",
              ("model_name_or_path", "dtype", "attn_implementation", "gradient_checkpointing")),
    "data": ("datasets, formats and columns, chat template and loss masks, length, packing, streaming",
             ("dataset_name", "eval_dataset_name", "validation_split_percentage", "max_length", "packing",
              "assistant_only_loss")),
    "objective": ("what the loss is (sft, dpo, simpo, orpo, kto, reward, distill, grpo) and its coefficients",
                  ("objective", "beta")),
    "grpo": ("online RL, objective grpo: reward functions, generations, clipping, vLLM, tools",
             ("reward_funcs", "num_generations")),
    "distill": ("objective distill: the teacher and the on-policy share", ("teacher_model_name_or_path",)),
    "training": ("the run: output, length, batch, optimizer and schedule, precision, seeds",
                 ("output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_ratio", "bf16",
                  "seed")),
    "peft": ("LoRA / DoRA adapters", ("use_peft", "lora_r", "lora_alpha")),
    "quantization": ("QLoRA: a 4- or 8-bit base (bitsandbytes)", ("load_in_4bit",)),
    "logging": ("when to log, evaluate and save; resuming; trackers",
                ("logging_steps", "eval_steps", "save_steps", "save_total_limit", "resume_from_checkpoint",
                 "report_to")),
    "evaluation": ("evaluation add-ons: lm-evaluation-harness tasks, completion samples", ("eval_tasks",)),
    "monitoring": ("W&B tags, progress bar, stragglers and hangs, profiling, MFU and cost", ()),
    "parallelism": ("the preset a recipe is sized for; tensor, sequence, context, expert and pipeline parallelism",
                    ("launch_preset",)),
    "hub": ("pushing to the Hugging Face hub", ("push_to_hub", "hub_model_id")),
}
HELP_ALL = "all"


class RecipeParser(argparse.ArgumentParser):
    """The recipe's command line: `--config` and `--<field> VALUE` for every field (field docs = help, one argument
    group per field group). `--help` shows each group in a line with its commonly used fields, one line each;
    `--help GROUP` a group's fields in full, `--help FIELD` one field, `--help all` every field. Nothing here imports
    torch: `hftrain finetune --help` prints before the training module is imported."""

    def __init__(self, prog: str) -> None:
        super().__init__(
            prog=prog, usage="%(prog)s [--help [GROUP|FIELD|all]] [--config RECIPE] [--<field> VALUE ...]",
            description="Fine-tune a causal LM. Fields come from --config (YAML) and are overridden by --<field> "
            "value on the command line (a list field takes its items as words or comma-separated: --reward_weights 1 "
            f"0.5; a yes/no field true or false: --bf16 true); {DEFAULT_RECIPE_NOTE}.",
            argument_default=argparse.SUPPRESS, add_help=False,
            allow_abbrev=False,  # a prefix is a typo to report, not a field to guess (--lora: which of the lora_*?)
        )
        self.add_argument("-h", "--help", action=RecipeHelp)
        self.add_argument("--config", metavar="RECIPE", help="Recipe YAML file, or a shipped recipe's name (hftrain "
                          "recipes lists them).")
        self.field_groups: dict[str, list[argparse.Action]] = {}
        for name, f in FIELDS.items():
            group = f.metadata["group"]
            if group not in self.field_groups:
                self.field_groups[group] = []
                container = self.add_argument_group(group)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tp, _ = _base_type(TYPES[name])
            kind = {bool: "BOOL", int: "INT", float: "FLOAT"}.get(tp) or {list: "LIST", dict: "MAP"}.get(
                typing.get_origin(tp), "STR")
            extra = {"nargs": "?", "const": "true"} if tp is bool else {}
            if typing.get_origin(tp) is list and typing.get_args(tp)[0] in _NOUNS:  # TRL's form: --reward_weights 1 0.5
                extra = {"nargs": "+"}
            text = f"{f.metadata['help']} (default: {default})".replace("%", "%%")  # argparse formats help with %
            self.field_groups[group].append(container.add_argument(f"--{name}", metavar=kind, help=text, **extra))

    def help_text(self, topic: str) -> str:
        """`--help`'s text for `topic`: "" the overview, a group's or a field's name, or "all"."""
        if topic == "":
            return self.overview()
        if topic == HELP_ALL:
            return self.format_help()
        name = topic.removeprefix("--")
        if name in self.field_groups:
            return self.described([name])
        if name in FIELDS:
            return self.described([FIELDS[name].metadata["group"]], only=f"--{name}")
        self.error(f"--help {topic}: no such group or field; give a group ({', '.join(self.field_groups)}), a field "
                   f"name, or {HELP_ALL}")
        return ""

    def described(self, groups: list[str], only: str | None = None) -> str:
        """The usage line and the full help of `groups`' fields (or of the one field `only`)."""
        formatter = self.formatter_class(prog=self.prog)
        formatter.add_usage(self.usage, self._actions, [])
        for group in groups:
            actions = [a for a in self.field_groups[group] if only is None or only in a.option_strings]
            formatter.start_section(f"{group} ({HELP_GROUPS.get(group, ('', ()))[0]})" if only is None else group)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help()

    def overview(self, width: int | None = None) -> str:
        """Each group in one line, with its commonly used fields in one line each (their help's first sentence)."""
        width = (width or shutil.get_terminal_size().columns) - 2  # as argparse wraps
        formatter = self.formatter_class(prog=self.prog)
        formatter.add_usage(self.usage, self._actions, [])
        formatter.add_text(self.description)
        shown = [(group, action) for group, actions in self.field_groups.items() for action in actions
                 if action.dest in HELP_GROUPS.get(group, ("", ()))[1]]
        column = max(len(f"--{action.dest} {action.metavar}") for _, action in shown) + 4
        options = {"-h, --help [GROUP|FIELD|all]": "this overview; a group's fields in full (--help data), one "
                   "field's (--help max_length), all: every field",
                   "--config RECIPE": "a recipe YAML file, or a shipped recipe's name (hftrain recipes lists them)"}
        lines = [formatter.format_help().rstrip(), "", "options:"]
        for flag, doc in options.items():
            lines += textwrap.wrap(doc, max(width, column + 20), initial_indent=f"  {flag:<{column - 2}}",
                                   subsequent_indent=" " * column)
        lines += ["", f"fields: {len(FIELDS)} in {len(self.field_groups)} groups, each below with its commonly used "
                  "fields:"]
        for group, actions in self.field_groups.items():
            lines += textwrap.wrap(f"{group} ({len(actions)} fields): {HELP_GROUPS.get(group, ('', ()))[0]}",
                                   max(width, column + 20), subsequent_indent="    ")
            for action in actions:
                if (group, action) in shown:
                    flag = f"--{action.dest} {action.metavar}"
                    doc = first_sentence(FIELDS[action.dest].metadata["help"])
                    lines.append(f"  {flag:<{column - 2}}" + textwrap.shorten(doc, max(width - column, 20),
                                                                          placeholder=" ..."))
        return "\n".join(lines) + "\n"


class RecipeHelp(argparse.Action):
    """-h / --help [GROUP|FIELD|all]: print the recipe's help for the topic and exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest="help", nargs="?", const="", default=argparse.SUPPRESS,
                         metavar="GROUP|FIELD|all", help="this overview; GROUP: a group's fields in full, FIELD: one "
                         "field's, all: every field")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(parser.help_text(values), end="")
        parser.exit()


def first_sentence(text: str) -> str:
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(\s|$)", text)
    return text[:end.start() + 1] if end else text


def wants_help(argv: list[str]) -> bool:
    """Whether the recipe's arguments ask for `--help` (which prints without loading anything)."""
    return any(arg in ("-h", "--help") or arg.startswith("--help=") for arg in argv)


def build_arg_parser(prog: str = "hftrain finetune") -> RecipeParser:
    """`--config recipe.yaml` plus `--<field> value` for every field; field docs become --help."""
    return RecipeParser(prog)


def load_recipe(argv: list[str] | None = None, for_training: bool = True, prog: str = "hftrain finetune") -> Recipe:
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
    file_values = read_yaml(recipe_file(config_path)) if config_path else {}
    # a file value overridden on the command line is not used, so its problems do not count
    from_file, file_problems = _coerce_all({k: v for k, v in file_values.items() if k not in cli_values},
                                           from_cli=False)
    return _validated({**from_file, **from_cli}, file_problems, source, for_training, problems + cli_problems)



