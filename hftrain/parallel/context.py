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

With tensor parallelism too (`TensorContextParallelBackend`, tp x cp) the same ring runs on hftrain's own
("dp", "cp", "tp") mesh, since accelerate's mesh comes with its broken TP preparation (see the class).

Kernels: torch 2.13's ring dispatches the CUDA flash / memory-efficient / cuDNN SDPA kernels. It has no entry for
the CPU kernel, so on CPU the backend refuses, unless an entry was registered (the CPU test launcher registers
torch's own ring with the CPU flash kernel: tests/launchers/context_parallel_on_cpu.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import TorchContextParallelConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from hftrain.compat.accelerate import attach_context_parallel_hooks
from hftrain.compat.torch import ring_attention_kernels, set_ring_rotate_method
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.parallel.base import DataParallel, Parallelism
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.sequence import GroupSum
from hftrain.parallel.tensor import FSDP2TensorParallelBackend, shared_batch_layout, with_copies

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


class RingAttention:
    """What context parallelism adds to an FSDP2 backend, whichever mesh it runs on: the CPU kernel check, the
    context group's loss and data share, and each micro-batch sharded around its forward and backward
    (`ring_context`: the context manager that shards the buffers and routes SDPA through the ring)."""

    recipe: Recipe
    accelerator: Any

    def check_ring_kernel(self) -> None:
        if self.accelerator.device.type == "cpu" and CPU_SDPA not in ring_kernels():
            raise HftrainError(
                f"cp_size={self.cp} on CPU: torch's ring attention dispatches only the CUDA SDPA kernels "
                f"(flash, memory-efficient, cuDNN) and has no entry for {CPU_SDPA}; run cp on CUDA GPUs, or use "
                "sp_size with the cpu_sp preset on CPU (docs/long-context.md)")

    @property
    def cp(self) -> int:
        return self.recipe.cp_size

    def sum_over_context_group(self, model, group) -> None:
        forward = model.forward

        def group_loss(**inputs) -> torch.Tensor:
            # Collective that changes the number: the context group's loss sum, differentiable (its backward sums
            # the ranks' upstream gradients: each shard gets cp x its own, undone by FSDP2's mean over all ranks).
            return GroupSum.apply(forward(**inputs), group)

        model.forward = group_loss

    def ring_context(self, buffers: list[torch.Tensor]):
        raise NotImplementedError

    @contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]):
        inputs = ring_inputs(batch, self.cp)
        with self.ring_context(list(inputs.values())):
            yield inputs


class ContextParallelBackend(RingAttention, FSDP2Backend):
    """FSDP2 with torch ring attention over groups of `cp_size` consecutive ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_ring_kernel()

    def data_parallel(self) -> DataParallel:
        return shared_batch_layout(self.accelerator, self.cp)

    def make_record(self, **layout) -> Parallelism:
        record = super().make_record(**layout)
        name = with_copies(f"{record.name} + ring attention context parallel (cp_size={self.cp})", record.processes,
                           self.cp)
        return dataclasses.replace(record, name=name, cp_size=self.cp)

    def prepare(self, model, optimizer):
        self.sum_over_context_group(model, self.accelerator.torch_device_mesh["cp"].get_group())
        return super().prepare(model, optimizer)

    def ring_context(self, buffers: list[torch.Tensor]):
        return self.accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                       no_restore_buffers=set(buffers))


class TensorContextParallelBackend(RingAttention, FSDP2TensorParallelBackend):
    """tp x cp under FSDP2: processes = dp x cp x tp, tp innermost (rank = (dp_rank * cp + cp_rank) * tp + tp_rank).
    transformers loads the model as for FSDP2 x TP with fsdp_size = dp x cp (FSDP2 shards every tp shard over the
    data-parallel *and* context ranks, as accelerate's dp_shard_cp does), and hftrain builds the context groups
    itself: the cp x tp consecutive ranks of a data-parallel rank share its batches; each tp rank rings its own
    heads' keys and values with the ranks holding the same heads on the other chunks of the sequence (the "cp" dim of
    a ("dp", "cp", "tp") mesh). accelerate's ParallelismConfig would compose the same layout, but its TP preparation
    imports transformers' removed ReplicateParallel, so neither accelerate's mesh nor its `maybe_context_parallel`
    is used: torch's `context_parallel` on hftrain's mesh, with accelerate's attention-mask hooks and rotate method.
    The arithmetic is the two layouts' own: the group loss is the micro-batch's (cp) and identical over the tp ranks
    (transformers gathers the head's vocabulary shards), FSDP2's mean over dp x cp ranks undoes GroupSum's cp."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_ring_kernel()
        world, cp, tp = self.accelerator.num_processes, self.cp, self.tp
        self.mesh = init_device_mesh(self.accelerator.device.type, (world // (cp * tp), cp, tp),
                                     mesh_dim_names=("dp", "cp", "tp"))

    def data_parallel(self) -> DataParallel:
        return shared_batch_layout(self.accelerator, self.cp * self.tp)

    def make_record(self, **layout) -> Parallelism:
        record = super().make_record(**layout)
        processes, cp, tp = record.processes, self.cp, self.tp
        name = (f"FSDP2 {'FULL_SHARD' if self.full_shard else 'SHARD_GRAD_OP'} (fsdp_size={processes // tp}) x "
                f"tensor parallel (tp_size={tp}) + ring attention context parallel (cp_size={cp})")
        return dataclasses.replace(record, kind="fsdp2_tp", name=with_copies(name, processes, cp * tp), cp_size=cp)

    def prepare(self, model, optimizer):
        set_ring_rotate_method(TorchContextParallelConfig().cp_comm_strategy)  # accelerate's default or env
        attach_context_parallel_hooks(model)  # accelerate's: the attention mask dropped for is_causal
        self.sum_over_context_group(model, self.mesh["cp"].get_group())
        return super().prepare(model, optimizer)

    def ring_context(self, buffers: list[torch.Tensor]):
        return context_parallel(self.mesh["cp"], buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                no_restore_buffers=set(buffers))
