"""The pipeline's strategy backend: the mesh, the stages it builds and wraps, its step (the schedule), clipping,
counts and records."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from hftrain.compat.transformers import accumulation_safe_partial_gradients
from hftrain.errors import HftrainError
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.memory import ParameterCounts
from hftrain.metrics import param_checksum
from hftrain.optim import build_optimizer
from hftrain.parallel.base import Backend, DataParallel, Parallelism
from hftrain.parallel.pipeline.checks import microbatches
from hftrain.parallel.pipeline.holding import StageCopies
from hftrain.parallel.pipeline.stage import (
    PipelineStages,
    StageForward,
    causal_lm,
    forward_only_order,
    keep_only,
    local,
    sharded,
)
from hftrain.parallel.tensor import model_load_kwargs
from hftrain.stages import (
    STAGES_PER_PROCESS,
    optimizer_layout,
    stage_layout,
)


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
        self.checkpoint_io = self.held.checkpoint_io
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

    def model_load_kwargs(self) -> dict:
        """pp x tp: transformers' tp plan over groups of tp_size consecutive ranks (the mesh's innermost axis), every
        layer sharded at load; `prepare` then keeps this stage's."""
        return model_load_kwargs(self.tp, self.accelerator.num_processes) if self.tp > 1 else {}

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
        accumulation_safe_partial_gradients(lm, self.tp)  # the microbatches' backwards accumulate, as tp's do
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
