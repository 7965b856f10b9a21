"""Quantization-aware training with torchao (`qat_scheme`): the model's linear layers, the output head excepted, train
through torchao's fake quantization (`QATConfig(base, step="prepare")`), and the trained model is converted to real
quantized weights at the end: final/ is saved as for any run (the trained weights, unconverted: FakeQuantizedLinear
keeps nn.Linear's parameter names), then final-quantized/ is transformers' load of final/ with
`TorchAoConfig(base)`, which applies the same post-training config that torchao's convert step applies after
swapping FakeQuantizedLinear back to nn.Linear, saved with save_pretrained (its config.json names the TorchAoConfig,
so `AutoModelForCausalLM.from_pretrained` loads it quantized, torchao installed).

Both schemes quantize the weights to int4 per group of `qat_group_size` input features, symmetric, one scale per
group (torchao's IntxUnpackedToInt8Tensor: plain PyTorch, CPU and CUDA); int8_dynamic_activation_int4_weight also
quantizes each token's activations to int8 (asymmetric) at run time. Checked on torchao 0.18.0 with torch 2.13.

With LoRA (`use_peft`), as torchtune's QAT + LoRA recipe and unsloth's peft integration do it: the same prepare step
after peft added its adapters, on the frozen base only (each adapted layer's `base_layer`, which becomes
FakeQuantizedLinear inside peft's lora.Linear, and the linear layers without an adapter), so a layer computes
F.linear(fq(x), fq(W)) + scaling x B A x, the adapters' path in full precision. final/ is the adapter;
final-quantized/ is the base with the adapter merged (hftrain.merge: W + scaling x B A, in float32), then converted
as above: the served weight is the rounding of the merged weight, within one rounding step of what training
computed (fq(W) + scaling x B A), not equal to it.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, TorchAoConfig

from hftrain.config import Recipe
from hftrain.fields.qat import QAT_SCHEMES
from hftrain.tracking import errors_only

QUANTIZED_DIR = "final-quantized"  # output_dir/final-quantized: the converted model


def quiet_torchao() -> contextlib.AbstractContextManager[None]:
    """torchao's import logs a warning for each CUDA extension it cannot load (on a CPU machine: all of them)."""
    return errors_only("torchao")


def base_config(scheme: str, group_size: int):
    """torchao's post-training config of `scheme`: what the convert step applies, and what the prepare step's fake
    quantization is inferred from (torchao.quantization.qat.fake_quantize_config._infer_fake_quantize_configs)."""
    with quiet_torchao():
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup
    if scheme == "int4_weight_only":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    if scheme == "int8_dynamic_activation_int4_weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    raise ValueError(f"qat_scheme {scheme!r} is not one of {QAT_SCHEMES}")


def adapter_layer(name: str) -> bool:
    """Whether the module named `name` is (inside) one of peft's LoRA adapters (lora_A, lora_B...)."""
    return ".lora_" in f".{name}"


def quantized_layer(model: nn.Module):
    """The filter of the layers quantized: every nn.Linear but the output head (transformers' TorchAoConfig leaves
    the input and output embeddings unquantized by default; the prepare step must fake-quantize what the conversion
    quantizes, no more) and, under peft, but the LoRA adapters (they train in full precision)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {id(head), id(getattr(head, "base_layer", head))}

    def chosen(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and id(module) not in heads and not adapter_layer(name)
    return chosen


def prepare(model: nn.Module, recipe: Recipe) -> str:
    """Fake-quantize `model`'s layers in place (torchao's QAT prepare step; under peft the frozen base's layers);
    returns the start-up line."""
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import FakeQuantizedLinear, QATConfig
    config = base_config(recipe.qat_scheme, recipe.qat_group_size)
    quantize_(model, QATConfig(config, step="prepare"), filter_fn=quantized_layer(model))
    prepared = sum(isinstance(m, FakeQuantizedLinear) for m in model.modules())
    what = (f"{prepared} frozen base linear layers fake-quantized (the LoRA adapters in full precision)"
            if recipe.use_peft else f"{prepared} linear layers fake-quantized")
    saved = "final/ the adapter, {q}/ the base with the adapter merged, converted" if recipe.use_peft else \
        "final/ unconverted, {q}/ converted"
    return (f"qat {recipe.qat_scheme} (torchao, int4 weight groups of {recipe.qat_group_size}): {what}, the head and "
            f"embeddings in full precision; {saved.format(q=QUANTIZED_DIR)}")


def convert(model: nn.Module, recipe: Recipe) -> nn.Module:
    """torchao's QAT convert step on a prepared model, in place: FakeQuantizedLinear back to nn.Linear, then the
    scheme's post-training config (real int4 weights)."""
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig
    quantize_(model, QATConfig(base_config(recipe.qat_scheme, recipe.qat_group_size), step="convert"))
    return model


def save_quantized(recipe: Recipe, source: Path, folder: Path, tokenizer) -> Path:
    """final-quantized/: the trained model's folder `source` (final/, or, for an adapter, final/ merged into its base
    by the caller: `finetune.Finetune.save_quantized`) loaded by transformers with TorchAoConfig of the scheme
    (quantized while loading) and saved with its tokenizer; written to a temporary folder and renamed when
    complete."""
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_torchao():
        quantized = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, recipe.dtype),
            quantization_config=TorchAoConfig(base_config(recipe.qat_scheme, recipe.qat_group_size)))
        quantized.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def preflight_problems(recipe: Recipe, model_config) -> list[str]:
    """qat_scheme with a group size that does not divide a quantized layer's inputs. Sharded launches need no rule:
    FSDP2 and DeepSpeed ZeRO-3 gather each wrapped module's whole weights before its forward, so torchao's fake
    quantization sees whole weight rows (its groups) as in one process."""
    if recipe.qat_scheme is None:
        return []
    problems = []
    if model_config is not None:
        text = model_config.get_text_config()
        heads = getattr(text, "num_attention_heads", 0) * (getattr(text, "head_dim", None) or
                                                           text.hidden_size // max(text.num_attention_heads, 1))
        sizes = {"hidden_size": text.hidden_size, "intermediate_size": getattr(text, "intermediate_size", None),
                 "num_attention_heads x head_dim": heads}
        uneven = [f"{name} {size}" for name, size in sizes.items() if size and size % recipe.qat_group_size]
        if uneven:
            problems.append(f"qat_group_size={recipe.qat_group_size} does not divide the input size of this model's "
                            f"linear layers ({', '.join(uneven)}): torchao quantizes each weight row in whole groups; "
                            "choose a power of two that divides them")
    return problems
