"""What a launch preset (accelerate_configs/*.yaml) tells hftrain beyond accelerate's own keys: the recipe layout it
is written for.

A preset made for one parallel layout declares it in a comment line, which accelerate ignores and hftrain reads:

    # hftrain-needs: pp_size > 1; without it use cpu_ddp

With that recipe field left at 1, the preset's processes would quietly train another layout (plain data parallelism,
or the preset's ZeRO / FSDP2 alone), so such a recipe is refused, naming the preset that trains that way on purpose.
`hftrain launch` checks the preset it starts, and the recipe check checks the recipe's own launch_preset.
"""

from __future__ import annotations

import re
from pathlib import Path

NEEDS = re.compile(r"^# hftrain-needs: (\w+) > 1; without it use (.+)$", re.M)
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
