"""Pipeline parallelism: the model's layers split into stages, run by `torch.distributed.pipelining`.

`--pp_size N` splits the transformers model by hand along its own pp plan (`base_model_pp_plan`: embed_tokens, the
layer list, norm; the causal LM's `_pp_plan`: lm_head), not with torch's tracer (it fails on HF models with rotary
embeddings, pytorch #184361):

- every process keeps the model's module tree; the modules another stage owns are replaced by parameterless
  placeholders (`Elsewhere`), so parameter names stay the HF names (checkpoints, the final save) and each layer keeps
  its index (`config.layer_types`, sliding windows);
- a stage runs the model's own base forward with the other stages' layers skipped and, except on the last stage, the
  final norm skipped (`StageForward`): positions, the causal masks and the rotary embeddings are recomputed on every
  stage from the hidden states' shape, and only the hidden states cross between stages;
- layers are balanced over the stages with the embedding and the head counted as one layer each (`split_layers`),
  and every layer lives on exactly one stage (asserted);
- the last stage computes the summed token loss on trained positions only (the head applied there), times the
  loop's step scale: `scale_grads=False`, so the step's loss is sum(token losses) / the step's trained tokens over
  every microbatch, accumulation step and data-parallel copy, exactly as without pp;
- rows are padded to `max_length` and the rows of a per-device batch to a multiple of the microbatches (torch sizes
  its receive buffers once), with target-less padding (causal attention: no real token sees it); packed rows'
  position_ids travel with the hidden states, so every stage keeps the documents apart;
- LoRA / QLoRA: the adapters are added before the split, so each stage trains its layers' own (a stage may train
  nothing); checkpoints hold trained weights only, and the final adapter is written from every stage's
  (`checkpoint_io.PipelineCheckpoints.save_pretrained`);
- gradients: averaged over the data-parallel copies, the tied embedding's gradient summed between the first and the
  last stage, the norm summed over the stages (each tied weight counted once) before clipping.

Process layout (one DeviceMesh ("pp", "dp", "tp"), pp outermost, tp innermost): rank = (stage_rank * copies + copy)
* tp_size + tp_rank. With 4 processes and pp_size=2: ranks {0, 2} and {1, 3} are two pipelines; {0, 1} hold the
first stage, {2, 3} the last. With tp_size=2 as well (pp x tp, 4 processes): {0, 1} hold the first stage's layers
split in two by transformers' tensor-parallel plan, {2, 3} the last stage's; ranks 0 -> 2 and 1 -> 3 exchange the
(replicated) hidden states. 8 processes with pp_size=2, tp_size=2: two such pipelines, one per data-parallel copy
("3D": data x tensor x pipeline).

pp x FSDP2 (an FSDP2 preset, `ShardedStages`): the same mesh with tp_size 1, each stage sharded by torch's
`fully_shard` over its "dp" ranks instead of held whole by each copy (torchtitan's pp x fsdp; see the class).

Loading: with full fine-tuning each rank reads only its stages' decoder layers from the checkpoint, plus the
embeddings, the final norm and the head (`layers_to_load` -> `model.load_decoder_layers`: the other layers stay on the
meta device, with their names and shapes, until `prepare` drops them), so a machine's processes hold the model about
once in host memory, not once each. With adapters every rank reads the whole model: peft draws each adapter's
initialisation from the global generator in module order, and one process's draws are kept only over the whole model.

pp x tp: every rank loads the model with transformers' tp plan over its tp group (`tensor.model_load_kwargs`: each
rank reads 1/tp of every layer it reads), then keeps only its stage's layers, so the plan applies per stage to the
layers the stage owns; the stage's forward runs transformers' sharded layers (their collectives inside the tp group).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor, Replicate

from hftrain.checkpoint import newest_intact
from hftrain.compat.torch import forward_order_with_comms, running_order
from hftrain.compat.transformers import accumulation_safe_partial_gradients
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.memory import ParameterCounts
from hftrain.metrics import param_checksum
from hftrain.model import HEAD_ONLY_MODEL_TYPES, router_coefficient
from hftrain.optim import build_optimizer
from hftrain.parallel.base import ALL_PARTS, Backend, DataParallel, Parallelism
from hftrain.parallel.checkpoint_io import PipelineCheckpoints
from hftrain.parallel.launch import Launch
from hftrain.parallel.tensor import model_load_kwargs
from hftrain.paths import STATE_FILE
from hftrain.stages import (
    STAGES_PER_PROCESS,
    optimizer_layout,
    resume_layout_problem,
    stage_layout,
)

# Causal LMs whose base forward does nothing outside the planned modules besides positions, masks and rotary
# embeddings (read in transformers 5.23), and whose logits are lm_head(hidden states). Granite, for one, multiplies
# the embeddings by `embedding_multiplier` inside forward(): every stage would repeat it.
PIPELINE_MODEL_TYPES = HEAD_ONLY_MODEL_TYPES


def microbatches(recipe: Recipe) -> int:
    """Microbatches per pipeline step: the recipe's, or 2 x the pipeline's stages."""
    stages = recipe.pp_size * STAGES_PER_PROCESS.get(recipe.pp_schedule, 1)
    return recipe.pp_microbatches if recipe.pp_microbatches is not None else 2 * stages


def resume_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """A resume_from_checkpoint folder whose layout this run cannot read (`resume_layout_problem`: pp checkpoints
    under FSDP2 / DeepSpeed, FSDP2 / ZeRO / tensor-parallel ones under pp), before the weights load. `latest` is
    the checkpoint resolve_resume will take (the newest intact one in output_dir)."""
    path = recipe.resume_from_checkpoint
    label = f"resume_from_checkpoint {path!r}"
    if path == "latest" and (newest := newest_intact(Path(recipe.output_dir))) is not None:
        label, state = f"resume_from_checkpoint latest ({newest})", newest / STATE_FILE
    else:
        state = Path(path) / STATE_FILE if path not in (None, "latest") else None
    if state is None or not state.is_file():
        return []  # no checkpoint, or one that resolve_resume reports as incomplete
    try:
        saved = json.loads(state.read_text(encoding="utf-8"))["launch"]
    except (ValueError, KeyError):
        return []  # a damaged record: resolve_resume's check names it
    sharded_by = {"fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}.get(launch.kind)
    problem = resume_layout_problem(saved, recipe.pp_size, sharded_by)
    return [f"{label}: {problem}"] if problem else []


def pipeline_problems(recipe: Recipe, launch: Launch, model_config) -> list[str]:
    """pp_size: what the launch and the model's config must allow, before the weights load (and a checkpoint to
    resume whose layout a pipeline cannot read, or a pipeline checkpoint that this launch cannot)."""
    problems = resume_problems(recipe, launch)
    pp = recipe.pp_size
    if pp <= 1:
        return problems
    if launch.kind == "deepspeed":
        problems.append(f"pp_size={pp} with a deepspeed preset: hftrain's pipeline runs with data-parallel copies of "
                        "the pipeline on a DDP-type preset (cpu_pp on CPU, pp on GPUs) or with each stage sharded by "
                        "FSDP2 (an fsdp2 preset); ZeRO per stage is not built (docs/pipeline.md)")
    elif launch.kind == "fsdp2":
        problems += fsdp2_stage_problems(recipe, launch)
    elif launch.world % (pp * recipe.tp_size):
        size = f"pp_size={pp}" + (f" x tp_size={recipe.tp_size}" if recipe.tp_size > 1 else "")
        problems.append(f"{size} does not divide the {launch.world} processes of this launch; use {size} processes "
                        "(cpu_pp / pp preset) or a multiple of it for data-parallel copies of the pipeline")
    if model_config is None:
        return problems
    kind = model_config.model_type
    plan = getattr(model_config, "base_model_pp_plan", None)
    if not plan:
        problems.append(f"pp_size={pp}: the model ({kind!r}) has no pipeline plan (base_model_pp_plan in its "
                        "transformers config), so hftrain does not know how its forward splits into stages")
    elif kind not in PIPELINE_MODEL_TYPES or list(plan) != ["embed_tokens", "layers", "norm"]:
        problems.append(f"pp_size={pp}: the model ({kind!r}) is not one whose forward hftrain has checked for work "
                        "outside its pipeline plan (each stage would repeat it, e.g. Granite's embedding_multiplier) "
                        f"and whose logits are lm_head(hidden states): {', '.join(sorted(PIPELINE_MODEL_TYPES))}")
    else:
        stages = pp * STAGES_PER_PROCESS[recipe.pp_schedule]
        layers = model_config.get_text_config().num_hidden_layers
        if layers < stages:
            problems.append(f"pp_size={pp} with pp_schedule={recipe.pp_schedule} needs {stages} stages of at least "
                            f"one layer each, and the model has {layers} layers; use a smaller pp_size or 1F1B")
    if router_coefficient(model_config, recipe.router_aux_loss_coef):
        problems.append(f"pp_size={pp} with a mixture-of-experts router loss: each stage holds only its layers' "
                        "routers and the loss would need them all on the last stage; set router_aux_loss_coef: 0")
    return problems


def fsdp2_stage_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """pp_size under an FSDP2 preset (`ShardedStages`): each stage sharded by FSDP2 over its data-parallel
    ranks. What that layout does not run."""
    pp, world, problems = recipe.pp_size, launch.world, []
    layout = f"pp_size={pp} with an fsdp2 preset (each stage sharded by FSDP2 over its data-parallel ranks)"
    if recipe.tp_size > 1:
        problems.append(f"{layout} and tp_size={recipe.tp_size}: tensor parallelism inside FSDP2-sharded stages is "
                        "not built; use the cpu_pp / pp preset for pp x tp (data-parallel copies of the pipeline)")
    elif world % pp or world < 2 * pp:
        problems.append(f"{layout} needs a multiple of pp_size processes, at least {2 * pp} (2 data-parallel ranks "
                        f"per stage); this launch is {world}. For a pipeline without copies use the cpu_pp / pp preset")
    if launch.fsdp_offload:
        problems.append(f"{layout} and fsdp_offload_params: true: CPU offload of sharded stages is not built (the "
                        "pipeline's receive buffers, loss and clipping stay on the device); set it to false in the "
                        "preset, or use FSDP2 without pp_size")
    if recipe.pp_schedule in V_SCHEDULES:
        problems.append(f"{layout} and pp_schedule={recipe.pp_schedule}: its V puts the first and the last stage on "
                        "one process, so a tied embedding and head would be one parameter in two FSDP2 roots, and "
                        "torch's split weight backward is not tested under FSDP2 here; use 1F1B, GPipe or "
                        "Interleaved1F1B")
    if recipe.load_in_4bit or recipe.load_in_8bit:
        problems.append(f"{layout} and QLoRA (load_in_4bit / load_in_8bit): bitsandbytes' quantized weights under "
                        "torch's fully_shard in hftrain's stages are not built (accelerate's FSDP2 preparation, which "
                        "handles their storage, wraps one whole model); use the cpu_pp / pp preset")
    return problems


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sharded(tensor: torch.Tensor) -> bool:
    """Whether a DTensor is split over its tp group (each rank holds a part); a plain tensor or a replicated DTensor
    is whole on every rank. transformers' tp plans give weights and gradients Shard or Replicate placements."""
    placements = getattr(tensor, "placements", ())
    if any(p.is_partial() for p in placements):
        raise HftrainError(f"a gradient with a partial placement ({placements}): reduce it before clipping")
    return any(p.is_shard() for p in placements)


def sum_whole(grad: torch.Tensor, group) -> None:
    """Sum `grad` in place over `group` (the tied embedding's first and last stage), as whole tensors: under tp the
    two sides' gradients can be laid out differently (transformers' embedding gives its sharded weight a replicated
    gradient, the head a vocabulary shard), so a shard is gathered inside its tp group, summed whole, and this rank's
    part taken back."""
    if not isinstance(grad, DTensor):
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return
    whole = grad.full_tensor()
    dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group)
    replicated = DTensor.from_local(whole, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim, run_check=False)
    grad.to_local().copy_(replicated.redistribute(grad.device_mesh, grad.placements).to_local())


class Elsewhere(nn.Module):
    """Placeholder for a module that another pipeline stage holds: no parameters, and passes its first argument
    (hidden states) through, so the model's own forward skips it."""

    def __init__(self, name: str):
        super().__init__()
        self.held_by_another_stage = name

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def extra_repr(self) -> str:
        return self.held_by_another_stage


def causal_lm(lm: nn.Module) -> nn.Module:
    """The transformers causal LM inside a peft wrapper, or `lm` itself."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


class StageForward(nn.Module):
    """One pipeline stage: the base model's own forward over this stage's layers (the others skipped), from token
    ids (first stage) or received hidden states; the final norm only on the last stage. Registers only this stage's
    modules, so `parameters()` are the stage's. `packed`: rows hold several documents, whose position_ids (restarting
    at each document) travel with the hidden states to every stage, where transformers' masks keep the documents
    apart as without pp."""

    def __init__(self, lm: nn.Module, index: int, count: int, layers: range, packed: bool = False):
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == count - 1
        self.packed = packed
        decoder = causal_lm(lm).get_decoder()
        total = len(decoder.layers)
        self.layers = nn.ModuleList([decoder.layers[i] if i in layers else Elsewhere(f"layer {i}")
                                     for i in range(total)])
        self.norm = decoder.norm if self.is_last else Elsewhere("norm")
        if self.is_first:
            self.embed_tokens = decoder.embed_tokens
        if self.is_last:  # applied in the schedule's loss_fn (token_loss); registered here so that the V schedules'
            # split backward, which computes weight gradients for the stage module's parameters only, reaches it
            self.lm_head = causal_lm(lm).get_output_embeddings()
        object.__setattr__(self, "_decoder", decoder)  # not a submodule: the rank's tree is registered elsewhere

    @contextmanager
    def _as_this_stage(self):
        decoder = self._decoder
        kept = decoder.layers, decoder.norm
        decoder.layers, decoder.norm = self.layers, self.norm
        try:
            yield decoder
        finally:
            decoder.layers, decoder.norm = kept

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        with self._as_this_stage() as decoder:
            inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
            hidden = decoder(**inputs, position_ids=position_ids, use_cache=False).last_hidden_state
        if torch.is_grad_enabled() and not hidden.requires_grad:
            # a first stage that trains nothing (LoRA adapters only on later stages' modules): torch's schedule still
            # runs its backward, which needs an output in the graph; as a leaf it receives the gradient and stops
            hidden = hidden.detach().requires_grad_()
        return (hidden, position_ids) if self.packed and not self.is_last else hidden


def keep_only(lm: nn.Module, owned_layers: set[int], first: bool, last: bool) -> None:
    """Replace, in the rank's module tree, what other stages hold by placeholders (parameter names kept)."""
    hf = causal_lm(lm)
    decoder = hf.get_decoder()
    for i in range(len(decoder.layers)):
        if i not in owned_layers:
            decoder.layers[i] = Elsewhere(f"layer {i}")
    if not first:
        decoder.embed_tokens = Elsewhere("embed_tokens")
    if not last:
        decoder.norm = Elsewhere("norm")
        hf.lm_head = Elsewhere("lm_head")


def forward_only_order(schedule, pp: int, microbatches: int) -> dict:
    """For a ZBVZeroBubble / DualPipeV `schedule`: a forward-only order of its actions, for evaluation. torch 2.13's V
    schedules run their training order in `eval()` too, whose backward actions then fail ("can't steal_bwd_input if
    this stage doesn't have backward"). Each rank runs its first stage for every microbatch, then its second (stages r
    and 2 pp - 1 - r): a rank's second stage waits only on the next rank, which finished its first stage's part
    without waiting on anyone later, so the order cannot deadlock. torch's lowering adds the sends and receives
    (`compat.torch.forward_order_with_comms`). The schedule itself runs it (`PipelineStages.forward` swaps it in):
    a second schedule over the same stages would leave them initialised for forward only behind the first's back."""
    order = {rank: [(stage, mb) for stage in (rank, 2 * pp - 1 - rank) for mb in range(microbatches)]
             for rank in range(pp)}
    return forward_order_with_comms(order, stage_to_rank=schedule.stage_index_to_group_rank.get, num_stages=2 * pp)


class PipelineStages(nn.Module):
    """The prepared model under pp: this process's stages of the loss module `module` (its placeholders in place)
    and the schedule that runs them. `train_step` runs one pipeline step (forward and backward of every microbatch);
    calling the module runs a forward-only step (evaluation) and returns the summed token loss on the last stage,
    0 elsewhere."""

    def __init__(self, module: nn.Module, stages: list[StageForward], schedule, microbatches: int,
                 train_rows: int, eval_rows: int, max_length: int):
        super().__init__()
        self.module = module
        self.stages = stages
        object.__setattr__(self, "schedule", schedule)
        self.eval_order: dict | None = None  # a V schedule's forward-only order (`forward_only_order`)
        self.microbatches, self.max_length = microbatches, max_length
        self.rows = {True: train_rows, False: eval_rows}
        self.packed = stages[0].packed
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def token_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn, on the last stage, per microbatch: the summed cross-entropy of the trained
        positions (recorded unscaled) times the step's scale (1 / the step's trained tokens, see `train_step`)."""
        trained = targets != IGNORE_INDEX
        head = causal_lm(self.module.lm).get_output_embeddings()
        loss = F.cross_entropy(head(hidden[trained]).float(), targets[trained], reduction="sum")
        self.sums.append(loss.detach())
        return loss * self.scale

    def _inputs(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None):
        """Fixed shapes: rows padded to this mode's row count, columns to max_length; the padding has no target.
        Targets are the labels shifted (position t predicts token t+1), aligned with the hidden states. Packed rows'
        position_ids are padded with 0: each padding token is a document of its own, after every real token."""
        rows, width = input_ids.shape
        wanted = self.rows[self.training]
        if rows > wanted or width > self.max_length:
            raise HftrainError(f"a micro-batch of {rows} x {width} tokens exceeds the pipeline's fixed "
                               f"{wanted} x {self.max_length}")
        pad = (0, self.max_length - width, 0, wanted - rows)
        targets = F.pad(F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX), pad, value=IGNORE_INDEX)
        if self.packed:  # every batch carries them (an unpacked one: one document per row), so shapes stay fixed
            position_ids = torch.arange(width, device=input_ids.device).expand(rows, width) \
                if position_ids is None else position_ids
            return (F.pad(input_ids, pad, value=0), F.pad(position_ids, pad, value=0)), targets
        return (F.pad(input_ids, pad, value=0),), targets

    def _run(self, input_ids, labels, position_ids, step) -> torch.Tensor:
        inputs, targets = self._inputs(input_ids, labels, position_ids)
        self.sums = []
        args = inputs if self.has_first else ()
        step(*args, target=targets if self.has_last else None, losses=[] if self.has_last else None,
             return_outputs=False)
        # On a (re)initialisation (the first step, and the first after a train/eval switch) torch infers the stages'
        # shapes by calling loss_fn once on uninitialised tensors before the real microbatches: only the last
        # `microbatches` sums are this batch's.
        sums, self.sums = self.sums[-self.microbatches:] if self.has_last else [], []
        return torch.stack(sums).sum() if sums else torch.zeros((), device=input_ids.device)

    def train_step(self, input_ids, labels, scale: float, position_ids=None) -> torch.Tensor:
        """Forward and backward of one per-device batch in `microbatches` microbatches; returns the detached summed
        token loss (0 off the last stage). `scale` multiplies each microbatch's loss sum before its backward, and the
        schedule does not rescale (`scale_grads=False`)."""
        self.scale = scale
        return self._run(input_ids, labels, position_ids, self.schedule.step)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """What accelerate's `no_sync` calls on an FSDP2 model between accumulation steps: nothing here. Under pp x
        FSDP2 torch's schedule decides each microbatch's sync itself and reduce-scatters at the end of every pipeline
        step (`PipelineStage.perform_reduce_grad` sets it back to True), so the sync cannot be deferred to the last
        accumulation step; the reduced blocks accumulate in the sharded gradients."""

    def forward(self, input_ids, labels, position_ids=None, **_):
        self.scale = 1.0
        if self.eval_order is None:
            return self._run(input_ids, labels, position_ids, self.schedule.eval)
        with running_order(self.schedule, self.eval_order):
            return self._run(input_ids, labels, position_ids, self.schedule.eval)


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
