"""The FP8 training group of the recipe (`fp8`, torchao's float8 linear layers): its fields and the rules judged from
the recipe alone; the layer choice, conversion and the machine's checks are in `hftrain/fp8.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

FP8_RECIPES = ("tensorwise", "rowwise")


@dataclass
class FP8Fields:
    fp8: bool = _f(
        False, "Train the large linear layers' matmuls in float8 with torchao (pip install 'hftrain[qat]'; "
        "docs/fp8.md): CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell) only, refused elsewhere before "
        "the model loads. The layers torchao advises for the recipe become Float8Linear (dimensions multiples of "
        "16, large enough for float8 to pay); the output head and the smaller layers stay in high precision. The "
        "start-up output lists the choice. Use with bf16: true.", group="training",
    )
    fp8_recipe: str = _f(
        "tensorwise", "fp8: torchao's float8 recipe: tensorwise (one dynamic scale per tensor, the fastest) or "
        "rowwise (a scale per row, more accurate).", group="training", choices=FP8_RECIPES,
    )
    fp8_fsdp_all_gather: bool = _f(
        True, "fp8 under FSDP2 with fp8_recipe tensorwise: gather the float8 layers' weight shards in float8 (1 byte a "
        "weight instead of bf16's 2: half their all-gather traffic and gathered memory), torchao's "
        "enable_fsdp_float8_all_gather, the scales of all such weights computed in one all-reduce after each optimizer "
        "step (precompute_float8_dynamic_scale_for_fsdp). torchao supports it for tensorwise scaling only: rowwise, "
        "one process, DDP gather nothing in float8. The start-up line says whether it is on.", group="training",
    )


def problems(r) -> list[str]:
    """fp8 settings that cannot run, judged from the recipe alone."""
    if not r.fp8:
        return []
    problems = []
    if r.use_peft:
        problems.append("fp8 with use_peft is refused: torchao's float8 conversion swaps nn.Linear layers, which "
                        "peft wraps with its adapters; float8 under LoRA is not built in hftrain. Use fp8 with full "
                        "fine-tuning")
    if r.qat_scheme is not None:
        problems.append(f"fp8 with qat_scheme={r.qat_scheme} is refused: both replace the linear layers (float8 "
                        "training and int4 fake quantization); choose one")
    if r.fp16:
        problems.append("fp8 with fp16 is refused: torchao's float8 training runs beside bf16 autocast (or fp32), "
                        "not fp16's loss scaling; use bf16: true")
    return problems
