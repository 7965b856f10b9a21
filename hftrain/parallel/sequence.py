"""Sequence parallelism (DeepSpeed Ulysses / ALST): each sequence split over `sp_size` processes.

The `sp_size` consecutive ranks of a sequence group train on the same micro-batches (rank = dp_rank * sp + sp_rank,
the layout of DeepSpeed's `parallel_state_sp`); each runs the model on its 1/sp slice of the sequence. DeepSpeed's
`UlyssesSPAttentionHF` (registered with transformers in place of the model's attention kernel) all-to-alls the
slices' query/key/value so that every rank attends over the whole sequence with 1/sp of the heads, then back.
Activations outside attention are per slice: activation memory per process is about 1/sp.

What hftrain adds around the library (`ShardedTokenLoss`), following ALST's loss recipe:
- labels are shifted *before* slicing (a slice's last position predicts the next slice's first token);
- the micro-batch's rows become one row, each row (and each packed example) a document told apart by its
  position_ids, which DeepSpeed all-gathers in the attention: flash attention turns them into per-document lengths,
  sdpa gets a block-diagonal causal mask built from them (`sdpa_within_documents`), so no token attends across
  examples (axolotl #3608 trained across them). The row is padded to a multiple of sp with a target-less document;
- each rank's summed token loss is all-reduced over the sequence group (differentiably), so every rank returns the
  micro-batch's full loss sum: the loop counts tokens, examples and losses of the full micro-batch once per group
  (`DataParallel` with replicas = sp), exactly as for a tensor-parallel group.

GRPO (objective grpo): generation and the reference's log-probs see whole sequences on every rank of the group
(`UlyssesSwitch.whole`: the model's own kernel, no all-to-all; the group's ranks sample the same completions from the
same prompts and seeds, as a tensor-parallel group's do); the loss module's forward slices its rows as above
(`SequenceSlices`), and its per-token weights (advantages, masks, old and reference log-probs) with them
(hftrain.rl.grpo `GRPOLoss.sliced_forward`).

Gradients: each rank back-propagates the full loss, so the all-reduce's backward hands every slice sp x its own
gradient; the strategy (DeepSpeed's engine) then averages gradients over all dp x sp processes, which leaves the
sum over the group's slices averaged over the dp copies, i.e. the gradient of one process with the same batch.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hftrain.compat.transformers import attn_implementation
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.parallel.base import Parallelism, Transform, with_copies

# attention kernels DeepSpeed's Ulysses wrapper can drive with documents kept apart (eager materialises a 4D mask
# and is refused by DeepSpeed; flex_attention is rebuilt there with a plain causal mask, which would attend across
# packed examples and rows)
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[rows, 1, L, L] boolean mask: causal within each document, a document starting where position_ids is 0."""
    documents = (position_ids == 0).cumsum(dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def sdpa_within_documents(sdpa, module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
    """transformers' sdpa with the block-diagonal causal mask of the (gathered) position_ids: Ulysses drops the
    model's mask, which was built for one slice. One document: plain causal attention, no mask."""
    if attention_mask is None and position_ids is not None and int((position_ids == 0).sum()) > len(position_ids):
        attention_mask = document_mask(position_ids)
    return sdpa(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)


class UlyssesSwitch:
    """What the model's attention kernel name runs: DeepSpeed's Ulysses over the group's slices, or, inside `whole()`,
    the kernel itself over the whole sequences every rank holds (grpo's generation and reference forwards). Ulysses'
    all-to-all is recorded by autograd in the forward, so backward passes need no switch."""

    def __init__(self, ulysses, kernel):
        self.ulysses, self.kernel, self.depth = ulysses, kernel, 0

    def __call__(self, *args, **kwargs):
        return (self.kernel if self.depth else self.ulysses)(*args, **kwargs)

    @contextmanager
    def whole(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def register_ulysses(lm, sp: int):
    """DeepSpeed's Ulysses attention in place of the model's kernel (transformers' ALL_ATTENTION_FUNCTIONS, for this
    process), behind a `UlyssesSwitch`; returns (its sequence-parallel group, the switch). Micro-batches reach it as
    one row (`ShardedTokenLoss`, `SequenceSlices`)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    kernel = attn_implementation(lm.config)
    if kernel not in SP_ATTENTION:
        raise HftrainError(f"sp_size={sp} needs attn_implementation sdpa or flash_attention_2, the model runs "
                           f"{kernel!r}")
    if kernel == "sdpa":  # wrapped by Ulysses below: it then sees the whole sequence and its position_ids
        ALL_ATTENTION_FUNCTIONS["sdpa"] = functools.partial(sdpa_within_documents, ALL_ATTENTION_FUNCTIONS["sdpa"])
    whole = ALL_ATTENTION_FUNCTIONS[kernel]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=lm, core_attn_implementation=kernel, sequence_parallel_size=sp, micro_batch_size=1,
        seq_length_is_variable=True)
    switch = UlyssesSwitch(ALL_ATTENTION_FUNCTIONS[kernel], whole)
    ALL_ATTENTION_FUNCTIONS[kernel] = switch
    return mpu.get_sequence_parallel_group(), switch


class GroupSum(torch.autograd.Function):
    """Sum over a process group whose backward sums the upstream gradients over the group as well (each rank's
    input feeds every rank's output). torch.distributed.nn.functional.all_reduce without its deprecation."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


@dataclasses.dataclass(frozen=True)
class SequenceSlices:
    """This rank's slice of a micro-batch laid out as `ShardedTokenLoss` lays it: the rows concatenated into one,
    padded to a multiple of sp, cut into sp equal pieces, piece `rank` this rank's. For loss modules that slice their
    own per-token inputs (grpo)."""

    group: object
    sp: int
    rank: int

    def local(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """[rows, width] -> this rank's [1, piece] of the concatenated rows, the padding `fill`."""
        flat = tensor.reshape(1, -1)
        flat = F.pad(flat, (0, -flat.shape[1] % self.sp), value=fill)
        piece = flat.shape[1] // self.sp
        return flat[:, self.rank * piece:(self.rank + 1) * piece]

    def positions(self, rows: int, width: int, device) -> torch.Tensor:
        """This rank's position_ids: each row a document from 0, the padding a target-less document of its own."""
        whole = torch.arange(width, device=device).expand(rows, width).reshape(1, -1)
        fill = -(rows * width) % self.sp
        whole = torch.cat([whole, torch.arange(fill, device=device).reshape(1, -1)], dim=1)
        piece = whole.shape[1] // self.sp
        return whole[:, self.rank * piece:(self.rank + 1) * piece]

    def gather(self, local: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """The inverse of `local` over the group, without gradient: every rank's piece -> [rows, width]."""
        pieces = [torch.empty_like(local) for _ in range(self.sp)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces, dim=1)[0, :rows * width].reshape(rows, width)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """A statistic's sum over the group's slices (no gradient)."""
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total


class ShardedTokenLoss:
    """The loss module's forward on this rank's slice of the micro-batch, returning the group's full loss sum."""

    def __init__(self, forward, group, sp: int, rank: int):
        self.forward, self.group, self.sp, self.rank = forward, group, sp, rank

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                 real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if real_tokens is not None:
            raise HftrainError("sp_size > 1 with a mixture-of-experts router loss is not supported: each slice "
                               "would balance its own tokens; set router_aux_loss_coef: 0 or sp_size: 1")
        rows, width = input_ids.shape
        if position_ids is None:  # unpacked rows: one document each (right padding continues the row's run)
            position_ids = torch.arange(width, device=input_ids.device).expand(rows, width)
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # shifted before slicing: ALST's recipe
        fill = -(rows * width) % self.sp  # a target-less document making the row divisible by sp
        ids = F.pad(input_ids.reshape(1, -1), (0, fill))
        targets = F.pad(targets.reshape(1, -1), (0, fill), value=IGNORE_INDEX)
        positions = torch.cat([position_ids.reshape(1, -1),
                               torch.arange(fill, device=input_ids.device).reshape(1, -1)], dim=1)
        piece = ids.shape[1] // self.sp
        mine = slice(self.rank * piece, (self.rank + 1) * piece)
        local = self.forward(ids[:, mine], position_ids=positions[:, mine], shift_labels=targets[:, mine])
        # Collective that changes the number: the group's loss sum, differentiable (its backward sums the ranks'
        # upstream gradients: each slice gets sp x its own, undone by the strategy's mean over all processes).
        return GroupSum.apply(local, self.group)


class UlyssesAttention(Transform):
    """Sequence parallelism over a DeepSpeed ZeRO backend: DeepSpeed's Ulysses attention over groups of `sp_size`
    consecutive ranks, the loss module's forward on this rank's slice (`ShardedTokenLoss`)."""

    axis = "sp"
    strategies = frozenset({"deepspeed"})

    def __init__(self, backend):
        super().__init__(backend)
        self.sp = backend.recipe.sp_size
        self.switch: UlyssesSwitch | None = None  # set by apply

    def describe(self, record: Parallelism) -> Parallelism:
        name = with_copies(f"{record.name} + Ulysses sequence parallel (sp_size={self.sp})", record.processes, self.sp)
        return dataclasses.replace(record, name=name, sp_size=self.sp)

    def apply(self, model) -> None:
        """The loss module's forward on this rank's slice: its own `sliced_forward` where it slices per-token inputs
        of its own (grpo), else `ShardedTokenLoss` around its forward."""
        group, self.switch = register_ulysses(model.lm, self.sp)
        if hasattr(model, "sliced_forward"):
            model.forward = functools.partial(model.sliced_forward, SequenceSlices(group, self.sp,
                                                                                   dist.get_rank(group)))
        else:
            model.forward = ShardedTokenLoss(model.forward, group, self.sp, dist.get_rank(group))

    @contextmanager
    def whole_sequences(self):
        if self.switch is None:
            yield
            return
        with self.switch.whole():
            yield
