"""How a strategy holds a pipeline's stages: whole on each data-parallel copy (`StageCopies`), or each stage sharded by
FSDP2 over its data-parallel ranks (`ShardedStages`)."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hftrain.errors import HftrainError
from hftrain.parallel.base import ALL_PARTS
from hftrain.parallel.checkpoint_io import PipelineCheckpoints
from hftrain.parallel.pipeline.stage import Elsewhere, StageForward, sum_whole

if TYPE_CHECKING:
    from hftrain.parallel.pipeline.backend import PipelineBackend


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
        copies = b.accelerator.num_processes // (b.pp * b.tp)
        name = ((f" x tensor parallel (tp_size={b.tp})" if b.tp > 1 else "") +
                (f" x {copies} data-parallel copies" if copies > 1 else ""))
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
