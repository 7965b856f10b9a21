"""The parallelism record and the interface every backend implements.

A backend is chosen once, when the Accelerator is made (`hftrain.parallel.resolve`); the loop calls the methods
below and never asks which backend runs. The base class is the behaviour of a plain accelerate launch (one process,
or DDP); the other backends override what they do differently. How a layout writes and reads checkpoints is its own
component (`backend.checkpoints`, parallel/checkpoint_io.py), which `hftrain.checkpoint` calls.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers.distributed import DistributedConfig

from hftrain import vision
from hftrain.compat.accelerate import find_unused_parameters
from hftrain.config import TORCH_ADAMW, Recipe
from hftrain.errors import HftrainError
from hftrain.memory import GIB, PARTS, ModelState, ParameterCounts, Placement, optimizer_bytes
from hftrain.metrics import param_checksum, parameter_count, stored_bytes
from hftrain.parallel.checkpoint_io import AccelerateCheckpoints, FullStateCheckpoints
from hftrain.parallel.generation import LaidOutShards, WholeModel

ALL_PARTS = PARTS  # the model state: what ZeRO-3 / FULL_SHARD split


@dataclass(frozen=True)
class Parallelism:
    """How this run is laid out, resolved once: recorded in hftrain_state.json and printed at start-up."""

    kind: str  # "single", "ddp", "fsdp2", "deepspeed" or "tp"
    name: str  # e.g. "DDP", "DeepSpeed ZeRO-2 + offload", "FSDP2 FULL_SHARD", "tensor parallel (tp_size=2)"
    processes: int
    machines: int
    backend: str | None  # process-group backend: gloo, nccl (None for one process)
    tp_size: int = 1
    sp_size: int = 1  # sequence-parallel degree: the ranks of one group share a batch, each holds a slice
    cp_size: int = 1  # context-parallel degree (ring attention): the same, under FSDP2
    pp_size: int = 1  # pipeline stages' processes: each holds some layers, all see the same batches
    ep_size: int = 1  # expert-parallel degree: each process holds 1/ep of every MoE layer's experts, own batches
    dp_world: int = 1  # data-parallel groups: each trains on its own share of the data
    dp_rank: int = 0
    zero_stage: int | None = None
    sharded: tuple[str, ...] = ()  # parts of the model state split over the processes
    offloaded: tuple[str, ...] = ()  # parts held in CPU RAM

    @property
    def sequence_shards(self) -> int:
        """The number of processes each sequence is split over (sequence or context parallelism; 1 = whole)."""
        return self.sp_size * self.cp_size

    @property
    def model_shards(self) -> int:
        """The processes that share one model copy's work on the same batches (tensor- and pipeline-parallel groups):
        each token's FLOPs are done once among them, though every one of them sees the token."""
        return self.tp_size * self.pp_size

    def describe(self) -> str:
        """The start-up line in words: "1 process, no distribution", "DDP over 2 processes (gloo)"."""
        if self.processes == 1:
            return "1 process, no distribution"
        nodes = f" on {self.machines} machines" if self.machines > 1 else ""
        return f"{self.name} over {self.processes} processes{nodes} ({self.backend})"


@dataclass(frozen=True)
class DataParallel:
    """This rank's share of the data: `world` data-parallel groups, this rank in group `rank`.

    The `replicas` (= tp_size, or sp_size) ranks of one tensor- (or sequence-) parallel group train on the same
    batches. `sum` adds a value over the data-parallel ranks only (each batch once, so token counts and loss sums stay
    exact), then takes the max over the tensor- (sequence-) parallel group: its ranks hold equal values except a stop
    vote, which must reach them all.
    """

    world: int
    rank: int
    accelerator: Any
    replicas: int = 1
    groups: tuple[Any, Any] | None = None  # (data-parallel group, tensor-parallel group) with replicas > 1

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.replicas == 1:
            return self.accelerator.reduce(tensor, reduction="sum")
        dp_group, tp_group = self.groups
        total = tensor.clone()
        if self.world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=tp_group)
        return total

    @property
    def leads_group(self) -> bool:
        """Whether this process speaks for its tensor- (sequence-) parallel group (the group's first rank; every
        process without replicas): the one whose values `gather` keeps."""
        return self.accelerator.process_index % self.replicas == 0

    def check_replicas_agree(self, tensor: torch.Tensor, what: str) -> None:
        """Every process: raise on all of them if the ranks of some tensor- (sequence-) parallel group hold different
        values of `tensor` (same shape on each), which they must compute identically (e.g. the completions they
        sampled together). No collective without replicas."""
        if self.replicas == 1:
            return
        value = tensor.to(torch.float64)
        low, high = value.clone(), value.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.groups[1])
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.groups[1])
        differs = torch.tensor([float(not torch.equal(low, high))], device=tensor.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # every group stops, not only the one that differs
        if differs.item():
            raise HftrainError(f"the {self.replicas} ranks of a tensor-parallel group computed different {what}, "
                               "which they must compute identically from the same inputs; this is a bug in hftrain "
                               "or a non-deterministic kernel: please report it with the recipe")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's `tensor` (the same shape on each), concatenated along dim 0 in data-parallel rank
        order, on every rank: each batch once. With replicas, the first rank of each tensor- (sequence-) parallel
        group speaks for it (its ranks hold the same batch); the gather itself spans every process (rank = dp_rank
        x replicas + replica)."""
        everything = self.accelerator.gather(tensor)
        if self.replicas == 1:
            return everything
        return everything.reshape(self.world, self.replicas, *tensor.shape)[:, 0].reshape(-1, *tensor.shape[1:])


@functools.cache
def tp_groups(world: int, tp: int) -> tuple:
    """(data-parallel group, tensor-parallel group) of this rank; every rank creates every group, in order."""
    rank, mine = dist.get_rank(), {}
    for kind, groups in (("dp", [list(range(t, world, tp)) for t in range(tp)]),
                         ("tp", [list(range(d * tp, d * tp + tp)) for d in range(world // tp)])):
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["dp"], mine["tp"]


def data_share(world: int, rank: int, tp: int) -> tuple[int, int]:
    """(data-parallel groups, this rank's group): the tp consecutive ranks of a tensor-parallel group share one."""
    return world // tp, rank // tp


def shared_batch_layout(accelerator, size: int) -> DataParallel:
    """The data share of a run whose `size` consecutive ranks train on the same batches (a tensor-, sequence- or
    context-parallel group): world/size data-parallel groups, each group's values counted once."""
    world, rank = accelerator.num_processes, accelerator.process_index
    return DataParallel(*data_share(world, rank, size), accelerator, replicas=size, groups=tp_groups(world, size))


def with_copies(name: str, processes: int, size: int) -> str:
    """The layout's name, with the number of data-parallel copies of its `size`-rank groups when there are several."""
    copies = processes // size
    return name + (f" x {copies} data-parallel copies" if copies > 1 else "")


def innermost_optimizer(optimizer) -> str:
    """Class of the optimizer doing the update under accelerate's / ZeRO's wrappers (e.g. DeepSpeedCPUAdam)."""
    while hasattr(getattr(optimizer, "optimizer", None), "param_groups"):
        optimizer = optimizer.optimizer
    return type(optimizer).__name__


def device_memory_bytes(accelerator, world: int) -> float:
    """Memory of this process's device: the GPU's, or on CPU the machine's RAM shared by this node's processes."""
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_properties(accelerator.device).total_memory
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node


class Transform:
    """One model-splitting axis applied over the strategy backend that holds the model (torchtitan's
    `parallelize_fn` steps). Built with the backend, after its data share; its hooks run at fixed points, in
    `TRANSFORMS`' order (hftrain.parallel), and the strategy's own step comes after them, as torchtitan applies TP,
    then activation checkpointing and compile, then FSDP:

    1. load: `distributed_fields`, the axis's fields of transformers' `DistributedConfig` (the model is then laid out
       over the processes while it loads, each rank reading its shards; the strategy adds how data-parallel ranks
       hold them: `Backend.distributed_config`);
    2. record: `describe`, the axis's part of the `Parallelism` record (degree, name);
    3. prepare: `apply` to the loss module, before the strategy wraps it (`Backend.wrap`, or `wrap_laid_out` for a
       model laid out at load);
    4. each micro-batch: `micro_batch` around its forward and backward; `whole_sequences` around forwards that take
       whole sequences (grpo's generation and reference log-probs);
    5. frozen models (dpo's reference, distill's teacher): `frozen_copy`, `prepare_frozen`, where the axis holds the
       weights in a way the strategy's copy would not reproduce (None: the strategy's);
    6. generation: `generation_io`, the generation component (parallel/generation.py) of a layout with this axis
       (None: the strategy's).

    `TRANSFORMS` says which axis each one runs; `strategies`, under which launch strategies, `beside`, with which
    other model-splitting axes (`runs_over` judges both), and `strategy_for`, where the axis needs another strategy
    than the launch's to hold the model."""

    axis: ClassVar[str]
    strategies: ClassVar[frozenset[str]] = frozenset()  # the launch's `ParallelDims.strategy`s it runs under
    beside: ClassVar[frozenset[str]] = frozenset()  # the other model-splitting axes it composes with
    generation_io: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, backend: Backend):
        self.backend = backend

    @classmethod
    def runs_over(cls, dims) -> bool:
        """Whether this axis runs in the layout `dims` (a `ParallelDims`): under its launch strategy, beside its other
        axes."""
        return dims.strategy in cls.strategies and dims.axes - {cls.axis} <= cls.beside

    @classmethod
    def strategy_for(cls, dims, strategy: str) -> str:
        """The strategy that holds the model of the layout `dims` (a `ParallelDims`) with this axis on, given the
        one chosen so far (the launch's): the same, unless the axis needs another (ep: transformers' FSDP2 under a
        DDP-type launch)."""
        return strategy

    def distributed_fields(self) -> dict:
        """The fields of transformers' `DistributedConfig` this axis sets; {}: it leaves loading alone."""
        return {}

    def describe(self, record: Parallelism) -> Parallelism:
        """The record with this axis in it (its degree, its part of the name)."""
        return record

    def apply(self, model) -> None:
        """Change the loss module (its forward, its attention) before the strategy wraps it."""

    @contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]):
        """The micro-batch as the model's call takes it, inside what this axis needs around its forward *and*
        backward."""
        yield batch

    @contextmanager
    def whole_sequences(self):
        """Forwards run inside it see whole sequences on every rank of the axis's group (grpo's generation and
        reference log-probs), not this rank's slice."""
        yield

    def frozen_copy(self, model, rebuild):
        """A copy of the built, not yet prepared `model`, or None: the strategy's (`Backend.copy_frozen`)."""
        return None

    def prepare_frozen(self, module) -> tuple[Any, str] | None:
        """(module, how) for a frozen model placed like the trained one, or None: the strategy's
        (`Backend.place_frozen`)."""
        return None


def with_part(name: str, part: str) -> str:
    """A layout's name with an axis's `part` added, before what ends a name: its data-parallel copies
    (`with_copies`) and its offload note ("pipeline parallel (...) x tensor parallel (tp_size=2) x 2 data-parallel
    copies")."""
    end = re.search(r"( x \d+ data-parallel copies)?( \+ offload.*)?$", name).start()
    return name[:end] + part + name[end:]


class LaidOutAtLoad(Transform):
    """An axis transformers lays out while the model loads (`DistributedConfig`: tensor parallelism, expert
    parallelism): each rank reads only its shards, held as DTensors on transformers' device mesh, and the strategy
    holds the model as laid out (`Backend.wrap_laid_out`, `laid_out_checkpoint_io`). Frozen copies and generation
    follow the shards."""

    generation_io = LaidOutShards

    def frozen_copy(self, model, rebuild):
        """dpo's reference: DTensors over a group's storage cannot be deep-copied, so the model is loaded again, laid
        out the same way, and each process copies its own shards into it (exactly the starting weights, resized
        embeddings included)."""
        copy_ = rebuild()
        with torch.no_grad():
            for (name, mine), (_, theirs) in zip(copy_.named_parameters(), model.named_parameters(), strict=True):
                local = theirs.data.to_local() if hasattr(theirs.data, "to_local") else theirs.data
                target = mine.data.to_local() if hasattr(mine.data, "to_local") else mine.data
                if target.shape != local.shape:
                    raise HftrainError(f"dpo's reference copy: {name} is sharded differently from the model")
                target.copy_(local)
        return copy_

    def prepare_frozen(self, module) -> tuple[Any, str]:
        """The frozen model keeps the shards it was loaded with (see `frozen_copy`)."""
        return module.to(self.backend.accelerator.device).eval(), self.frozen_how()

    def frozen_how(self) -> str:
        """How a frozen model is held, in words."""
        raise NotImplementedError


class ReplicatedCopies(DistributedConfig):
    """transformers' mesh with `dp_replicate_size` copies of the tensor-parallel group, without its FSDP2 on the
    copies (transformers applies it only when dp_size > 1): a DDP-type strategy averages their gradients itself
    (`ReplicaGradients`)."""

    @property
    def dp_size(self) -> int:
        return 1


def replicated_config(fields: dict, copies: int) -> DistributedConfig:
    """transformers' `DistributedConfig` with `fields` (the axes' degrees) and `copies` whole copies of the layout."""
    if copies <= 1:
        return DistributedConfig(**fields)  # the model's own plans ("auto")
    return ReplicatedCopies(**fields, dp_replicate_size=copies)


class ReplicaGradients:
    """Average each gradient over the data-parallel copies of a model laid out at load (tensor parallel), as DDP
    would. A hook per parameter runs once its gradient is accumulated in the backward of the micro-batch that ends
    an optimizer step (`accelerator.sync_gradients`), before clipping and the step. Every rank runs the same backward
    graph, so the collectives of the data-parallel and TP groups come in one order. Sum then divide (gloo has no
    average): the same arithmetic as DDP's mean over the copies."""

    def __init__(self, accelerator, model, group, copies: int):
        self.accelerator, self.group, self.copies = accelerator, group, copies
        self.handles = [p.register_post_accumulate_grad_hook(self.average)
                        for p in model.parameters() if p.requires_grad]

    def average(self, param) -> None:
        if not self.accelerator.sync_gradients:
            return
        with torch.no_grad():
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # DTensor: this shard
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            grad.div_(self.copies)


@dataclass
class Backend:
    """One process or DDP: accelerate wraps the model (DistributedDataParallel with 2+ processes) and every rank
    holds the full model, gradients and optimizer state; a model laid out at load (tensor parallelism) is held as
    whole copies of its shards, their gradients averaged as DDP would (`wrap_laid_out`). The other strategies
    subclass it (FSDP2, DeepSpeed) and so does the pipeline, whose step is its own schedule."""

    accelerator: Any
    recipe: Recipe
    # the axes applied over this backend, in their fixed order (hftrain.parallel.TRANSFORMS): classes, built with it
    transforms: tuple[type[Transform], ...] = ()
    applied: list[Transform] = field(init=False)
    laid_out: bool = field(init=False)  # a transform lays the model out while it loads (`distributed_fields`)
    record: Parallelism = field(init=False)
    dp: DataParallel = field(init=False)
    checkpoints: AccelerateCheckpoints = field(init=False)
    # True where the optimizer has already stepped when backward returns (DeepSpeed's engine): a step with a
    # non-finite gradient norm can then not be skipped.
    step_applied_in_backward = False

    # how this layout writes and reads checkpoints (parallel/checkpoint_io.py), and how it generates
    # (parallel/generation.py): components called with the backend; `laid_out_checkpoint_io` where a transform laid
    # the model out at load, a transform's `generation_io` before the strategy's
    checkpoint_io: ClassVar[Callable[..., AccelerateCheckpoints]] = AccelerateCheckpoints
    laid_out_checkpoint_io: ClassVar[Callable[..., AccelerateCheckpoints]] = FullStateCheckpoints
    generation_io: ClassVar[Callable[..., WholeModel]] = WholeModel

    def __post_init__(self) -> None:
        self.dp = self.data_parallel()
        self.applied = [transform(self) for transform in self.transforms]
        self.laid_out = any(transform.distributed_fields() for transform in self.applied)
        record = self.make_record()
        for transform in self.applied:
            record = transform.describe(record)
        self.record = record
        self.checkpoints = (self.laid_out_checkpoint_io if self.laid_out else self.checkpoint_io)(self)
        generation = next((t.generation_io for t in self.applied if t.generation_io is not None), self.generation_io)
        self.generation = generation(self)

    # ----------------------------------------------------------------- layout
    def data_parallel(self) -> DataParallel:
        """This rank's share of the data: the consecutive ranks of the axes that split one batch's work (tp, cp,
        sp: `ParallelDims.replicas`, which the preflight lets on only under the strategies that run them) train on
        the same batches."""
        shared = self.recipe.tp_size * self.recipe.cp_size * self.recipe.sp_size
        if shared > 1:
            return shared_batch_layout(self.accelerator, shared)
        return DataParallel(self.accelerator.num_processes, self.accelerator.process_index, self.accelerator)

    def make_record(self, **layout) -> Parallelism:
        world = self.accelerator.num_processes
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # set by torchrun
        defaults = {"kind": "ddp" if world > 1 else "single", "name": "DDP" if world > 1 else "single process"}
        return Parallelism(processes=world, machines=world // per_node,
                           backend=dist.get_backend() if dist.is_initialized() else None,
                           tp_size=self.recipe.tp_size, dp_world=self.dp.world, dp_rank=self.dp.rank,
                           **{**defaults, **layout})

    # --------------------------------------------------------------- training
    def model_load_kwargs(self) -> dict:
        """Extra `from_pretrained` arguments: transformers' `DistributedConfig` where a transform lays the model out
        while it loads (its `distributed_fields`, in `TRANSFORMS`' order), completed by the strategy
        (`distributed_config`); {} otherwise."""
        fields = {}
        for transform in self.applied:
            fields.update(transform.distributed_fields())
        return {"distributed_config": self.distributed_config(fields)} if fields else {}

    def distributed_config(self, fields: dict) -> DistributedConfig:
        """The `DistributedConfig` of a model laid out at load with the axes' `fields`: here, whole copies of the
        layout on the data-parallel ranks (transformers' FSDP2 on them switched off: `ReplicaGradients`)."""
        return replicated_config(fields, self.dp.world)

    def layers_to_load(self, num_layers: int) -> set[int] | None:
        """The decoder layers (of `num_layers`) this process reads from the checkpoint; None: all of them (every
        backend but the pipeline's, whose stages read their own)."""
        return None

    def prepare(self, model, optimizer):
        """The layout's transforms on the loss module, in their fixed order, then the strategy's wrapper (`wrap`; for
        a model laid out at load, `wrap_laid_out`)."""
        for transform in self.applied:
            transform.apply(model)
        return (self.wrap_laid_out if self.laid_out else self.wrap)(model, optimizer)

    def wrap(self, model, optimizer):
        """`accelerator.prepare(model, optimizer)` with this backend's model-dependent settings. An image-text model
        whose vision tower trains, on several processes: DistributedDataParallel with find_unused_parameters, since
        families that read a layer's hidden states (LLaVA: vision_feature_layer) leave the tower's post_layernorm and
        the layers after that one without a gradient, which DDP otherwise refuses at the next step's reduction."""
        if self.accelerator.num_processes > 1 and vision.trains_vision_tower(model):
            find_unused_parameters(self.accelerator)
        return self.accelerator.prepare(model, optimizer)

    def wrap_laid_out(self, model, optimizer):
        """A model transformers laid out at load (DTensor weights over each tensor-parallel group) stays unwrapped:
        DDP cannot hold DTensors. The data-parallel copies' gradients are averaged by `ReplicaGradients`."""
        accelerator, tp = self.accelerator, self.recipe.tp_size
        if accelerator.mixed_precision != "no":
            model.forward = accelerator.autocast()(model.forward)  # what accelerator.prepare would add
        rank = accelerator.process_index
        sharded = next(p for p in model.parameters() if hasattr(p, "device_mesh"))
        if sharded.device_mesh.mesh.flatten().tolist() != list(range(rank - rank % tp, rank - rank % tp + tp)):
            raise HftrainError(f"transformers sharded the model over ranks {sharded.device_mesh.mesh.tolist()}, not "
                               f"over consecutive groups of tp_size={tp} as hftrain assumes for the data split")
        if self.dp.world > 1:
            ReplicaGradients(accelerator, model, self.dp.groups[0], self.dp.world)
        self.checkpoints.attach(model, optimizer)
        return model, optimizer

    @contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]):
        """The inputs of the model's call on one micro-batch, inside whatever the transforms need around that call's
        forward *and* backward (context parallelism: the sequence shards, inside its ring's context). Without them:
        the batch as it is."""
        with ExitStack() as stack:
            for transform in self.applied:
                batch = stack.enter_context(transform.micro_batch(batch))
            yield batch

    @contextmanager
    def whole_sequences(self):
        """Around forwards that take whole sequences on every rank (grpo's generation and reference log-probs): each
        transform's `whole_sequences`. Without transforms: nothing."""
        with ExitStack() as stack:
            for transform in self.applied:
                stack.enter_context(transform.whole_sequences())
            yield

    def forward_backward(self, model, inputs: dict[str, torch.Tensor], scale: torch.Tensor, timer) -> torch.Tensor:
        """Forward and backward of one micro-batch (`model(**inputs)` returns its summed loss); returns that sum,
        detached. The backward is of sum x `scale`, divided by the accumulation steps by accelerate's backward (and
        by DeepSpeed's engine). Pipeline parallelism runs both inside its schedule (parallel/pipeline/)."""
        loss_sum = model(**inputs)
        timer.lap("forward")
        self.accelerator.backward(loss_sum * scale)
        timer.lap("backward")
        return loss_sum.detach()

    def param_checksum(self, model) -> float:
        """Sum of the replicated parameters, equal on every rank while they train the same model (the desync
        check); every rank calls it."""
        return param_checksum(model)

    def local_trained_tensors(self, model) -> list[torch.Tensor]:
        """The values of the trained parameters held by this process (a DTensor's local shard), to change and compare
        in place (checkpoint preflight)."""
        tensors = []
        for p in model.parameters():
            if p.requires_grad:
                tensors.append(p.data.to_local() if hasattr(p.data, "to_local") else p.data)
        return tensors

    def frozen_copy(self, model, rebuild):
        """A copy of the built, not yet prepared `model` (dpo's reference). `rebuild()` builds the model again (used
        where the loaded model cannot be deep-copied). The first transform's that copies, else the strategy's
        (`copy_frozen`)."""
        for transform in self.applied:
            if (made := transform.frozen_copy(model, rebuild)) is not None:
                return made
        return self.copy_frozen(model, rebuild)

    def copy_frozen(self, model, rebuild):
        """The strategy's frozen copy: a deep copy."""
        return copy.deepcopy(model)

    def prepare_frozen(self, module):
        """(module, how) for a frozen model used next to the trained one (dpo's reference): placed like the trained
        model, without gradients or optimizer. The first transform's that places it, else the strategy's
        (`place_frozen`)."""
        for transform in self.applied:
            if (placed := transform.prepare_frozen(module)) is not None:
                return placed
        return self.place_frozen(module)

    def place_frozen(self, module):
        """One process and DDP: a copy on this device (DDP wraps nothing without gradients)."""
        return module.to(self.accelerator.device).eval(), "replicated on every process"

    def release(self, model) -> None:
        """After forwards of the prepared model with no backward (reference log-probs precomputed before step 1):
        whatever the strategy gathered for them is given back. One process, DDP: nothing was."""

    @contextmanager
    def gathered(self, params: list):
        """Frozen parameters of a `prepare_frozen` module readable whole inside the context, every rank at once
        (distill's teacher head). One process, DDP, FSDP2 (a shard is gathered by its `full_tensor()`): nothing to
        do."""
        yield

    def generation_context(self, model):
        """For sampling with transformers' `generate` (grpo, log_completions), every rank at once: yields (module,
        synced_gpus), from the layout's generation component (`generation`, parallel/generation.py)."""
        return self.generation.context(model)

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        """Clip to `max_norm` (inf: only measure) and return the global gradient norm before clipping."""
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return None if norm is None else float(norm)

    def parameter_counts(self, model) -> ParameterCounts:
        """The model's parameters: elements at their original size (4-bit weights unpacked), bytes as stored."""
        return self.count_parameters(model.parameters())

    def count_parameters(self, params) -> ParameterCounts:
        """`params` counted as `parameter_counts` counts a model's."""
        params = list(params)
        trained = [p for p in params if p.requires_grad]
        return ParameterCounts(sum(map(parameter_count, trained)), sum(map(parameter_count, params)),
                               sum(map(stored_bytes, trained)), sum(map(stored_bytes, params)))

    # ------------------------------------------------------------------ memory
    def optimizer_state_bytes(self) -> int:
        """Optimizer-state bytes per trained parameter (`memory.optimizer_bytes`); optim muon: AdamW's, an upper bound
        (Muon keeps one momentum buffer, 4 bytes, for the hidden matrices; AdamW two moments for the rest)."""
        return optimizer_bytes(self.recipe.optim in (*TORCH_ADAMW, "muon"), self.recipe.sgd_momentum)

    def model_state(self, counts: ParameterCounts) -> ModelState:
        """One whole copy of the model state: the weights as stored, a gradient like each trained weight, the
        optimizer's state per trained parameter."""
        return ModelState(counts.total_bytes, counts.trained_bytes, self.optimizer_state_bytes() * counts.trained)

    def shard_count(self) -> int:
        """Processes the parts in `record.sharded` are split over. One process and DDP shard nothing themselves: what
        is sharded is split by the axes that split the model (tensor-parallel shards, pipeline stages)."""
        return self.record.model_shards

    def placement(self) -> Placement:
        """How this layout spreads the model state (hftrain.memory): the parts in `record.sharded` over
        `shard_count()` processes, the others over the processes that split the model itself (`record.model_shards`:
        tensor-parallel shards and pipeline stages; under FSDP2 SHARD_GRAD_OP with tp or pp each rank keeps its
        shard's or its stage's weights whole, not the model's), those in `record.offloaded` in CPU RAM."""
        return Placement(self.shard_count(), self.record.model_shards, self.record.sharded, self.record.offloaded)

    def equal_work_groups(self) -> list[list[int]] | None:
        """Groups of ranks that do the same work each step, among which the straggler check compares (None: all)."""
        return None

    def memory(self, counts: ParameterCounts) -> dict:
        """Model-state memory per device for this layout (activations and buffers not included): hftrain.memory's
        model (the one `hftrain estimate` uses) on the live model's `counts`, this backend's `model_state` and
        `placement`."""
        state = self.model_state(counts)
        held = self.placement().per_device(state)
        on_device, on_cpu = held.on_device, held.cpu
        device_memory = device_memory_bytes(self.accelerator, self.accelerator.num_processes)
        sp = self.record.sequence_shards  # sequence/context parallel: each device holds 1/sp of every sequence
        tokens = self.recipe.per_device_train_batch_size * self.recipe.max_length // sp
        return {"strategy": self.record.name, "processes": self.record.processes,
                "model_state_bytes": asdict(state), "activation_tokens_per_device": tokens,
                "activations": f"activations extra: at most {tokens:,} tokens per device" +
                               (f", 1/{sp} of each sequence" if sp > 1 else ""),
                "per_device_bytes": on_device, "offloaded_bytes": on_cpu,
                "per_device_gib": round(on_device / GIB, 3), "offloaded_gib": round(on_cpu / GIB, 3),
                "device_memory_gib": round(device_memory / GIB, 1)}

    def unwrap(self, model):
        """The loss wrapper inside whatever the backend wrapped it in (DDP's `module`). Not accelerate's
        unwrap_model, which imports DeepSpeed whenever it is installed."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    # ----------------------------------------------------------------- records
    def config_used(self) -> dict | None:
        """The backend's own configuration file as it ran (DeepSpeed's JSON), saved next to every checkpoint."""
        return None

    def launch_info(self, model, optimizer) -> dict:
        """What actually runs: recorded in every checkpoint so that a silent fallback (e.g. to one process) shows."""
        return {
            "distributed_type": str(self.accelerator.distributed_type).split(".")[-1],
            "parallelism": self.record.describe(),
            "num_processes": self.record.processes,
            "num_machines": self.record.machines,
            "backend": self.record.backend,
            "model_wrapper": type(model).__name__,
            "tp_size": self.record.tp_size,
            "sp_size": self.record.sp_size,
            "cp_size": self.record.cp_size,
            "pp_size": self.record.pp_size,
            "ep_size": self.record.ep_size,
            "dtensor_parameters": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
            "dtensor_meshes": dtensor_meshes(model),
            "optimizer": innermost_optimizer(optimizer),
            "mixed_precision": self.accelerator.mixed_precision,
            "device": str(self.accelerator.device),
            "sharded_modules": sorted({type(m).__name__ for m in model.modules()
                                       if type(m).__name__.startswith("FSDP")}),
            "deepspeed_config": self.config_used(),
        }


def dtensor_meshes(model) -> list[str]:
    """The device meshes the model's DTensor parameters lie on, e.g. ["fsdp=2 x tp=2", "fsdp=2"] under FSDP2 x TP
    (the norms, whole over TP, are sharded over fsdp only)."""
    meshes = {p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
    return sorted(" x ".join(f"{name}={size}" for name, size in
                             zip(m.mesh_dim_names or [f"dim{i}" for i in range(m.ndim)], m.shape, strict=True))
                  for m in meshes)

