"""FP8 training (`fp8: true`) with torchao's float8 linear layers: which layers convert, the conversion, and the
machine's refusal.

The choice is torchao's advice for the recipe (`compat.torchao.float8_layer_filter`: dimensions multiples of 16,
large enough for float8 to pay), never the output head (its logits feed the loss; torchao and torchtitan keep it in
high precision). It is computed without converting (`float8_layers`), so the CPU suite tests it on a model of real
dimensions built on the meta device.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hftrain.compat.torchao import float8_layer_filter
from hftrain.config import Recipe

MIN_CAPABILITY = (8, 9)  # float8 matmuls (torch._scaled_mm): Ada (8.9), Hopper (9.0) and later


def head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, module in model.named_modules() if module is head), None)


def layer_filter(model: nn.Module, recipe_name: str):
    """The module_filter_fn: torchao's for `recipe_name`, the output head excluded."""
    head = head_name(model)
    chosen = float8_layer_filter(recipe_name, [])

    def keep(module: nn.Module, name: str) -> bool:
        return name != head and chosen(module, name)
    return keep


def float8_layers(model: nn.Module, recipe_name: str) -> tuple[list[str], list[str]]:
    """(the linear layers that become Float8Linear, those that stay in high precision), by name."""
    keep = layer_filter(model, recipe_name)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [n for n, m in linears if keep(m, n)], [n for n, m in linears if not keep(m, n)]


def float8_all_gather(recipe: Recipe, launch_kind: str) -> bool:
    """Whether FSDP2 gathers the float8 layers' weights in float8: fp8 under FSDP2 with the tensorwise recipe (the only
    one torchao's float8 all-gather supports), as `fp8_fsdp_all_gather` asks."""
    return recipe.fp8 and recipe.fp8_fsdp_all_gather and recipe.fp8_recipe == "tensorwise" and launch_kind == "fsdp2"


def convert(model: nn.Module, recipe: Recipe, all_gather: bool = False) -> str:
    """torchao's convert_to_float8_training on the chosen layers, in place; returns the start-up line. `all_gather`
    (`float8_all_gather`): their weights become torchao's WeightWithDynamicFloat8CastTensor, which FSDP2 gathers in
    float8 (`enable_fsdp_float8_all_gather`); `precompute_scales_after_step` then keeps their scales."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen, kept = float8_layers(model, recipe.fp8_recipe)
    config = Float8LinearConfig.from_recipe_name(recipe.fp8_recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=layer_filter(model, recipe.fp8_recipe))
    gathered = "; FSDP2 gathers their weights in float8" if all_gather else ""
    return (f"fp8 {recipe.fp8_recipe} (torchao float8): {len(chosen)} linear layers in float8, {len(kept)} kept in "
            f"high precision (the head and those too small or not multiples of 16){gathered}")


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """After each step of `optimizer`, torchao's precompute_float8_dynamic_scale_for_fsdp on `model`: the float8 scale
    of every weight FSDP2 gathers in float8, from the updated shards in one all-reduce (torchao's float8 all-gather
    needs it after the optimizer step). Returns the hook's handle."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def preflight_problems(recipe: Recipe, cuda: bool, capability: tuple[int, int] | None, launch_kind: str) -> list[str]:
    """fp8 where float8 matmuls cannot run, or under a strategy hftrain does not run it with."""
    if not recipe.fp8:
        return []
    problems = []
    if not cuda:
        problems.append("fp8 needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or later: torchao's float8 "
                        "matmuls run on their float8 tensor cores) and this machine has none; set fp8: false (bf16: "
                        "true is the mixed precision for CPU)")
    elif capability is not None and tuple(capability) < MIN_CAPABILITY:
        problems.append(f"fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or later) and this one has "
                        f"{capability[0]}.{capability[1]}: it has no float8 tensor cores; set fp8: false and train in "
                        "bf16")
    if launch_kind == "deepspeed":
        problems.append("fp8 with DeepSpeed is refused: torchao's float8 training composes with FSDP2 (and DDP), not "
                        "with ZeRO's flattened parameters; use an FSDP2 or DDP preset")
    return problems


def device_capability(recipe: Recipe, cuda: bool) -> tuple[int, int] | None:
    """This machine's GPU compute capability where the recipe asks for fp8 (the only rule that reads it), else None:
    the preflight of every other run asks CUDA nothing."""
    return torch.cuda.get_device_capability() if cuda and recipe.fp8 else None
