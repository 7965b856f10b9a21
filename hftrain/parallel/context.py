"""Context parallelism (torch ring attention, through accelerate's ParallelismConfig): each sequence split over
`cp_size` processes under FSDP2.

The `cp_size` consecutive ranks of a context group train on the same micro-batches (accelerate's mesh order puts
"cp" inside "dp_shard": rank = dp_rank * cp + cp_rank); FSDP2 shards the model over all of them (`dp_shard_cp`).
Around each micro-batch's forward *and* backward, `accelerator.maybe_context_parallel` shards the buffers along the
sequence (torch's head-tail load balancer: rank r holds chunks r and 2cp-1-r, so causal work is even) and routes
`scaled_dot_product_attention` through torch's ring, which passes key/value blocks around the group; accelerate's
hooks drop the model's attention mask for `is_causal`. That is plain causal attention over the whole row, so:

- packed rows are refused up front (ring attention would attend across packed examples: axolotl #3608);
- rows are right-padded (hftrain's collator) and a causal token never attends to the padding after it;
- labels are shifted *before* sharding (a chunk's last position predicts the next chunk's first token), and the
  row is padded to a multiple of 2 x cp_size with target-less positions;
- each rank's summed token loss is all-reduced over the context group (differentiably, `GroupSum`), so every rank
  returns the micro-batch's full loss sum and the loop counts tokens once per group (`DataParallel` with
  replicas = cp), as for a sequence- or tensor-parallel group. FSDP2's gradient mean over all dp x cp processes then
  leaves the gradient of one process with the same batch (parallel/sequence.py has the arithmetic).

GRPO (objective grpo): generation runs outside the ring's context, on whole sequences on every rank of the group (its
ranks share one data-parallel rank, so they sample the same completions); the loss module's `sliced_forward` shards
its own per-token inputs (targets, completion and tool masks, advantages, old and reference log-probs) with the
tokens, in the ring's layout (`RingSlices`), and the policy's forward and backward, the stored old log-probs' forward
and the reference's (beta > 0) run on this rank's shards inside the ring's context, the log-probs gathered back whole.

`RingAttention` is the transform hftrain.parallel applies for `cp_size` over the FSDP2 backend, or, with tensor
parallelism too (tp x cp), after the tensor-parallel transform (FSDP2 x TP), where the same ring runs on hftrain's
own ("dp", "cp", "tp") mesh, since accelerate's mesh comes with its broken TP preparation (see the class).

Kernels: torch 2.13's ring dispatches the CUDA flash / memory-efficient / cuDNN SDPA kernels. It has no entry for
the CPU kernel, so on CPU the backend refuses, unless an entry was registered (the CPU test launcher registers
torch's own ring with the CPU flash kernel: tests/launchers/context_parallel_on_cpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.utils import TorchContextParallelConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from hftrain.compat.accelerate import attach_context_parallel_hooks
from hftrain.compat.torch import ring_attention_kernels, set_ring_rotate_method
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.parallel.base import Parallelism, Transform, with_copies
from hftrain.parallel.sequence import GroupSum

CPU_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def ring_kernels() -> set[str]:
    """The SDPA kernels torch's ring attention dispatches (its custom DTensor handlers), by name."""
    return ring_attention_kernels()


def ring_inputs(batch: dict[str, torch.Tensor], cp: int) -> dict[str, torch.Tensor]:
    """The micro-batch as context_parallel shards it: input_ids, shifted targets and positions, each row padded to a
    multiple of 2 x cp (the load balancer's chunks) with target-less positions. Fresh tensors: the context manager
    resizes them in place to this rank's shards."""
    input_ids = batch["input_ids"]
    rows, width = input_ids.shape
    fill = -width % (2 * cp)
    targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # shifted before sharding
    # the fill comes after every real token (causal: no real token sees it) and has no target; its positions repeat
    # the row's last one, so no position exceeds max_length (a learned position table ends there)
    positions = torch.arange(width + fill, device=input_ids.device).clamp(max=width - 1)
    return {"input_ids": F.pad(input_ids, (0, fill)),
            "shift_labels": F.pad(targets, (0, fill), value=IGNORE_INDEX),
            "position_ids": positions.repeat(rows, 1)}


def ring_width(width: int, cp: int) -> int:
    """A row's width padded to the load balancer's 2 x cp chunks."""
    return width + (-width % (2 * cp))


@dataclasses.dataclass(frozen=True)
class RingSlices:
    """This rank's share of a micro-batch as the ring lays it out: each row padded to a multiple of 2 x cp, cut into
    2 x cp chunks along the sequence, chunks `rank` and 2 x cp - 1 - `rank` this rank's (torch's head-tail load
    balancer, which its ring's causal arithmetic assumes). `SequenceSlices`' interface, for loss modules that shard
    their own per-token inputs (grpo's `GRPOLoss.sliced_forward`); rows stay rows ([rows, 2 x chunk] per rank)."""

    group: object
    cp: int
    rank: int

    def index(self, width: int, device) -> torch.Tensor:
        """The positions of a padded row this rank holds, in order."""
        chunk = ring_width(width, self.cp) // (2 * self.cp)
        head = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=device)
        tail = torch.arange((2 * self.cp - 1 - self.rank) * chunk, (2 * self.cp - self.rank) * chunk, device=device)
        return torch.cat([head, tail])

    def local(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        """[rows, width] -> this rank's [rows, 2 x chunk], the padding `fill`."""
        width = tensor.shape[1]
        padded = F.pad(tensor, (0, ring_width(width, self.cp) - width), value=fill)
        return padded[:, self.index(width, tensor.device)]

    def positions(self, rows: int, width: int, device) -> torch.Tensor:
        """This rank's position_ids: the row's own, the padding repeating its last (as `ring_inputs`)."""
        whole = torch.arange(ring_width(width, self.cp), device=device).clamp(max=width - 1)
        return whole[self.index(width, device)].expand(rows, -1)

    def gather(self, local: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """The inverse of `local` over the group, without gradient: every rank's chunks -> [rows, width]."""
        pieces = [torch.empty_like(local) for _ in range(self.cp)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        order = torch.cat([dataclasses.replace(self, rank=r).index(width, local.device) for r in range(self.cp)])
        whole = torch.empty(rows, ring_width(width, self.cp), dtype=local.dtype, device=local.device)
        whole[:, order] = torch.cat(pieces, dim=1)
        return whole[:, :width]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """A statistic's sum over the group's shards (no gradient)."""
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total


class RingAttention(Transform):
    """Context parallelism over an FSDP2 backend: each sequence split over the `cp_size` consecutive ranks of a
    context group, through torch's ring attention. The CPU kernel checked when built; the context group's loss
    summed (`apply`), each micro-batch sharded around its forward and backward (`micro_batch`).

    Meshes: alone (FSDP2), accelerate's (its ParallelismConfig, built from the recipe: `maybe_context_parallel`).
    With tensor parallelism (after the `TensorParallel` transform, over `FSDP2Backend`: processes = dp x cp x tp, tp
    innermost, rank = (dp_rank * cp + cp_rank) * tp + tp_rank) hftrain's own ("dp", "cp", "tp") mesh: transformers
    loads the model as for FSDP2 x TP with fsdp_size = dp x cp (FSDP2 shards every tp shard over the data-parallel
    *and* context ranks, as accelerate's dp_shard_cp does), and each tp rank rings its own heads' keys and values
    with the ranks holding the same heads on the other chunks of the sequence. accelerate's ParallelismConfig would
    compose the same layout, but its TP preparation imports transformers' removed ReplicateParallel, so neither
    accelerate's mesh nor its `maybe_context_parallel` is used there: torch's `context_parallel` on hftrain's mesh,
    with accelerate's attention-mask hooks and rotate method. The arithmetic is the two layouts' own: the group loss
    is the micro-batch's (cp) and identical over the tp ranks (transformers gathers the head's vocabulary shards),
    FSDP2's mean over dp x cp ranks undoes GroupSum's cp."""

    axis = "cp"
    strategies = frozenset({"fsdp2"})
    beside = frozenset({"tp"})

    def __init__(self, backend):
        super().__init__(backend)
        accelerator, recipe = backend.accelerator, backend.recipe
        self.cp, tp = recipe.cp_size, recipe.tp_size
        if accelerator.device.type == "cpu" and CPU_SDPA not in ring_kernels():
            raise HftrainError(
                f"cp_size={self.cp} on CPU: torch's ring attention dispatches only the CUDA SDPA kernels "
                f"(flash, memory-efficient, cuDNN) and has no entry for {CPU_SDPA}; run cp on CUDA GPUs, or use "
                "sp_size with the cpu_sp preset on CPU (docs/long-context.md)")
        self.mesh = None  # alone: accelerate's
        self.slices: RingSlices | None = None  # a loss module sharding its own inputs (grpo): set by apply
        if tp > 1:
            world = accelerator.num_processes
            self.mesh = init_device_mesh(accelerator.device.type, (world // (self.cp * tp), self.cp, tp),
                                         mesh_dim_names=("dp", "cp", "tp"))

    def describe(self, record: Parallelism) -> Parallelism:
        name = with_copies(f"{record.name} + ring attention context parallel (cp_size={self.cp})", record.processes,
                           self.backend.dp.replicas)
        return dataclasses.replace(record, name=name, cp_size=self.cp)

    def apply(self, model) -> None:
        """The loss module's forward on this rank's shards: its own `sliced_forward` where it shards per-token inputs
        of its own (grpo), with `RingSlices`; else its forward on the buffers `micro_batch` shards, the group's loss
        summed."""
        mesh = self.backend.accelerator.torch_device_mesh["cp"] if self.mesh is None else self.mesh["cp"]
        if self.mesh is not None:
            set_ring_rotate_method(TorchContextParallelConfig().cp_comm_strategy)  # accelerate's default or env
            attach_context_parallel_hooks(model)  # accelerate's: the attention mask dropped for is_causal
        group = mesh.get_group()
        if hasattr(model, "sliced_forward"):
            self.slices = RingSlices(group, self.cp, mesh.get_local_rank())
            model.forward = functools.partial(model.sliced_forward, self.slices)
            model.reference_shards = self.slices  # its reference's forward (grpo's beta > 0) sharded alike
            frozen = getattr(getattr(model, "reference", None), "module", None)  # a frozen copy, prepared apart
            if frozen is not None:  # accelerate's hooks reach the prepared model only: the mask dropped here too
                attach_context_parallel_hooks(frozen)
            return
        forward = model.forward

        def group_loss(**inputs) -> torch.Tensor:
            # Collective that changes the number: the context group's loss sum, differentiable (its backward sums
            # the ranks' upstream gradients: each shard gets cp x its own, undone by FSDP2's mean over all ranks).
            return GroupSum.apply(forward(**inputs), group)

        model.forward = group_loss

    def ring_context(self, buffers: list[torch.Tensor]):
        """The context manager that shards the buffers along the sequence and routes SDPA through the ring."""
        if self.mesh is None:
            return self.backend.accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers))
        return context_parallel(self.mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                no_restore_buffers=set(buffers))

    @contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]):
        if self.slices is not None:
            # the loss module shards its own inputs (`RingSlices`); the ring's context routes its attention. torch
            # turns the load balancer on for the buffers' length (its causal ring arithmetic reads that flag): one
            # throwaway buffer of the padded width, sharded like the rows
            width = ring_width(batch["input_ids"].shape[1], self.cp)
            with self.ring_context([torch.empty(1, width, device=batch["input_ids"].device)]):
                yield batch
            return
        inputs = ring_inputs(batch, self.cp)
        with self.ring_context(list(inputs.values())):
            yield inputs
