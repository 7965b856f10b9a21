"""transformers internals hftrain uses (checked on transformers 5.25 by the test suite, the lock's version; the uses
marked 5.17 also by CI's lower end, constraints/lower.txt, and read in transformers 5.17's source; every one also on
5.23 and 5.24, whose source has each of them as 5.25 has: in 5.25 `ReplicatedWithGradAllReduce` installs its hook
from a forward pre-hook instead of a wrapped forward, the same post-accumulate all-reduce of `.grad`).

- the partial load of a pipeline stage (`load_decoder_layers`): a runtime subclass of the model class whose
  `_load_pretrained_model` step swaps the layers another stage owns for parameterless stand-ins, with their keys
  declared expected-unused (`_keys_to_ignore_on_load_unexpected`); the auto class's `_model_mapping` gives the model
  class (5.23: 5.17 has no `_load_pretrained_model` step);
- the checkpoint-name conversions a model reverts on save (`_weight_conversions`; 5.17);
- the attention kernel a loaded model runs (`config._attn_implementation`; 5.17) and the layer classes it must not
  split (`_no_split_modules`; 5.17);
- the backends transformers names on the placeholder it exports for a class whose backend is missing (`_backends`;
  5.17: Idefics3's Pillow image processor needs torchvision there);
- transformers' tensor-parallel device mesh (`_mesh_manager`) and its plan expanded to parameter names
  (`_expand_parallel_plan`), both from its distributed mixin (5.23: 5.17 has neither);
- what its `replicated_with_grad_allreduce` style does to a gradient (`accumulation_safe_partial_gradients`, 5.23);
- the flag by which an experts module split by expert parallelism masks off-rank routes (`_is_expert_parallel`,
  `unmask_dispatched_experts`, 5.23);
- the module-level DeepSpeed config that makes every load partitioned under ZeRO-3 (`_hf_deepspeed_config_weak_ref`,
  `whole_loads`; 5.17).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers.integrations import deepspeed as hf_deepspeed

from hftrain.compat import Use

CHECKED = ">=5.23,<5.26"
CHECKED_SINCE_5_17 = ">=5.17,<5.26"

STAGE_LOAD = Use("transformers", CHECKED, "reading only a pipeline stage's layers (pp_size > 1 with full fine-tuning)")
WEIGHT_CONVERSIONS = Use("transformers", CHECKED_SINCE_5_17,
                         "loading a model (the checkpoint-name conversions it keeps)")
ATTN_IMPLEMENTATION = Use("transformers", CHECKED_SINCE_5_17, "reading the model's attention kernel")
PLACEHOLDER_BACKENDS = Use("transformers", CHECKED_SINCE_5_17, "telling which classes need a missing backend")
NO_SPLIT_MODULES = Use("transformers", CHECKED_SINCE_5_17, "wrapping the model's layers one by one (FSDP2)")
DEVICE_MESH = Use("transformers", CHECKED, "FSDP2 x TP (transformers' device mesh)")
PARALLEL_PLAN = Use("transformers", CHECKED, "estimating a tensor-parallel layout")
PARTIAL_GRADIENTS = Use("transformers", CHECKED, "tensor parallelism of a model whose plan sums partial gradients "
                        "(replicated_with_grad_allreduce: Qwen3's q_norm / k_norm)")
PARTIAL_GRADIENT_STYLE = "replicated_with_grad_allreduce"
EXPERT_SENTINELS = Use("transformers", CHECKED, "expert parallelism's experts without the off-rank route masks")
ZERO3_CONFIG = Use("transformers", CHECKED_SINCE_5_17, "loading a model whole in one process under DeepSpeed ZeRO-3")


def load_decoder_layers(auto_class: type, config, path: str, kwargs: dict, layers: set[int]) -> nn.Module:
    """`auto_class.from_pretrained(path, **kwargs)` that reads only the decoder layers in `layers` (a pipeline
    stage's) from the checkpoint: the other layers stay on the meta device (no memory; their names, shapes, dtypes and
    order kept, so everything that counts or numbers parameters sees the whole model until the pipeline drops them).
    transformers builds the model on the meta device and loads every key its state dict has
    (`convert_and_load_state_dict_in_model`), so the other layers are swapped for parameterless stand-ins in between
    (its `_load_pretrained_model` step, after tensor parallelism is applied and before any weight is read) and their
    checkpoint keys are declared expected to be unused (`_keys_to_ignore_on_load_unexpected`); then the meta layers
    are put back. The embeddings, the final norm and the head load on every rank (a tied head must be tied to a
    loaded embedding; the pipeline drops them where not owned)."""
    STAGE_LOAD.require()
    model_class = auto_class._model_mapping[type(config)]
    skipped: dict[int, nn.Module] = {}

    def load_owned_layers(model, *args, **kwargs):
        decoder = model.get_decoder()
        for index, layer in enumerate(decoder.layers):
            if index not in layers:
                skipped[index] = layer
                decoder.layers[index] = nn.Identity()
        if skipped:
            other = "|".join(str(index) for index in sorted(skipped))
            model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()),
                                                        rf"(^|\.)layers\.({other})\."}
        return model_class._load_pretrained_model(model, *args, **kwargs)

    stage_class = type(model_class.__name__, (model_class,), {
        "_load_pretrained_model": staticmethod(load_owned_layers), "__module__": model_class.__module__})
    model = stage_class.from_pretrained(path, **kwargs)
    model.__class__ = model_class
    decoder = model.get_decoder()
    for index, layer in skipped.items():
        decoder.layers[index] = layer.train(model.training)
    return model


def keep_used_conversions(model: nn.Module) -> None:
    """Keep only the checkpoint-name conversions that matched the checkpoint, so that the final save writes the names
    the checkpoint had whatever the strategy. transformers renames a checkpoint's keys while loading (LLaVA's
    `language_model.model.layers.*` become `model.language_model.layers.*`) and reverts the renamings it keeps in
    `model._weight_conversions` on save_pretrained. Its usual load path keeps the ones that matched; its ZeRO-3 load
    path (5.23, `_load_state_dict_into_zero3_model`) keeps every candidate, and reverting the unused ones on save
    invents names (`language_model.model.model.layers.*`, `vision_tower.vision_model.*`) that only transformers' own
    key mapping reads back. A no-op on the usual path."""
    WEIGHT_CONVERSIONS.require()
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if conversion.was_used()]


def attn_implementation(config) -> str | None:
    """The attention kernel a loaded model runs ("sdpa", "flash_attention_2", "eager", ...)."""
    ATTN_IMPLEMENTATION.require()
    return getattr(config, "_attn_implementation", None)


def needs_missing_backend(cls, backend: str) -> bool:
    """Whether `cls`, as transformers exports it, is a placeholder for a class that needs `backend` (not installed).
    Outside the checked versions: False (the class's own error says it when it is built)."""
    if PLACEHOLDER_BACKENDS.problem() is not None:
        return False
    return backend in (getattr(cls, "_backends", None) or ())


def no_split_modules(lm: nn.Module) -> list[str] | None:
    """The layer classes the model declares that must not be split across devices (FSDP's units), or None."""
    NO_SPLIT_MODULES.require()
    return getattr(lm, "_no_split_modules", None)


def device_mesh(lm: nn.Module, dims: str):
    """The device mesh over `dims` of a model loaded with transformers' `distributed_config` (tensor parallelism)."""
    DEVICE_MESH.require()
    return lm._mesh_manager.get_mesh(dims)


def expanded_parallel_plan(lm: nn.Module, plan: dict[str, str]) -> dict[str, str] | None:
    """transformers' tensor-parallel `plan` expanded to the model's parameter names ({name: style}), None for a
    transformers without it."""
    expand = getattr(lm, "_expand_parallel_plan", None)
    if expand is None:  # 5.17: no expansion, so the estimate counts every weight whole (no tensor-parallel split)
        return None
    PARALLEL_PLAN.require()
    return expand(plan)


def accumulation_safe_partial_gradients(lm: nn.Module, tp: int) -> list[str]:
    """Make the gradients of the weights transformers' tensor-parallel plan marks `replicated_with_grad_allreduce`
    right under gradient accumulation; returns their modules' names. Those weights (Qwen3's per-head q_norm / k_norm)
    are whole on every rank, but each rank's backward covers its own heads only, so transformers sums the gradient
    over the tensor-parallel group with a hook that runs after each backward has accumulated into `.grad`
    (`ReplicatedWithGradAllReduce`: `register_post_accumulate_grad_hook`, `all_reduce(param.grad)`). It sums the
    whole `.grad`, so from the second micro-batch of a step on it sums the earlier micro-batches' already-summed
    gradient again: micro-batch 1 counted tp times (measured: the e2e tp x ep run with 2 micro-batches a step moved
    k_norm by 6e-4 more than one process). A hook on each such weight's incoming gradient, which runs before it is
    accumulated, divides the summed `.grad` by tp first, so the sum after accumulation is the earlier sum plus this
    micro-batch's, on every rank (exact for tp a power of 2). Registered when the module runs, on the parameter it
    runs with, as transformers registers its own: under FSDP2 that is the gathered parameter, whose `.grad`
    accumulates between the steps' reductions. No-op for a model without such weights, and outside the versions whose
    hook was read (5.23-5.25)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # peft: the plan's names are the base's
    plan = {key: style for key, style in (getattr(base, "tp_plan", None) or {}).items()
            if style == PARTIAL_GRADIENT_STYLE}
    if not plan or tp <= 1 or PARTIAL_GRADIENTS.problem() is not None:  # outside 5.23-5.25: its hook unread
        return []
    styles = base._expand_parallel_plan(plan)
    names = [name for name, module in base.named_modules()
             if styles.get(name) == PARTIAL_GRADIENT_STYLE and any(p.requires_grad for p in module.parameters())]
    for name in names:
        base.get_submodule(name).register_forward_pre_hook(_hook_partial_gradients(tp))
    return names


def _hook_partial_gradients(tp: int):
    """A forward pre-hook: `_unsum_accumulated` on each trained parameter the module runs with, once per parameter."""
    hooked: set[int] = set()

    def pre_hook(module, args):
        if not torch.is_grad_enabled():
            return
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in hooked:
                param.register_hook(_unsum_accumulated(param, tp))
                hooked.add(id(param))
    return pre_hook


def _unsum_accumulated(param: nn.Parameter, tp: int):
    def hook(grad):
        if param.grad is not None:
            param.grad.div_(tp)  # the group's sum so far: the all-reduce after accumulation sums it back
        return grad
    return hook


def unmask_dispatched_experts(lm: nn.Module) -> int:
    """Run the experts of a model laid out with `ep_implementation="all_to_all"` without the masks for off-rank
    routes; returns how many experts modules changed. transformers marks every experts module whose weights expert
    parallelism split (`MoEParamShard`: `module._is_expert_parallel = True`) and its experts forwards (grouped_mm,
    batched_mm, the fp8 and DeepGEMM ones) then treat an expert id >= the local expert count as a route to another
    rank's expert (a sentinel, which `AllReduceEP` sends with weight 0): grouped_mm masks the gathered rows before its
    first matmul and the outputs after each of its two (three `masked_fill` in the forward, three more in the
    backward, over every received (token, expert) row). `AllToAllEP` hands the experts only the rows sent to this
    rank, each with a local id (`arange(local experts)` repeated by the received counts), so every mask is all-false:
    an identity forward and backward that cost ~6% of an ep 2 step on CPU (scripts/bench_ep.py's model, profiled).
    Clearing the flag skips them; the experts' arithmetic is the same. Only for the all-to-all dispatch (hftrain's
    `parallel.expert.load_kwargs`): `AllReduceEP` needs the masks. Outside the versions read (5.23-5.25) nothing
    changes."""
    if EXPERT_SENTINELS.problem() is not None:
        return 0
    marked = [module for module in lm.modules() if getattr(module, "_is_expert_parallel", False)]
    for module in marked:
        module._is_expert_parallel = False
    return len(marked)


@contextlib.contextmanager
def whole_loads() -> Iterator[None]:
    """Inside it, `from_pretrained` in this process loads a model whole although DeepSpeed ZeRO-3 is configured:
    while transformers' module-level DeepSpeed config (set by accelerate) says ZeRO-3, every unquantized load is
    partitioned under `zero.Init`, a collective over all processes, which deadlocks when the main process alone loads
    (the merge of a LoRA adapter into its base for final-quantized/). The config is put back on exit."""
    ZERO3_CONFIG.require()
    held = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = held
