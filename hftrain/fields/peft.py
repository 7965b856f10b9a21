"""The peft and quantization groups of the recipe (LoRA / DoRA with peft, QLoRA with a bitsandbytes base): their
fields (`PeftFields`) and the rules judged from the recipe alone (`problems`); the builders are in `hftrain/model.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f


@dataclass
class PeftFields:
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


def problems(r) -> list[str]:
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
