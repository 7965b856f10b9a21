"""One stage of a pipeline: the model's own forward with the other stages' modules replaced by placeholders
(`Elsewhere`, `keep_only`, `StageForward`), the schedule over them (`PipelineStages`), and the tensor helpers the
gradients need under tp (`local`, `sharded`, `sum_whole`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hftrain.compat.torch import forward_order_with_comms, running_order
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError


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
