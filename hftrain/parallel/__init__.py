"""How a run is spread over processes: one backend per strategy, chosen once when the Accelerator is made.

    launch = Launch.from_environ()                 # what `accelerate launch` asked for (launch.py)
    accelerator = make_accelerator(recipe, launch)
    backend = resolve(accelerator, recipe, launch)  # Backend: the interface the loop and checkpoints call
    backend.record                                  # Parallelism: kind, processes, ZeRO stage, offload, tp, dp world

Backends, one file each: base.py (the interface; one process and DDP), fsdp.py (FSDP2), deepspeed.py (ZeRO 1-3,
offload), tensor.py (tensor parallel, with data-parallel copies, or FSDP2 x TP under an FSDP2 preset), sequence.py
(ZeRO with DeepSpeed's Ulysses sequence parallelism), context.py (FSDP2 with torch's ring attention context
parallelism), pipeline.py (pipeline stages through torch.distributed.pipelining, with data-parallel copies, or
each stage sharded by FSDP2 under an FSDP2 preset).
Nothing else in hftrain asks accelerate, the environment or the DeepSpeed JSON which strategy
runs. The parallelism fields of the recipe and the rules judged from the recipe alone (`problems`) are
`hftrain/recipe/parallel.py`; the rules that need the launch or the model config are in `hftrain/preflight.py`.
"""

from __future__ import annotations

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.parallel.base import Backend, DataParallel, Parallelism
from hftrain.parallel.context import ContextParallelBackend, TensorContextParallelBackend
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch, devices_record, make_accelerator, not_selected, phase, run_process
from hftrain.parallel.pipeline import PipelineBackend, PipelineFSDP2Backend
from hftrain.parallel.sequence import SequenceParallelBackend
from hftrain.parallel.tensor import FSDP2TensorParallelBackend, TensorParallelBackend
from hftrain.recipe.parallel import problems

__all__ = ["Backend", "DataParallel", "Launch", "Parallelism", "devices_record", "make_accelerator", "phase",
           "problems", "resolve", "run_process"]

SELECTED = {"fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}  # accelerate's DistributedType names


def resolve(accelerator, recipe: Recipe, launch: Launch) -> Backend:
    """The backend of this launch, after checking that accelerate selected the strategy the preset asked for."""
    selected = str(accelerator.distributed_type).split(".")[-1]
    wanted = SELECTED.get(launch.kind)
    if wanted is not None and selected != wanted:
        raise HftrainError(not_selected(wanted, selected))
    if recipe.pp_size > 1:  # tp_size runs inside its stages; the recipe and preflight refused sp/cp, DeepSpeed
        # FSDP2 presets shard each stage over its data-parallel ranks; DDP-type ones hold whole copies
        return (PipelineFSDP2Backend if selected == "FSDP" else PipelineBackend)(accelerator, recipe)
    if recipe.tp_size > 1 and selected == "FSDP":  # the 2D layout; the preflight has refused TP with DeepSpeed
        return (TensorContextParallelBackend if recipe.cp_size > 1 else FSDP2TensorParallelBackend)(accelerator,
                                                                                                      recipe)
    if recipe.tp_size > 1:
        return TensorParallelBackend(accelerator, recipe)
    if recipe.sp_size > 1:  # the preflight has refused sequence parallelism without DeepSpeed
        return SequenceParallelBackend(accelerator, recipe)
    if selected == "FSDP" and recipe.cp_size > 1:
        return ContextParallelBackend(accelerator, recipe)
    if selected == "FSDP":
        return FSDP2Backend(accelerator, recipe)
    if selected == "DEEPSPEED":
        return DeepSpeedBackend(accelerator, recipe)
    return Backend(accelerator, recipe)
