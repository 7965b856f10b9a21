"""The quantization-aware training group of the recipe (`qat_scheme`, torchao): its fields and the rules judged from
the recipe alone; the preparation and conversion are in `hftrain/qat.py`, the launch's and the model's checks in the
preflight (`hftrain.qat.preflight_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

QAT_SCHEMES = ("int4_weight_only", "int8_dynamic_activation_int4_weight")
# The objectives whose final/ is not a causal LM folder, which the conversion (hftrain.qat.save_quantized) loads.
NOT_CAUSAL_LM = {
    "reward": "a sequence classifier (its score head)",
    "embedding": "a sentence-transformers folder of the decoder without its head (with pooling and normalize modules)",
    "reranker": "a sentence-transformers CrossEncoder folder (a sequence classifier's score head; the yes_no "
                "form's causal LM head is read through two tokens' logits, a conversion not verified)",
}


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
        "ExecuTorch's 8da4w). With use_peft (LoRA): the frozen base's linear layers are fake-quantized and the "
        "adapters train in full precision; final/ is the adapter and final-quantized/ the base with the adapter "
        "merged, then converted.",
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
    if r.use_peft and (r.load_in_4bit or r.load_in_8bit):
        problems.append(f"qat_scheme={r.qat_scheme} with load_in_4bit/load_in_8bit (QLoRA) is refused: the base is "
                        "already rounded by bitsandbytes, and torchao's fake quantization needs the full-precision "
                        "nn.Linear weights; use LoRA on the unquantized base (load_in_4bit: false)")
    if r.use_peft and r.use_dora:
        problems.append(f"qat_scheme={r.qat_scheme} with use_dora is refused: DoRA's magnitude is computed from the "
                        "base weight unquantized, not from the fake-quantized one the layer computes with; use LoRA "
                        "(use_dora: false)")
    if r.use_peft and r.modules_to_save:
        problems.append(f"qat_scheme={r.qat_scheme} with modules_to_save {list(r.modules_to_save)} is refused: the "
                        "layers peft trains whole beside the adapters are not verified under fake quantization; "
                        "leave modules_to_save empty")
    if r.objective in NOT_CAUSAL_LM:
        problems.append(f"qat_scheme={r.qat_scheme} with objective {r.objective} is refused: final-quantized/ is "
                        "final/ loaded as a causal LM (AutoModelForCausalLM with TorchAoConfig) and saved, but this "
                        f"objective's final/ is {NOT_CAUSAL_LM[r.objective]}: that load would give the converted "
                        "model a freshly drawn output head (and drop the rest of the folder), a model that does not "
                        "compute what was trained. Train without qat_scheme (and quantize the trained model with the "
                        "library that serves it), or fine-tune a causal LM (sft, dpo, kto, orpo, grpo, distill)")
    for name in ("tp_size", "pp_size", "ep_size", "sp_size", "cp_size"):
        if getattr(r, name) > 1:
            problems.append(f"qat_scheme={r.qat_scheme} with {name}={getattr(r, name)} is refused: fake quantization "
                            "is verified on one process and under DDP only; use one of those layouts")
    return problems
