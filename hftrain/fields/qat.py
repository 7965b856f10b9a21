"""The quantization-aware training group of the recipe (`qat_scheme`, torchao): its fields and the rules judged from
the recipe alone; the preparation and conversion are in `hftrain/qat.py`, the launch's and the model's checks in the
preflight (`hftrain.qat.preflight_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

QAT_SCHEMES = ("int4_weight_only", "int8_dynamic_activation_int4_weight")


@dataclass
class QATFields:
    qat_scheme: str | None = _f(
        None, "Quantization-aware training with torchao (pip install 'hftrain[qat]'; docs/quantization.md): every "
        "linear layer but the output head trains through torchao's fake quantization of the scheme (QATConfig, step "
        "prepare), so that the model learns the rounding it will be served with; at the end final/ holds the trained "
        "weights unconverted and final-quantized/ the model converted to real quantized weights (torchao's "
        "post-training config of the scheme, which transformers loads through TorchAoConfig). int4_weight_only: int4 "
        "weights in groups of qat_group_size (IntxWeightOnlyConfig); int8_dynamic_activation_int4_weight: the same "
        "weights, and activations quantized to int8 per token at run time (Int8DynamicActivationIntxWeightConfig, "
        "ExecuTorch's 8da4w). Full fine-tuning only.",
        group="quantization", choices=(None, *QAT_SCHEMES),
    )
    qat_group_size: int = _f(
        32, "qat_scheme: input features per weight group (one int4 scale each): a power of two that divides every "
        "quantized layer's input size (hidden_size, intermediate_size...).", group="quantization",
    )


def problems(r) -> list[str]:
    """qat_scheme settings that cannot run, judged from the recipe alone."""
    if r.qat_scheme is None:
        return []
    problems = []
    size = r.qat_group_size
    if size < 1 or size & (size - 1):
        problems.append(f"qat_group_size must be a power of two >= 1, got {size}")
    if r.use_peft:
        problems.append(
            f"qat_scheme={r.qat_scheme} with use_peft is refused: fake-quantizing the frozen base under LoRA adapters "
            "and then merging and converting them is not built in hftrain (peft adds its adapters to nn.Linear "
            "layers, while torchao's prepare step replaces them with FakeQuantizedLinear); train QAT with full "
            "fine-tuning, or LoRA without qat_scheme")
    if r.objective == "reward":
        problems.append(f"qat_scheme={r.qat_scheme} with objective reward is refused: the converted folder is loaded "
                        "as a causal LM (AutoModelForCausalLM with TorchAoConfig), not a sequence classifier")
    for name in ("tp_size", "pp_size", "ep_size", "sp_size", "cp_size"):
        if getattr(r, name) > 1:
            problems.append(f"qat_scheme={r.qat_scheme} with {name}={getattr(r, name)} is refused: fake quantization "
                            "is verified on one process and under DDP only; use one of those layouts")
    return problems
