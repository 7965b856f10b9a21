"""What a launch preset (accelerate_configs/*.yaml) tells hftrain beyond accelerate's own keys: the recipe layout it
is written for, and the device it is for.

A preset made for one parallel layout declares it in a comment line, which accelerate ignores and hftrain reads:

    # hftrain-needs: pp_size > 1; without it use cpu_ddp

With that recipe field left at 1, the preset's processes would quietly train another layout (plain data parallelism,
or the preset's ZeRO / FSDP2 alone), so such a recipe is refused, naming the preset that trains that way on purpose.
`hftrain launch` checks the preset it starts, and the recipe check checks the recipe's own launch_preset.

A preset made for GPUs (single_gpu, multi_gpu, pp, zero3_sp) declares it too, naming its CPU twin:

    # hftrain-device: cuda; without it use cpu_ddp

Where torch sees no CUDA device (no GPU or driver, or a CPU build of torch on a GPU machine) accelerate would start
the preset's processes on the CPU (over gloo), silently: `hftrain launch` refuses instead, before any process starts.
The recipe check does not look at the machine (a recipe for a GPU is previewed and validated anywhere).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

NEEDS = re.compile(r"^# hftrain-needs: (\w+) > 1; without it use (.+)$", re.M)
DEVICE = re.compile(r"^# hftrain-device: cuda; without it use (\w+)$", re.M)
LAYOUTS = {"pp_size": "pipeline parallelism", "tp_size": "tensor parallelism",
           "sp_size": "sequence parallelism (DeepSpeed Ulysses)", "cp_size": "context parallelism (ring attention)"}


def needs(preset: Path) -> tuple[str, str] | None:
    """The recipe field a preset needs above 1 and the preset to use without it; None for a preset of any layout."""
    found = NEEDS.search(preset.read_text(encoding="utf-8"))
    return (found.group(1), found.group(2).strip()) if found else None


def layout_problems(preset: Path, recipe) -> list[str]:
    """The recipe leaves at 1 the field that `preset` is written for."""
    need = needs(preset)
    if need is None or getattr(recipe, need[0]) > 1:
        return []
    field, instead = need
    return [f"the launch preset {preset.stem} is for {LAYOUTS[field]} ({field} > 1) but the recipe has {field}=1, so "
            f"its processes would train without it, as the {instead} preset does; set {field} (e.g. --{field} 2, a "
            f"divisor of the number of processes), or launch with --preset {instead.split()[0]}"]


def cpu_twin(preset: Path) -> str | None:
    """The CPU preset to use instead of `preset` where there is no CUDA device; None for a preset of any device."""
    found = DEVICE.search(preset.read_text(encoding="utf-8"))
    return found.group(1) if found else None


def device_problems(preset: Path, cuda: Callable[[], bool], torch_version: Callable[[], str]) -> list[str]:
    """`preset` is for GPUs but `cuda()` says torch sees none (asked only of such a preset: it imports torch)."""
    twin = cpu_twin(preset)
    if twin is None or cuda():
        return []
    return [f"the launch preset {preset.stem} is for CUDA GPUs, but torch {torch_version()} sees none here "
            "(torch.cuda.is_available() is False: no GPU or driver on this machine, or a CPU build of torch), so it "
            f"would train on the CPU instead; launch with --preset {twin} to train on this CPU, or install a CUDA "
            "build of torch where the GPUs are"]
