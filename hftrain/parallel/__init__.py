"""How a run is spread over processes: one backend per strategy, chosen once when the Accelerator is made.

    launch = Launch.from_environ()                 # what `accelerate launch` asked for (launch.py)
    accelerator = make_accelerator(recipe, launch)
    backend = resolve(accelerator, recipe, launch)  # Backend: the interface the loop and checkpoints call
    backend.record                                  # Parallelism: kind, processes, ZeRO stage, offload, tp, dp world

The backend is the one `BACKENDS` names for the layout record (`ParallelDims`, dims.py: the strategy and the degree
of each axis, built once from the recipe and the launch).

Backends, one file each: base.py (the interface; one process and DDP), fsdp.py (FSDP2), deepspeed.py (ZeRO 1-3,
offload), tensor.py (tensor parallel, with data-parallel copies, or FSDP2 x TP under an FSDP2 preset), sequence.py
(ZeRO with DeepSpeed's Ulysses sequence parallelism), context.py (FSDP2 with torch's ring attention context
parallelism), pipeline.py (pipeline stages through torch.distributed.pipelining, with data-parallel copies, or
each stage sharded by FSDP2 under an FSDP2 preset).
Nothing else in hftrain asks accelerate, the environment or the DeepSpeed JSON which strategy
runs. The parallelism fields of the recipe and the rules judged from the recipe alone (`problems`) are
`hftrain/fields/parallel.py`; the rules that need the launch or the model config are in `hftrain/preflight.py`.
"""

from __future__ import annotations

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.fields.parallel import problems
from hftrain.parallel.base import Backend, DataParallel, Parallelism
from hftrain.parallel.context import ContextParallelBackend, TensorContextParallelBackend
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.dims import ParallelDims
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch, devices_record, make_accelerator, not_selected, phase, run_process
from hftrain.parallel.pipeline import PipelineBackend, PipelineFSDP2Backend
from hftrain.parallel.sequence import SequenceParallelBackend
from hftrain.parallel.tensor import FSDP2TensorParallelBackend, TensorParallelBackend

__all__ = ["Backend", "DataParallel", "Launch", "ParallelDims", "Parallelism", "devices_record", "make_accelerator",
           "phase", "problems", "backend_class", "resolve", "run_process"]

SELECTED = {"fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}  # accelerate's DistributedType names


def resolve(accelerator, recipe: Recipe, launch: Launch) -> Backend:
    """The backend of this launch, after checking that accelerate selected the strategy the preset asked for."""
    selected = str(accelerator.distributed_type).split(".")[-1]
    wanted = SELECTED.get(launch.kind)
    if wanted is not None and selected != wanted:
        raise HftrainError(not_selected(wanted, selected))
    return backend_class(ParallelDims.build(recipe, launch))(accelerator, recipe)


def backend_class(dims: ParallelDims) -> type[Backend]:
    """The backend that runs `dims`'s layout: one per (strategy, model-splitting axes) in `BACKENDS`. The preflight
    refuses every other combination before the accelerator is made, each with its reason."""
    try:
        return BACKENDS[dims.strategy, dims.axes]
    except KeyError:
        axes = " x ".join(sorted(dims.axes)) or "data parallelism alone"
        raise HftrainError(f"no hftrain backend runs {axes} under a {dims.strategy} launch ({dims.describe()}); "
                           "docs/architecture.md lists the layouts that run") from None


_NONE, _TP, _PP, _PP_TP = frozenset(), frozenset({"tp"}), frozenset({"pp"}), frozenset({"pp", "tp"})
# (strategy, axes) -> backend. tp under a DDP-type launch holds whole copies of tp-split weights; tp under FSDP2 is
# the 2D layout; pp under FSDP2 shards each stage over its data-parallel ranks; ep is one more degree of the layout
# transformers loads and FSDP2-wraps itself.
BACKENDS: dict[tuple[str, frozenset[str]], type[Backend]] = {
    ("single", _NONE): Backend,
    ("ddp", _NONE): Backend,
    ("fsdp2", _NONE): FSDP2Backend,
    ("deepspeed", _NONE): DeepSpeedBackend,
    ("ddp", _TP): TensorParallelBackend,
    ("fsdp2", _TP): FSDP2TensorParallelBackend,
    ("fsdp2", frozenset({"cp"})): ContextParallelBackend,
    ("fsdp2", frozenset({"cp", "tp"})): TensorContextParallelBackend,
    ("deepspeed", frozenset({"sp"})): SequenceParallelBackend,
    ("ddp", _PP): PipelineBackend,
    ("ddp", _PP_TP): PipelineBackend,
    ("fsdp2", _PP): PipelineFSDP2Backend,
    # expert parallelism: transformers' layout (experts over ep, the rest FSDP2-sharded by transformers) under either
    ("ddp", frozenset({"ep"})): FSDP2TensorParallelBackend,
    ("fsdp2", frozenset({"ep"})): FSDP2TensorParallelBackend,
}
