"""The pipeline's strategy backend: how a strategy holds the stages (whole on each data-parallel copy, `StageCopies`,
or each stage sharded by FSDP2 over its data-parallel ranks, `ShardedStages`), and `PipelineBackend`: the mesh, the
stages it builds and wraps, its step (the schedule), clipping, counts and records."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from hftrain.errors import HftrainError
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.memory import ParameterCounts
from hftrain.metrics import param_checksum
from hftrain.optim import build_optimizer
from hftrain.parallel.base import ALL_PARTS, Backend, DataParallel, Parallelism, replicated_config
from hftrain.parallel.checkpoint_io import PipelineCheckpoints
from hftrain.parallel.pipeline.checks import microbatches
from hftrain.parallel.pipeline.stage import (
    Elsewhere,
    PipelineStages,
    StageForward,
    causal_lm,
    forward_only_order,
    keep_only,
    local,
    sharded,
    sum_whole,
)
from hftrain.stages import (
    STAGES_PER_PROCESS,
    optimizer_layout,
    stage_layout,
)


class StageCopies:
    """How a DDP-type strategy holds a pipeline's stages: whole on each data-parallel copy, each gradient averaged
    over the copies as DDP's mean, the tied embedding's gradient summed whole between its first and last stage, the
    norm over one copy's ranks. The strategy's part of the pipeline (`PipelineBackend.holding`); `ShardedStages`:
    FSDP2's."""

    checkpoint_io = PipelineCheckpoints

    def __init__(self, backend: PipelineBackend):
        self.backend = backend

    def describe(self) -> dict:
        """The strategy's part of the record: its kind, its part of the name, the parts split over `shard_count`."""
        b = self.backend
        copies = b.accelerator.num_processes // (b.pp * b.tp)  # (the tp transform adds its part before the copies)
        name = f" x {copies} data-parallel copies" if copies > 1 else ""
        return {"kind": "pp", "name": name, "sharded": ("weights", "gradients", "optimizer")}

    def shard_count(self) -> int:
        return self.backend.pp * self.backend.tp  # each stage's parts over its tp shards, the model over the stages

    def shard(self, stages: list[StageForward]) -> None:
        """Data-parallel copies hold their stages whole."""

    def average(self, grads: list[torch.Tensor]) -> None:
        """The mean of each gradient over the data-parallel copies (each holds the whole stage), as DDP's."""
        b = self.backend
        if b.dp.world > 1:
            for g in grads:
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=b.dp_group)
                g.div_(b.dp.world)

    def sum_tied(self, grad: torch.Tensor) -> None:
        """The tied embedding's gradient summed between the first and the last stage of this copy (and tp rank)."""
        sum_whole(grad, self.backend.tie_group)

    @property
    def norm_group(self):
        """The ranks whose gradients make up the whole gradient once: a copy's stages and tp shards."""
        return self.backend.batch_group

    def launch_info(self, model) -> dict:
        return {}


class ShardedStages(StageCopies):
    """How FSDP2 holds a pipeline's stages, pp x FSDP2 (torchtitan's layout): pp_size stages per pipeline, each
    stage's weights, gradients and AdamW state sharded by torch's `fully_shard` over the stage's data-parallel ranks
    (the mesh's "dp" axis: the ranks that hold the same stage), instead of whole copies averaged DDP-style. An FSDP2
    preset with `--pp_size P` and P x D processes (D >= 2; tp inside sharded stages is refused by the preflight).

    - Units: each decoder layer the stage owns, the head on the last stage (the schedule's loss_fn applies it, outside
      the stage's forward), and the stage module itself as the root (the embedding, the final norm), on the stage's
      dp sub-mesh; FULL_SHARD re-gathers a unit's weights for each microbatch's forward and backward, SHARD_GRAD_OP
      keeps them from the forward to the backward (the preset's fsdp_reshard_after_forward).
    - torch's schedules drive FSDP2 themselves (`PipelineStage.backward_maybe_with_nosync`: every microbatch's backward
      without gradient sync; `perform_reduce_grad` after the last one: `set_requires_gradient_sync(True)` and each
      unit's `post_backward`, i.e. one reduce-scatter per pipeline step, which with gradient accumulation is one per
      accumulation step, accumulated into the sharded gradients).
    - The numbers: FSDP2's reduce-scatter averages over the D ranks (its default divide factor D), which is the mean
      DDP-style copies take, so the loop's scale (dp_world x accumulation / the step's tokens over every rank) gives
      the step's token-weighted gradient exactly as without sharding; no further averaging. The tied embedding's
      gradient is a Shard(0) block of the same rows on the first and the last stage of a copy (both tensors have the
      vocabulary's rows, split the same way over D ranks), so the local blocks are summed directly. The norm sums
      every rank's local squares over all processes (each element is held by exactly one rank of one stage; the
      head's copy of a tied weight skipped).
    - Loading: every rank reads its stages' layers (full fine-tuning; the whole model with adapters), as pp without
      FSDP2 does (`PipelineBackend.layers_to_load`); transformers' rank-0-only loading (the preset's
      fsdp_cpu_ram_efficient_loading, read from FSDP_CPU_RAM_EFFICIENT_LOADING at load time) would leave the other
      stages' ranks with weights on the meta device that no broadcast fills, so it is turned off for this process.
    - Checkpoints: the pipeline's DCP folder under HF names; the sharded parameters and AdamW moments are DTensors,
      which DCP writes as each rank's blocks and reads into any layout (`checkpoint_io.PipelineCheckpoints`)."""

    checkpoint_io = functools.partial(PipelineCheckpoints, sharded_stages=True)

    def __init__(self, backend: PipelineBackend):
        super().__init__(backend)
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # see the class docstring: before the model loads

    @property
    def full_shard(self) -> bool:
        return self.backend.accelerator.state.fsdp_plugin.reshard_after_forward is True  # SHARD_GRAD_OP: False

    def describe(self) -> dict:
        copies = self.backend.accelerator.num_processes // self.backend.pp
        name = (f" x FSDP2 {'FULL_SHARD' if self.full_shard else 'SHARD_GRAD_OP'} (each stage over {copies} "
                "data-parallel ranks)")
        return {"kind": "pp_fsdp2", "name": name,
                "sharded": ALL_PARTS if self.full_shard else ("gradients", "optimizer")}

    def shard_count(self) -> int:
        return self.backend.accelerator.num_processes  # the stages, each over its data-parallel ranks

    def shard(self, stages: list[StageForward]) -> None:
        """fully_shard each of this rank's stages over the stage's data-parallel ranks (see the class docstring)."""
        mesh = self.backend.mesh["dp"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.backend.accelerator.mixed_precision == "bf16" else MixedPrecisionPolicy()
        options = {"mesh": mesh, "reshard_after_forward": self.full_shard, "mp_policy": policy}
        for stage in stages:
            for layer in stage.layers:
                if not isinstance(layer, Elsewhere):
                    fully_shard(layer, **options)
            if stage.is_last:
                fully_shard(stage.lm_head, **options)
            fully_shard(stage, **options)
            if not isinstance(stage, FSDPModule):
                raise HftrainError("pp x FSDP2: a pipeline stage did not become an FSDP2 module")

    def average(self, grads: list[torch.Tensor]) -> None:
        """Nothing: FSDP2's reduce-scatter has averaged each gradient block over the stage's data-parallel ranks."""

    def sum_tied(self, grad: torch.Tensor) -> None:
        """The first stage's embedding gradient and the last stage's head gradient are Shard(0) blocks of the same
        vocabulary rows on copy c (same shape, same split over the same number of ranks): sum the blocks."""
        if not isinstance(grad, DTensor) or [p.is_shard(0) for p in grad.placements] != [True]:
            raise HftrainError(f"pp x FSDP2: the tied gradient is laid out as {getattr(grad, 'placements', None)}, "
                               "not one Shard(0) block per data-parallel rank")
        dist.all_reduce(grad.to_local(), op=dist.ReduceOp.SUM, group=self.backend.tie_group)

    @property
    def norm_group(self):
        return None  # every process: each holds its own block of its stage's gradients

    def launch_info(self, model) -> dict:
        """How the main process's stage weights are placed: FSDP2's Shard(0) over the stage's "dp" mesh."""
        placements = {", ".join(repr(p) for p in param.placements) for param in model.parameters()
                      if isinstance(param, DTensor)}
        return {"dtensor_placements": sorted(placements)}


@dataclass
class PipelineBackend(Backend):
    """pp_size stages per pipeline (see the module's docstring), held as the strategy holds them (`holding`: whole
    on each data-parallel copy, `StageCopies`; under an FSDP2 preset each stage sharded over its data-parallel ranks,
    `ShardedStages`), which also gives its checkpoint component."""

    holding: Callable[..., StageCopies] = StageCopies

    def __post_init__(self) -> None:
        world, pp, tp = self.accelerator.num_processes, self.recipe.pp_size, self.recipe.tp_size
        copies = world // (pp * tp)
        device = self.accelerator.device
        self.mesh = init_device_mesh(device.type, (pp, copies, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_group, self.dp_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        self.pp_rank, self.copy = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        ranks = self.mesh.mesh  # [stage, copy, tp rank] -> global rank
        # Every rank creates every group, in the same order. The ranks that train on one batch (a copy's stages and
        # tp shards): the loop's sums take the max over them. The first and last stage of each (copy, tp rank) share
        # the tied embedding (the same shard of it under tp).
        self.batch_group = self.tie_group = None
        for c in range(copies):
            group = dist.new_group(ranks[:, c, :].flatten().tolist())
            if c == self.copy:
                self.batch_group = group
        for c in range(copies):
            for t in range(tp):
                group = dist.new_group([int(ranks[0, c, t]), int(ranks[pp - 1, c, t])])
                if (c, t) == (self.copy, self.tp_rank):
                    self.tie_group = group
        self.held = self.holding(self)
        # the stages' checkpoints, whether or not the tp transform laid the weights out at load
        self.checkpoint_io = self.laid_out_checkpoint_io = self.held.checkpoint_io
        super().__post_init__()

    @property
    def pp(self) -> int:
        return self.recipe.pp_size

    @property
    def tp(self) -> int:
        return self.recipe.tp_size

    def data_parallel(self) -> DataParallel:
        # A pipeline's ranks (its stages and their tp shards) train on the same batches: tokens are counted once per
        # pipeline (sum over the copies), then the max over the pipeline's ranks spreads the last stage's loss sums
        # (>= 0; 0 on the other stages).
        copies = self.accelerator.num_processes // (self.pp * self.tp)
        return DataParallel(copies, self.copy, self.accelerator, replicas=self.pp * self.tp,
                            groups=(self.dp_group, self.batch_group))

    def distributed_config(self, fields: dict):
        """pp x tp (the tp transform's `fields`): transformers' tp plan over groups of tp_size consecutive ranks (the
        mesh's innermost axis), as whole copies over every stage and data-parallel copy; every layer sharded at load,
        `wrap` then keeps this stage's."""
        return replicated_config(fields, self.accelerator.num_processes // self.tp)

    def layers_to_load(self, num_layers: int) -> set[int] | None:
        """Full fine-tuning reads only this rank's stages' decoder layers (`model.load_decoder_layers`: the others
        stay on the meta device until `prepare` drops them), so a machine's processes hold the model about once in
        host memory, not once each. With adapters every layer loads (peft draws each adapter's initialisation from
        the global generator in module order: the whole model keeps one process's draws)."""
        if self.recipe.use_peft:
            return None
        ranges, mine = stage_layout(num_layers, self.pp, self.recipe.pp_schedule, self.pp_rank)
        return {index for stage in mine for index in ranges[stage]}

    def make_record(self, **layout) -> Parallelism:
        held = self.held.describe()
        name = (f"pipeline parallel (pp_size={self.pp}, {self.recipe.pp_schedule}, {microbatches(self.recipe)} "
                f"microbatches){held['name']}")
        record = super().make_record(kind=held["kind"], name=name, sharded=held["sharded"])
        return dataclasses.replace(record, pp_size=self.pp)

    def shard_count(self) -> int:
        return self.held.shard_count()

    def equal_work_groups(self) -> list[list[int]]:
        """The ranks of each stage position (its data-parallel copies and tp shards): stages hold unequal layers, the
        embedding and the head, so a rank is compared only with those (no check without data-parallel copies)."""
        return [self.mesh.mesh[s].flatten().tolist() for s in range(self.pp)]

    # ----------------------------------------------------------------- training
    def wrap(self, model, optimizer):
        """Split the loss module's causal LM into this rank's stages, build the schedule, and rebuild the optimizer
        over the parameters this rank keeps."""
        recipe, accelerator = self.recipe, self.accelerator
        lm = model.lm
        hf = causal_lm(lm)
        head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
        self.tied = head is not None and head.weight is embed.weight
        per_process = STAGES_PER_PROCESS[recipe.pp_schedule]
        count = self.pp * per_process
        ranges, mine = stage_layout(len(hf.get_decoder().layers), self.pp, recipe.pp_schedule, self.pp_rank)
        stages = [StageForward(lm, s, count, ranges[s], packed=recipe.packing) for s in mine]
        # the optimizer numbering of the whole model, as a run without pp would save it (resuming its checkpoints)
        self.unsplit_ids = optimizer_layout(recipe, model)[1]
        # the layers this rank read from the checkpoint (the others stayed on the meta device: `layers_to_load`)
        read = [i for i, layer in enumerate(hf.get_decoder().layers) if not any(p.is_meta for p in layer.parameters())]
        owned = {i for s in mine for i in ranges[s]}
        if not owned <= set(read):
            raise HftrainError(f"rank {accelerator.process_index}: layers {sorted(owned - set(read))} of its pipeline "
                               "stages were not loaded")
        keep_only(lm, owned, first=0 in mine, last=count - 1 in mine)
        self.layout = {"stages": count, "layers": [[r.start, r.stop] for r in ranges], "mine": mine,
                       "layers_read": read}
        model.to(accelerator.device)
        self.held.shard(stages)
        # autocast (bf16) around every stage's forward and the head's loss: as accelerate wraps the whole loss
        # module's forward without pp
        autocast = accelerator.autocast() if accelerator.mixed_precision != "no" else None
        if autocast is not None:
            for stage in stages:
                stage.forward = autocast(stage.forward)
        m = microbatches(recipe)
        pipeline_stages = [PipelineStage(stage, s, count, accelerator.device, group=self.pp_group)
                           for stage, s in zip(stages, mine, strict=True)]
        rows = lambda n: -(-n // m) * m  # noqa: E731 - rows padded to a multiple of the microbatches
        prepared = PipelineStages(model, stages, None, m, rows(recipe.per_device_train_batch_size),
                                  rows(recipe.per_device_eval_batch_size), recipe.max_length)
        schedule_class = get_schedule_class(recipe.pp_schedule)
        first = pipeline_stages if per_process > 1 else pipeline_stages[0]
        loss_fn = prepared.token_loss if autocast is None else autocast(prepared.token_loss)
        object.__setattr__(prepared, "schedule", schedule_class(first, n_microbatches=m, loss_fn=loss_fn,
                                                                scale_grads=False))
        if recipe.pp_schedule in V_SCHEDULES:
            prepared.eval_order = forward_only_order(prepared.schedule, self.pp, m)
        optimizer = build_optimizer(recipe, model, optimizer.defaults["lr"], allow_empty=True)  # this rank's part
        self.checkpoints.attach(prepared, optimizer)
        return prepared, optimizer

    def wrap_laid_out(self, model, optimizer):
        """Stages of a model the tp transform laid out at load are split and scheduled as whole layers are: the
        schedule, not DDP, holds them, and the clipping sums the gradients over the stages and tp shards."""
        return self.wrap(model, optimizer)

    def forward_backward(self, model, inputs, scale, timer) -> torch.Tensor:
        """One pipeline step does every microbatch's forward and backward; accelerate's backward (which divides by
        the accumulation steps) is not used, so the division is applied here."""
        loss_sum = model.train_step(inputs["input_ids"], inputs["labels"],
                                    float(scale) / self.recipe.gradient_accumulation_steps, inputs.get("position_ids"))
        timer.lap("backward")
        return loss_sum

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        """Collectives that change the gradients: the mean over the data-parallel copies (`held.average`; the loss
        already divides by the step's tokens over all copies, so the mean undoes the copies' count as DDP's does; under
        pp x FSDP2 the reduce-scatter has taken it), the tied
        embedding's gradient summed between the first and the last stage, then the norm: the squares of every
        gradient summed over the stages and, for a tensor sharded by tp, over its shards (a tensor that every tp rank
        holds whole is counted once, and a tied weight once), and torch's clipping rule (coef = max_norm / (norm +
        1e-6), at most 1)."""
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [local(p.grad) for p in params]  # a DTensor's shard: what this rank holds
        self.held.average(grads)
        tied = self.tied_parameter(model)
        if tied is not None and tied.grad is not None and not (model.has_first and model.has_last):
            self.held.sum_tied(tied.grad)  # (in a V the first and last stage share rank 0: one tensor there)
        squares = torch.zeros((), dtype=torch.float32, device=self.accelerator.device)
        for p, g in zip(params, grads, strict=True):
            if tied is not None and p is tied and not model.has_first:
                continue  # the head's copy of the tied weight: counted on the first stage
            if sharded(p.grad) or self.tp_rank == 0:  # a whole tensor: once per tp group
                squares += g.detach().float().pow(2).sum()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.held.norm_group)
        norm = squares.sqrt()
        if max_norm != float("inf"):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return float(norm)

    def tied_parameter(self, model) -> nn.Parameter | None:
        """The tied input/output embedding as this rank holds it (embedding on the first stage, head on the last)."""
        if not self.tied:
            return None
        hf = causal_lm(model.module.lm)
        module = hf.get_input_embeddings() if model.has_first else hf.get_output_embeddings()
        return getattr(module, "weight", None)

    def parameter_counts(self, model) -> ParameterCounts:
        """The whole pipeline's: every stage's counts added, a tied head counted with the embedding only (as the
        model without pp counts it)."""
        tied = self.tied_parameter(model) if not model.has_first else None
        stage = self.count_parameters(p for p in model.parameters() if p is not tied)
        counts = torch.tensor(astuple(stage), dtype=torch.int64, device=self.accelerator.device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.pp_group)
        return ParameterCounts(*map(int, counts))

    def param_checksum(self, model) -> float:
        """The whole pipeline's sum (its stages' sums added): equal on every data-parallel copy."""
        total = torch.tensor(param_checksum(model), dtype=torch.float64, device=self.accelerator.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pp_group)
        return float(total)

    def local_trained_tensors(self, model) -> list[torch.Tensor]:
        return [local(p.data) for p in model.parameters() if p.requires_grad]

    def unwrap(self, model):
        return model.module if isinstance(model, PipelineStages) else model

    def launch_info(self, model, optimizer) -> dict:
        return {**super().launch_info(model, optimizer), "pp_size": self.pp, "pp_schedule": self.recipe.pp_schedule,
                "pp_microbatches": microbatches(self.recipe), "pp_stages": self.layout, **self.held.launch_info(model)}
