"""How a run is spread over processes: one backend with its transforms, chosen once when the Accelerator is made.

    launch = Launch.from_environ()                 # what `accelerate launch` asked for (launch.py)
    accelerator = make_accelerator(recipe, launch)
    backend = resolve(accelerator, recipe, launch)  # Backend: the interface the loop calls
    backend.record                                  # Parallelism: kind, processes, ZeRO stage, offload, tp, dp world
    backend.checkpoints                             # checkpoint I/O (checkpoint_io.py), called by hftrain.checkpoint

A layout is the record (`ParallelDims`, dims.py: the strategy and the degree of each axis, built once from the recipe
and the launch) run by one strategy backend (`BACKENDS[(strategy, the axes it holds itself)]`: plain / DDP, FSDP2,
DeepSpeed, or the pipeline, whose step is its own schedule) with every other axis a transform over it (`TRANSFORMS`,
torchtitan's `parallelize_fn` steps), applied in one fixed order at fixed points (`Transform`, base.py): load
(transformers' `DistributedConfig` fields: tp, ep), record, the loss module before the strategy's wrapper (cp, sp), each
micro-batch, frozen copies, generation. The strategy's own step comes last, as torchtitan applies TP, then activation
checkpointing and compile, then FSDP. Checkpoint I/O (checkpoint_io.py) and generation (generation.py) are components of
the layout: the strategy's, or, for a model laid out at load, the laid-out one (`layout_of`).

Strategy backends, one file each: base.py (the interface, `Transform`; one process and DDP, whole copies of a laid-out
model), fsdp.py (FSDP2; a laid-out model sharded by transformers' FSDP2), deepspeed.py (ZeRO 1-3, offload), pipeline/
(pipeline stages through torch.distributed.pipelining, as data-parallel copies, or each stage sharded by FSDP2 under an
FSDP2 preset; tp inside the stages is the tensor-parallel transform over it). Transforms: tensor.py (tensor
parallelism), expert.py (expert parallelism), context.py (torch's ring attention context parallelism), sequence.py
(DeepSpeed's Ulysses sequence parallelism). checkpoint_io.py: one checkpoint component per way of holding state;
generation.py: one generation component per way of holding the model.

Nothing else in hftrain asks accelerate, the environment or the DeepSpeed JSON which strategy
runs. The parallelism fields of the recipe and the rules judged from the recipe alone (`problems`) are
`hftrain/fields/parallel.py`; the rules that need the launch or the model config are in `hftrain/preflight.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.fields.parallel import problems
from hftrain.parallel.base import Backend, DataParallel, Parallelism, Transform
from hftrain.parallel.context import RingAttention
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.dims import ParallelDims
from hftrain.parallel.expert import ExpertParallel
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch, devices_record, make_accelerator, not_selected, phase, run_process
from hftrain.parallel.pipeline import PipelineBackend, ShardedStages
from hftrain.parallel.sequence import UlyssesAttention
from hftrain.parallel.tensor import TensorParallel

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


def layout_of(dims: ParallelDims) -> tuple[Callable[..., Backend], tuple[type[Transform], ...]]:
    """What runs `dims`'s layout: the strategy backend that holds the model (`BACKENDS[(strategy, the axes it holds
    itself)]`: the most axes a backend of the strategy holds, the pipeline's) and the transforms of the other axes
    over it (`TRANSFORMS`, in their order), each checked against the launch's strategy and the axes beside it. A
    transform may need another strategy to hold the model than the launch's (`strategy_for`: expert parallelism,
    transformers' FSDP2 under a DDP-type preset). The preflight refuses every other combination before the
    accelerator is made, each with its reason; this refusal is the backstop."""
    strategy = dims.strategy
    for axis in TRANSFORMS:
        if axis in dims.axes:
            strategy = TRANSFORMS[axis].strategy_for(dims, strategy)
    held = max((axes for (s, axes) in BACKENDS if s == strategy and axes <= dims.axes), key=len, default=None)
    transforms = tuple(TRANSFORMS[axis] for axis in TRANSFORMS if axis in dims.axes - (held or frozenset()))
    if held is None or not all(t.runs_over(dims) for t in transforms):
        axes = " x ".join(sorted(dims.axes)) or "data parallelism alone"
        raise HftrainError(f"no hftrain backend runs {axes} under a {dims.strategy} launch ({dims.describe()}); "
                           "docs/parallelism.md lists the presets and the layouts they run")
    return BACKENDS[(strategy, held)], transforms


_NONE, _PP = frozenset(), frozenset({"pp"})
# (strategy, the axes it holds itself) -> the strategy backend that holds the model: one per strategy, and the
# pipeline (its step is its schedule's), its stages held as the strategy holds them: whole data-parallel copies, or
# each stage sharded by FSDP2 (`ShardedStages`). pp x tp is the pipeline with the tensor-parallel transform over it.
BACKENDS: dict[tuple[str, frozenset[str]], Callable[..., Backend]] = {
    ("single", _NONE): Backend,
    ("ddp", _NONE): Backend,
    ("fsdp2", _NONE): FSDP2Backend,
    ("deepspeed", _NONE): DeepSpeedBackend,
    ("ddp", _PP): PipelineBackend,
    ("fsdp2", _PP): functools.partial(PipelineBackend, holding=ShardedStages),
}
# axis -> the transform that applies it over whichever backend holds the model (its `strategies` and `beside` say
# where it runs), in the order they are applied: the axes transformers lays out while the model loads (tp, then ep:
# their `DistributedConfig` fields, their part of the record), then the sequence axes, each rewriting the loss
# module's forward and holding every micro-batch's forward and backward inside its attention's context.
TRANSFORMS: dict[str, type[Transform]] = {
    "tp": TensorParallel,
    "ep": ExpertParallel,
    "cp": RingAttention,
    "sp": UlyssesAttention,
}
