"""The Accelerator for this machine and launch: device, process group backend, precision.

The launch preset (accelerate_configs/*.yaml) picks the strategy; the recipe picks precision and
accumulation. On a machine without CUDA the processes run on CPU with gloo: `Accelerator(cpu=True)`
is what makes a multi-process CPU launch a real gloo DDP group (a yaml's `use_cpu` alone is not
passed on by accelerate's launcher). DeepSpeed is the exception: `cpu=True` would silently turn it
into DDP, so there the gloo backend is requested explicitly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import torch

from hftrain import strategy
from hftrain.config import Recipe, quantization_launch_problems
from hftrain.errors import HftrainError


def launched_with_deepspeed() -> bool:
    return strategy.launched_with("DEEPSPEED")


def launched_strategy(environ=os.environ) -> tuple[str, int | None]:
    """('fsdp' | 'deepspeed' | 'ddp' | 'none', ZeRO stage or None) as `accelerate launch` passed them on."""
    if strategy.launched_with("FSDP", environ):
        return "fsdp", None
    if strategy.launched_with("DEEPSPEED", environ):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        config_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if stage is None and config_file and os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                stage = json.load(f).get("zero_optimization", {}).get("stage")
        return "deepspeed", int(stage) if str(stage).isdigit() else None
    return ("ddp" if int(environ.get("WORLD_SIZE", "1")) > 1 else "none"), None


def preset_conflicts(recipe: Recipe) -> list[str]:
    """Settings the launch preset and the recipe both make, differently."""
    problems = quantization_launch_problems(recipe, *launched_strategy())
    preset_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    recipe_precision = "bf16" if recipe.bf16 else "fp16" if recipe.fp16 else "no"
    if preset_precision not in ("no", recipe_precision):
        problems.append(f"the accelerate preset sets mixed_precision={preset_precision} but the recipe has "
                        f"bf16={recipe.bf16}, fp16={recipe.fp16}; precision comes from the recipe: set it there "
                        "and use mixed_precision: 'no' in the preset")
    return problems + strategy.launch_problems(recipe)


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    # Naming a backend makes accelerate start a process group, so only DeepSpeed on CPU names one (gloo);
    # otherwise accelerate chooses (NCCL on GPU, gloo under cpu=True) and only the timeout is set.
    group = {"backend": "gloo"} if launched_with_deepspeed() and not cuda else {}
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.ddp_timeout), **group)]
    accelerator = Accelerator(
        cpu=not cuda and not launched_with_deepspeed(),
        mixed_precision="bf16" if recipe.bf16 else "fp16" if recipe.fp16 else "no",
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        log_with=[t for t in recipe.report_to if t != "none"] or None,
        project_dir=recipe.output_dir,
        kwargs_handlers=handlers,
    )
    strategy.check_selected(accelerator)
    if launched_with_deepspeed():
        strategy.fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, recipe,
                                       accelerator.num_processes)
    return accelerator


def launch_info(accelerator, model, optimizer) -> dict:
    """What actually runs: recorded in every checkpoint so a silent fallback (e.g. to one process) shows."""
    import torch.distributed as dist

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))  # set by torchrun
    return {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "num_processes": accelerator.num_processes,
        "num_machines": accelerator.num_processes // per_node,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "model_wrapper": type(model).__name__,
        "tp_size": strategy.tp_size(accelerator, model),
        "dtensor_parameters": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
        "optimizer": strategy.innermost_optimizer(optimizer),
        "mixed_precision": accelerator.mixed_precision,
        "device": str(accelerator.device),
        "sharded_modules": strategy.sharded_modules(model),
        "deepspeed_config": strategy.deepspeed_config_used(accelerator),
    }


@contextmanager
def phase(accelerator, name: str | Callable[[], str], timeout: int):
    """Turn a collective timeout inside `name` into a message naming the rank and the phase (`name` may be a
    function, called when the timeout happens, e.g. to name the optimizer step)."""
    try:
        yield
    except RuntimeError as exc:  # gloo and NCCL report timeouts as RuntimeError subclasses (DistBackendError)
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise HftrainError(
            f"rank {accelerator.process_index} of {accelerator.num_processes} timed out after {timeout}s waiting for "
            f"the other ranks during {name() if callable(name) else name}; a rank may have died (see its log above) "
            "or be much slower (raise ddp_timeout if rank 0 needs longer, e.g. to tokenize a large dataset)"
        ) from None
