"""Model builders: tokenizer, the causal LM for each fine-tuning method, and `WrapsCausalLM`, the module every
objective's loss module is: the causal LM under `lm`, as the parallelism backends, accelerate and the saves see it.

Full fine-tuning, LoRA and QLoRA differ only here (in the builder), never in the training loop.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
)
from transformers.modeling_layers import GradientCheckpointingLayer

import hftrain.attention  # noqa: F401 - registers attn_implementation "varlen" in transformers before any load
from hftrain import fp8, hub, qat, vision
from hftrain.compat.accelerate import deepspeed_probed_by_import
from hftrain.compat.deepspeed import whole_ndim
from hftrain.compat.liger import apply_liger_kernel_to_instance
from hftrain.compat.torch import is_compiled
from hftrain.compat.transformers import (
    attn_implementation,
    keep_used_conversions,
    load_decoder_layers,
    no_split_modules,
)
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError, first_line
from hftrain.metrics import parameter_count
from hftrain.ties import held_ties

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_STORAGE = {"uint8": torch.uint8, **DTYPES}


def load_error(what: str, name: str, exc: Exception) -> str:
    return (f"cannot load {what} {name!r}: {first_line(exc)}. Give a local folder or a hub id reachable from this "
            "machine (check the id's spelling; with HF_HUB_OFFLINE=1 only already-cached hub models load)")


def build_tokenizer(recipe: Recipe):
    name = recipe.tokenizer_name_or_path or recipe.model_name_or_path
    hub.reach("tokenizer", name, recipe.model_revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=recipe.model_revision, trust_remote_code=recipe.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise HftrainError(load_error("tokenizer", name, exc)) from None
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """Padding never reaches the loss (labels are -100), so any id works when the tokenizer has no pad token."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return candidate
    return 0


# Non-reentrant checkpointing works with DDP and frozen inputs (no "marked ready twice", no need to make
# the embeddings' output require grad).
CHECKPOINTING = {"use_reentrant": False}


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer: transformers 5.23's
    `activation_checkpointing_enable`, named `gradient_checkpointing_enable` before (5.17 to 5.22)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=CHECKPOINTING)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft's get_peft_model / PeftModel.from_pretrained (peft 0.21.2) read `model.is_gradient_checkpointing`, which
    transformers 5.23 deprecates with a FutureWarning on every LoRA run and merge: a note to peft's authors, not to
    hftrain's users. Only that message is ignored, only around these calls; a user's own warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def name_deepspeeds_cpu_accelerator() -> None:
    """DeepSpeed, once imported (a DeepSpeed preset, or transformers' save_pretrained outside the accelerate versions
    `compat.accelerate.deepspeed_probed_by_import` was checked on), detects its accelerator; on a machine without
    CUDA, naming the CPU accelerator it would detect anyway spares every run and merge DeepSpeed's warning "Setting
    accelerator to CPU". A DS_ACCELERATOR the user set is kept."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def quantization_config(recipe: Recipe):
    """The bitsandbytes config the recipe asks for (load_in_4bit / load_in_8bit), or None."""
    if recipe.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=recipe.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=recipe.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=DTYPES[recipe.bnb_4bit_compute_dtype],
            bnb_4bit_quant_storage=QUANT_STORAGE[recipe.bnb_4bit_quant_storage],
        )
    if recipe.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def has_score_head(recipe: Recipe) -> bool:
    """A new one-output score head on the body: objective reward, and reranker with its classifier head (the yes/no
    reranker reads the causal LM's own logits)."""
    return recipe.objective == "reward" or (recipe.objective == "reranker" and recipe.reranker_head == "classifier")


def auto_model_class(recipe: Recipe, config):
    """What the base is loaded as: `AutoModelForSequenceClassification` for a reward model (objective reward: the
    causal LM's body, a fresh one-output `score` head), `AutoModelForImageTextToText` for an image-text model, else
    `AutoModelForCausalLM`; `AutoModel` (the body alone: its last hidden states are pooled) for an embedding model."""
    if has_score_head(recipe):
        return AutoModelForSequenceClassification
    if recipe.objective == "embedding":
        return AutoModel
    return AutoModelForImageTextToText if vision.is_image_text(config) else AutoModelForCausalLM


def load_image_text_model(config, name: str, **kwargs) -> nn.Module:
    """`AutoModelForImageTextToText.from_pretrained`, leaving the random state as it found it: under DeepSpeed ZeRO-3
    (`zero.Init`) the sub-models an image-text model builds in its `__init__` (LLaVA's language model, through
    `AutoModel.from_config`) draw initial weights that the load then overwrites, so LoRA's adapters, drawn next,
    started elsewhere than in one process (2 processes' first gradient norm 0.295 against 0.237). Its sub-models'
    classes are defined before the load (`vision.define_model_classes`)."""
    vision.define_model_classes(config)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        return AutoModelForImageTextToText.from_pretrained(name, **kwargs)


def load_base_model(recipe: Recipe, load_kwargs: dict | None = None, layers: set[int] | None = None) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` for an image-text model) with the
    recipe's dtype, attention and bitsandbytes settings, plus `load_kwargs`: the parallelism backend's (tensor
    parallelism shards while loading) and the attention a run chose where the recipe names none
    (`attn_implementation`: hftrain.finetune, `preflight.attention_choice`). A quantized model lands on this
    process's device (transformers picks the current CUDA device, which accelerate has set per process, or the CPU).
    `layers`: the decoder layers to read (a pipeline stage's: `compat.transformers.load_decoder_layers`); None reads
    them all."""
    kwargs = {"dtype": DTYPES[recipe.dtype], "revision": recipe.model_revision,
              "trust_remote_code": recipe.trust_remote_code, **(load_kwargs or {})}
    if recipe.attn_implementation:
        kwargs["attn_implementation"] = recipe.attn_implementation
    if (quantization := quantization_config(recipe)) is not None:
        kwargs["quantization_config"] = quantization
    if has_score_head(recipe):  # a score head with one output: the reward, the pair's score
        kwargs["num_labels"] = 1
    try:
        config = vision.model_config(recipe)
        auto = auto_model_class(recipe, config)
        if layers is not None:
            model = load_decoder_layers(auto, config, recipe.model_name_or_path, kwargs, layers)
        elif auto is AutoModelForSequenceClassification:
            model = load_as_reward_model(recipe.model_name_or_path, **kwargs)
        elif auto is AutoModel:
            model = load_as_encoder(recipe.model_name_or_path, **kwargs)
        elif auto is AutoModelForImageTextToText:
            model = load_image_text_model(config, recipe.model_name_or_path, **kwargs)
        else:
            model = auto.from_pretrained(recipe.model_name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise HftrainError(load_error("model", recipe.model_name_or_path, exc)) from None
    model.config.use_cache = False
    keep_used_conversions(model)
    if recipe.load_in_4bit:
        keep_4bit_layout(model)
    if recipe.use_liger_kernel:
        apply_liger_kernels(model)
    return model


class _HeldLoadReport(logging.Filter):
    """Holds back the warning transformers' from_pretrained logs as its load report (missing / unexpected keys)."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True


def load_reporting_only_surprises(auto_class, name: str, expected: Callable[[dict], bool], **kwargs) -> nn.Module:
    """`auto_class.from_pretrained(name)` with transformers' load report (missing / unexpected keys) held back, and
    printed only when `expected(loading_info)` is false: when the report lists more than the head change that the
    caller makes on purpose."""
    logger = logging.getLogger("transformers.modeling_utils")
    report = _HeldLoadReport()
    logger.addFilter(report)
    try:
        model, info = auto_class.from_pretrained(name, output_loading_info=True, **kwargs)
    finally:
        logger.removeFilter(report)
    if not expected(info):
        for record in report.held:
            logger.handle(record)
    return model


def load_as_encoder(name: str, **kwargs) -> nn.Module:
    """`AutoModel.from_pretrained`: the body of a causal LM's (or an encoder's) folder. Loading a causal LM's folder,
    transformers' load report lists its language-model head as UNEXPECTED, which is what an embedding model drops;
    the report is printed only when it lists anything else."""
    def head_only(info: dict) -> bool:
        return (not info.get("missing_keys") and not info.get("mismatched_keys") and not info.get("error_msgs")
                and all(key.startswith(("lm_head.", "cls.", "pooler.")) for key in info.get("unexpected_keys", ())))
    return load_reporting_only_surprises(AutoModel, name, head_only, **kwargs)


def load_as_reward_model(name: str, **kwargs) -> nn.Module:
    """`AutoModelForSequenceClassification.from_pretrained`, usually of a causal LM's folder. transformers' load
    report then lists the new `score` head as MISSING and the language-model head as UNEXPECTED, which is exactly
    what a reward model is (objective reward's start-up line says so), so the report is printed only when it lists
    anything else: other missing or unexpected weights, mismatched shapes."""
    def head_swap_only(info: dict) -> bool:
        return (all(key.startswith("score.") for key in info.get("missing_keys", ()))
                and all(key.startswith("lm_head.") for key in info.get("unexpected_keys", ()))
                and not info.get("mismatched_keys") and not info.get("error_msgs"))
    return load_reporting_only_surprises(AutoModelForSequenceClassification, name, head_swap_only, **kwargs)


def keep_4bit_layout(model: nn.Module) -> int:
    """Keep bitsandbytes' 4-bit weights in their training layout. On a CPU with AVX512-BF16, bitsandbytes 0.50
    repacks a Linear4bit's weight for a faster bf16 kernel at its first forward in eval mode without grad, and keeps
    it repacked: every evaluation would change the numerics of the training that follows it (~1e-2 per layer),
    so a resumed run would no longer equal the uninterrupted one. Returns the number of layers kept."""
    layers = [module for module in model.modules() if hasattr(module, "support_avx512bf16_for_cpu")]
    for module in layers:
        module.support_avx512bf16_for_cpu = False
    return len(layers)


# Keyword arguments of liger-kernel 0.8.5's apply_liger_kernel_to_<model_type>(model=...) (each function takes the ones
# its architecture has: swiglu or geglu). The loss is not Liger's forward: `fused_linear_cross_entropy=False` keeps
# the model's own forward, and CausalLMTokenLoss calls Liger's fused loss itself (hftrain sums token losses and
# normalises by the global token count).
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def apply_liger_kernels(model: nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU/GeGLU and RoPE kernels in the loaded model (before any adapter is added). Liger binds
    new forwards to this instance's modules, and also replaces the architecture's rotary function and norm/MLP
    classes in transformers' modeling module, i.e. for every later model of that type in this process."""
    apply_liger_kernel_to_instance(model, **LIGER_KERNELS)


def liger_fused_linear_cross_entropy() -> nn.Module:
    """Liger's fused output projection + cross-entropy: `f(head weight, hidden [N, H], targets [N], bias)` returns the
    *sum* of the N token losses (reduction="sum"), chunking the tokens so that [N, vocabulary] logits never exist."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def build_full_model(recipe: Recipe, load_kwargs: dict | None = None, layers: set[int] | None = None,
                     float8_all_gather: bool = False) -> nn.Module:
    """The causal LM with every parameter trainable (full fine-tuning); an image-text model's vision tower and
    projector stay frozen as the recipe says (hftrain.vision). `layers`: the decoder layers to read (the others stay
    on the meta device), or all."""
    model = load_base_model(recipe, load_kwargs, layers)
    if vision.is_image_text(model.config):
        model.hftrain_notes = [vision.describe_frozen(vision.freeze(model, recipe))]
    if recipe.qat_scheme is not None:  # torchao's fake quantization, before the optimizer sees the parameters
        model.hftrain_notes = [*getattr(model, "hftrain_notes", []), qat.prepare(model, recipe)]
    if recipe.fp8:  # torchao's float8 linear layers (CUDA >= 8.9: the preflight refused the rest)
        model.hftrain_notes = [*getattr(model, "hftrain_notes", []), fp8.convert(model, recipe, float8_all_gather)]
    if recipe.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def fused_expert_parameters(model: nn.Module) -> list[str]:
    """Names of mixture-of-experts weights stored as one 3-D tensor per layer (transformers 5 fuses experts so), by
    their whole shape also where ZeRO-3 holds them partitioned."""
    return [name for name, p in model.named_parameters() if whole_ndim(p) == 3 and ".experts." in f".{name}"]


def lora_config(recipe: Recipe, dropout: float | None = None):
    from peft import LoraConfig  # peft imports bitsandbytes: only adapter runs load it
    targets = recipe.lora_target_modules
    return LoraConfig(
        # a reward model's adapter: peft's sequence-classification task trains the score head whole (it adds "score"
        # to modules_to_save) and AutoPeftModelForSequenceClassification loads it
        task_type="SEQ_CLS" if has_score_head(recipe) else {"embedding": "FEATURE_EXTRACTION"}.get(
            recipe.objective, "CAUSAL_LM"),
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout if dropout is None else dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        use_dora=recipe.use_dora,
        use_rslora=recipe.use_rslora,
        modules_to_save=list(recipe.modules_to_save) or None,
    )


def tied_modules_adapted(model: nn.Module, recipe: Recipe) -> list[str]:
    """The recipe's modules_to_save / lora_target_modules entries that name a module whose weight the model ties
    (`all_tied_weights_keys`: the input embedding and the output projection of SmolLM2, Qwen2.5-0.5B, Gemma)."""
    tied = {name.rsplit(".", 2)[-2] for pair in getattr(model, "all_tied_weights_keys", {}).items() for name in pair
            if name.endswith(".weight") and "." in name}
    return [m for m in [*recipe.modules_to_save, *recipe.lora_target_modules] if m.rsplit(".", 1)[-1] in tied]


def build_peft_model(recipe: Recipe, load_kwargs: dict | None = None) -> nn.Module:
    """LoRA / DoRA adapters (peft) on a frozen base; QLoRA when the base is loaded in 4 or 8 bits.

    QLoRA follows peft's recipe: `prepare_model_for_kbit_training` freezes the base and upcasts its
    non-quantized weights (norms, embeddings, head) to fp32, with non-reentrant gradient checkpointing.
    Adapter weights are created in fp32 (peft's `autocast_adapter_dtype`) whatever the base dtype. With a
    float `bnb_4bit_quant_storage` (sharded QLoRA under FSDP) the upcast is skipped, so every base parameter
    keeps the one dtype that FSDP shards (the storage dtype equals `dtype`, checked up front).
    """
    from peft import get_peft_model, prepare_model_for_kbit_training  # peft imports bitsandbytes

    model = load_base_model(recipe, load_kwargs)
    quantized = recipe.load_in_4bit or recipe.load_in_8bit
    if quantized and not (recipe.load_in_4bit and recipe.bnb_4bit_quant_storage != "uint8"):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recipe.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=CHECKPOINTING)
    elif recipe.gradient_checkpointing:
        enable_activation_checkpointing(model)
    # all-linear on a mixture-of-experts model also adapts its fused 3-D expert weights, through peft's
    # ParamWrapper, which refuses lora_dropout != 0: the working setting is chosen and said at start-up.
    dropout, notes = None, []
    experts = fused_expert_parameters(model)
    if experts and recipe.lora_target_modules == ["all-linear"] and recipe.lora_dropout != 0:
        dropout = 0.0
        notes.append(f"lora_dropout {recipe.lora_dropout} -> 0: all-linear adapts this mixture-of-experts model's "
                     f"fused expert weights ({len(experts)} tensors) through peft's ParamWrapper, which has no "
                     "dropout; name attention/dense layers in lora_target_modules to keep dropout there")
    config = lora_config(recipe, dropout)
    if tied := tied_modules_adapted(model, recipe):
        # the model's input and output embeddings are one tensor: their trained copies must stay one too (peft
        # adds the other one to modules_to_save and ties the two copies), or they would train apart
        config.ensure_weight_tying = True
        notes.append(f"{', '.join(tied)}: this model ties its input embedding and output projection, so their "
                     "trained copies are kept as one tensor (peft's ensure_weight_tying), as in the base model")
    if vision.is_image_text(model.config) and recipe.lora_target_modules == ["all-linear"]:
        config.target_modules = vision.lora_targets(model, recipe)  # the language model's, unless unfrozen
        notes.append(vision.lora_note(recipe, len(config.target_modules)))
    try:
        with quiet_peft():
            model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:  # e.g. target modules that the model does not have
        raise HftrainError(f"cannot add LoRA adapters to {recipe.model_name_or_path!r}: {first_line(exc)}. Check "
                           "lora_target_modules (all-linear, or names of the model's linear layers) and "
                           "modules_to_save") from None
    base_path = Path(recipe.model_name_or_path).expanduser()
    if base_path.is_dir():  # record a path that still finds the base from another working directory
        model.peft_config["default"].base_model_name_or_path = str(base_path.resolve())
    if recipe.qat_scheme is not None:  # torchao's fake quantization of the frozen base, the adapters in full precision
        notes.append(qat.prepare(model, recipe))
    if recipe.objective == "reward":
        given = f"modules_to_save {list(recipe.modules_to_save)} + " if recipe.modules_to_save else ""
        notes.append(f"LoRA on a reward model: {given}the score head trained whole (modules_to_save: score, as TRL "
                     "recommends; the head is new, drawn at load)")
    model.hftrain_notes = notes  # printed with the start-up lines
    return model


def build_model(recipe: Recipe, load_kwargs: dict | None = None, layers: set[int] | None = None,
                float8_all_gather: bool = False) -> nn.Module:
    """The builder chosen by the recipe's fine-tuning method: full fine-tuning or (Q)LoRA / DoRA, then compiled
    block by block when the recipe asks for it. `load_kwargs`: extra from_pretrained arguments of the parallelism
    backend; `layers`: the decoder layers this process reads (a pipeline stage's; full fine-tuning only: peft
    initialises each adapter from the global generator in module order, so adapters are added over the whole model
    to draw as one process does)."""
    if recipe.use_peft and layers is not None:
        raise HftrainError("a per-stage load (layers) is for full fine-tuning; LoRA loads every layer")
    model = build_peft_model(recipe, load_kwargs or {}) if recipe.use_peft else \
        build_full_model(recipe, load_kwargs or {}, layers, float8_all_gather)
    if recipe.torch_compile:
        compile_blocks(model, recipe.torch_compile_mode)
    return model


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the outermost ModuleLists made of one class (a transformer's decoder layers)."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            blocks += list(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def compile_blocks(model: nn.Module, mode: str | None) -> int:
    """Regional compilation: `torch.compile` each repeated block in place (`nn.Module.compile`, so parameter names
    and state dicts stay those of the eager model). The blocks share one class, so they share compiled code:
    compiling costs about one block, not the whole model. Embeddings, final norm and the loss stay eager.

    Compiled with dynamic shapes from the first call: every micro-batch has another length (and packed ones another
    count and length of documents), and torch's default compiles the first length statically, then again for dynamic
    lengths at the second. Measured on CPU (docs/benchmarks.md, "torch.compile and varying lengths"): packed rows
    through varlen attention compile once instead of twice; sizes 0 and 1 stay specialised (the one-token filler row
    of an epoch's short last step compiles once more)."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise HftrainError(f"torch_compile found no repeated blocks (a ModuleList of decoder layers) in "
                           f"{type(model).__name__}; set torch_compile: false")
    for block in blocks:
        block.compile(mode=mode, dynamic=True)
    return len(blocks)


def model_summary(model: nn.Module) -> dict:
    """What the builder really produced (read from the modules, not from the recipe): method, quantized layers,
    trained and total parameters, layers that recompute their activations in backward (gradient checkpointing).
    Recorded in hftrain_state.json."""
    quantized: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name in ("Linear4bit", "Linear8bitLt") and type(module).__module__.startswith("bitsandbytes"):
            quantized[name] = quantized.get(name, 0) + 1
    adapters = [m for m in model.modules() if hasattr(m, "peft_config")]
    method = "full"
    if adapters:
        config = adapters[0].peft_config["default"]
        method = "dora" if getattr(config, "use_dora", False) else str(config.peft_type.value).lower()
    params = list(model.parameters())
    return {
        "method": method,
        "quantized_linear_layers": quantized,
        "trainable_parameters": sum(parameter_count(p) for p in params if p.requires_grad),
        "parameters": sum(parameter_count(p) for p in params),
        "compiled_blocks": sum(is_compiled(m) for m in model.modules()),
        "attention": attn_implementation(model.config),
        "checkpointed_layers": sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
                                   for m in model.modules()),
    }


def fit_embeddings_to_tokenizer(model: nn.Module, tokenizer) -> int | None:
    """Grow the embeddings when the tokenizer gained tokens (ChatML fallback); returns the new size or None."""
    if len(tokenizer) <= model.get_input_embeddings().num_embeddings:
        return None
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return len(tokenizer)


# Architectures whose logits are exactly `lm_head(last_hidden_state)` in transformers 5.23. Others may
# scale or soft-cap them (Granite `logits_scaling`, Gemma 2/3 soft-capping, Cohere `logit_scale`) and
# take the model's own full-logits path.
HEAD_ONLY_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "olmo2", "gemma"})
# use_liger_kernel: every head-only architecture has an apply_liger_kernel_to_<type> in liger-kernel 0.8.5
# (MODEL_TYPE_TO_APPLY_LIGER_FN); Liger's other types (gemma2/3, granite, ...) transform their logits.
LIGER_MODEL_TYPES = HEAD_ONLY_MODEL_TYPES


def router_coefficient(config, coef: float | None) -> float | None:
    """The router load-balancing loss coefficient a run uses: the recipe's `coef` or, when None, the model config's
    (TRL's rule); None for a model without a router loss (a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text, "output_router_logits"):
        return None
    return float(getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef)


class WrapsCausalLM(nn.Module):
    """A module around a causal LM `self.lm`: what the parallelism backends and accelerate read from the model they
    prepare, forwarded from the causal LM."""

    @property
    def config(self):
        return self.lm.config

    @property
    def _no_split_modules(self) -> list[str] | None:
        """The layer classes FSDP2 wraps one by one (accelerate reads them from the module it prepares): the model's
        own list, less classes it does not contain (LLaVA lists CLIP's text embeddings, which its vision-only CLIP
        lacks, and accelerate refuses a class it cannot find). An image-text model's vision layers and embeddings
        are then units of their own; the whole tower as one unit would break transformers 5.23's capture of its
        hidden states (LLaVA reads them: None under fully_shard)."""
        names = no_split_modules(self.lm)
        if names is None:
            return None
        present = {type(module).__name__ for module in self.lm.modules()}
        return [name for name in names if name in present]

    def generate(self, **kwargs):
        """The causal LM's `generate`, called through this module (the one the strategies prepare): FSDP2 registers
        it as a forward method of the root unit, so that the root's weights are gathered around it (objective
        grpo's sampling, `Backend.generation_context`)."""
        return self.lm.generate(**kwargs)

    def tie_weights(self, *args, **kwargs) -> None:
        """Tie the causal LM's output projection to its input embedding again, where its config says so. accelerate's
        FSDP2 preparation moves the module it prepares to the meta device, which makes tied parameters two, and then
        calls this to make them one tensor again, as transformers models do; without it the tied model's head and
        embedding would be sharded and trained as two copies."""
        self.lm.tie_weights(*args, **kwargs)

    def save_pretrained(self, folder, state_dict: dict | None = None, is_main_process: bool = True) -> None:
        """The causal LM's (or adapter's) from_pretrained folder; `state_dict` as gathered from this wrapper.

        A tied output projection is saved once, under its source's name, as transformers saves an unsharded model: a
        state dict gathered from shards (ZeRO, FSDP2, tensor parallel) holds it as a copy of its own, which
        transformers' alias removal (by storage) cannot see, and the folder would hold the embedding twice."""
        if state_dict is not None:
            state_dict = {k.removeprefix("lm."): v for k, v in state_dict.items()}
        if isinstance(self.lm, PreTrainedModel) and (aliases := held_ties(self.lm)):  # an adapter has no head copy
            state_dict = {k: v for k, v in (self.lm.state_dict() if state_dict is None else state_dict).items()
                          if k not in aliases}
        with deepspeed_probed_by_import():
            self.lm.save_pretrained(folder, state_dict=state_dict, is_main_process=is_main_process)
