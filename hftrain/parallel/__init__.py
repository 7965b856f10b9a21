"""How a run is spread over processes: one backend with its transforms, chosen once when the Accelerator is made.

    launch = Launch.from_environ()                 # what `accelerate launch` asked for (launch.py)
    accelerator = make_accelerator(recipe, launch)
    backend = resolve(accelerator, recipe, launch)  # Backend: the interface the loop calls
    backend.record                                  # Parallelism: kind, processes, ZeRO stage, offload, tp, dp world
    backend.checkpoints                             # checkpoint I/O (checkpoint_io.py), called by hftrain.checkpoint

A layout is the record (`ParallelDims`, dims.py: the strategy and the degree of each axis, built once from the recipe
and the launch) run by the backend that holds the model (`BACKENDS[(strategy, the axes it runs)]`: the strategy's
wrapper, tensor parallelism at load, pipeline stages) with the other axes applied over it as transforms, in one
fixed order (`TRANSFORMS`: cp's ring attention, sp's Ulysses attention), and its checkpoint I/O a component of its
own (`layout_of`).

Backends, one file each: base.py (the interface and `Transform`; one process and DDP), fsdp.py (FSDP2), deepspeed.py
(ZeRO 1-3, offload), tensor.py (tensor parallel, with data-parallel copies, or FSDP2 x TP under an FSDP2 preset),
pipeline.py (pipeline stages through torch.distributed.pipelining, with data-parallel copies, or each stage sharded
by FSDP2 under an FSDP2 preset). Transforms: sequence.py (DeepSpeed's Ulysses sequence parallelism), context.py
(torch's ring attention context parallelism). checkpoint_io.py: one checkpoint component per way of holding state.
Nothing else in hftrain asks accelerate, the environment or the DeepSpeed JSON which strategy
runs. The parallelism fields of the recipe and the rules judged from the recipe alone (`problems`) are
`hftrain/fields/parallel.py`; the rules that need the launch or the model config are in `hftrain/preflight.py`.
"""

from __future__ import annotations

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.fields.parallel import problems
from hftrain.parallel.base import Backend, DataParallel, Parallelism, Transform
from hftrain.parallel.context import RingAttention
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.dims import ParallelDims
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch, devices_record, make_accelerator, not_selected, phase, run_process
from hftrain.parallel.pipeline import PipelineBackend, PipelineFSDP2Backend
from hftrain.parallel.sequence import UlyssesAttention
from hftrain.parallel.tensor import FSDP2TensorParallelBackend, TensorParallelBackend

__all__ = ["Backend", "DataParallel", "Launch", "ParallelDims", "Parallelism", "Transform", "devices_record",
           "layout_of", "make_accelerator", "phase", "problems", "resolve", "run_process"]

SELECTED = {"fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}  # accelerate's DistributedType names


def resolve(accelerator, recipe: Recipe, launch: Launch) -> Backend:
    """The backend of this launch, after checking that accelerate selected the strategy the preset asked for."""
    selected = str(accelerator.distributed_type).split(".")[-1]
    wanted = SELECTED.get(launch.kind)
    if wanted is not None and selected != wanted:
        raise HftrainError(not_selected(wanted, selected))
    backend, transforms = layout_of(ParallelDims.build(recipe, launch))
    return backend(accelerator, recipe, transforms=transforms)


def layout_of(dims: ParallelDims) -> tuple[type[Backend], tuple[type[Transform], ...]]:
    """What runs `dims`'s layout: the backend that holds the model (`BACKENDS[(strategy, the axes it runs)]`) and the
    transforms of the other axes over it (`TRANSFORMS`, in their order), each checked against the strategy and the
    axes beside it. The preflight refuses every other combination before the accelerator is made, each with its
    reason; this refusal is the backstop."""
    transforms = tuple(TRANSFORMS[axis] for axis in TRANSFORMS if axis in dims.axes)
    held = dims.axes.difference(TRANSFORMS)
    backend = BACKENDS.get((dims.strategy, held))
    if backend is None or any(dims.strategy not in t.strategies or not held <= t.beside for t in transforms):
        axes = " x ".join(sorted(dims.axes)) or "data parallelism alone"
        raise HftrainError(f"no hftrain backend runs {axes} under a {dims.strategy} launch ({dims.describe()}); "
                           "docs/architecture.md lists the layouts that run")
    return backend, transforms


_NONE, _TP, _PP, _PP_TP = frozenset(), frozenset({"tp"}), frozenset({"pp"}), frozenset({"pp", "tp"})
# (strategy, the axes it runs itself) -> the backend that holds the model. tp under a DDP-type launch holds whole
# copies of tp-split weights; tp under FSDP2 is the 2D layout; pp under FSDP2 shards each stage over its
# data-parallel ranks; ep is one more degree of the layout transformers loads and FSDP2-wraps itself.
BACKENDS: dict[tuple[str, frozenset[str]], type[Backend]] = {
    ("single", _NONE): Backend,
    ("ddp", _NONE): Backend,
    ("fsdp2", _NONE): FSDP2Backend,
    ("deepspeed", _NONE): DeepSpeedBackend,
    ("ddp", _TP): TensorParallelBackend,
    ("fsdp2", _TP): FSDP2TensorParallelBackend,
    ("ddp", _PP): PipelineBackend,
    ("ddp", _PP_TP): PipelineBackend,
    ("fsdp2", _PP): PipelineFSDP2Backend,
    # expert parallelism: transformers' layout (experts over ep, the rest FSDP2-sharded by transformers) under either
    ("ddp", frozenset({"ep"})): FSDP2TensorParallelBackend,
    ("fsdp2", frozenset({"ep"})): FSDP2TensorParallelBackend,
}
# axis -> the transform that applies it over whichever backend holds the model (its `strategies` and `beside` say
# where it runs), in the order they are applied: the sequence axes, each rewriting the loss module's forward and
# holding every micro-batch's forward and backward inside its attention's context.
TRANSFORMS: dict[str, type[Transform]] = {
    "cp": RingAttention,
    "sp": UlyssesAttention,
}
