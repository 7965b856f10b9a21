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

Kernels: torch 2.13's ring dispatches the CUDA flash / memory-efficient / cuDNN SDPA kernels. It has no entry for
the CPU kernel, so on CPU the backend refuses, unless an entry was registered (the CPU test launcher registers
torch's own ring with the CPU flash kernel: tests/launchers/context_parallel_on_cpu.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention  # torch's ring attention

from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.parallel.base import DataParallel, Parallelism
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.sequence import GroupSum
from hftrain.parallel.tensor import shared_batch_layout, with_copies

CPU_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def ring_kernels() -> set[str]:
    """The SDPA kernels torch's ring attention dispatches (its custom DTensor handlers), by name."""
    return {str(op) for op in _attention.custom_ops}


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


class ContextParallelBackend(FSDP2Backend):
    """FSDP2 with torch ring attention over groups of `cp_size` consecutive ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.accelerator.device.type == "cpu" and CPU_SDPA not in ring_kernels():
            raise HftrainError(
                f"cp_size={self.cp} on CPU: torch's ring attention dispatches only the CUDA SDPA kernels "
                f"(flash, memory-efficient, cuDNN) and has no entry for {CPU_SDPA}; run cp on CUDA GPUs, or use "
                "sp_size with the cpu_sp preset on CPU (docs/long-context.md)")

    @property
    def cp(self) -> int:
        return self.recipe.cp_size

    def data_parallel(self) -> DataParallel:
        return shared_batch_layout(self.accelerator, self.cp)

    def make_record(self, **layout) -> Parallelism:
        record = super().make_record(**layout)
        name = with_copies(f"{record.name} + ring attention context parallel (cp_size={self.cp})", record.processes,
                           self.cp)
        return dataclasses.replace(record, name=name, cp_size=self.cp)

    def prepare(self, model, optimizer):
        group = self.accelerator.torch_device_mesh["cp"].get_group()
        forward = model.forward

        def group_loss(**inputs) -> torch.Tensor:
            # Collective that changes the number: the context group's loss sum, differentiable (its backward sums
            # the ranks' upstream gradients: each shard gets cp x its own, undone by FSDP2's mean over all ranks).
            return GroupSum.apply(forward(**inputs), group)

        model.forward = group_loss
        return super().prepare(model, optimizer)

    @contextmanager
    def micro_batch(self, batch: dict[str, torch.Tensor]):
        inputs = ring_inputs(batch, self.cp)
        buffers = list(inputs.values())
        with self.accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                     no_restore_buffers=set(buffers)):
            yield inputs
