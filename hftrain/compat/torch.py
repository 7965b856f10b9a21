"""torch internals hftrain uses (checked on torch 2.13, the version the test suite runs, and on 2.14.1, the newest
end `make test-newest` runs, whose source has each of them unchanged from 2.13).

- pipelining: the lowering of a hand-written action order into one with sends and receives (`_Action`,
  `_ComputationType`, `_add_send_recv` in torch/distributed/pipelining/schedules.py) and the order a runtime schedule
  runs (`pipeline_order_with_comms`), for the V schedules' forward-only evaluation (parallel/pipeline/);
- context parallelism: the SDPA kernels torch's ring attention dispatches and its rotate method
  (torch/distributed/tensor/experimental/_attention.py and _context_parallel/);
- DTensor: a rank's block of a sharded tensor (`compute_local_shape_and_global_offset`, torch/distributed/tensor/
  _utils.py);
- nn.Module: which buffers are persistent (`_non_persistent_buffers_set`) and whether a module was compiled in place
  (`_compiled_call_impl`, set by `Module.compile`).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from hftrain.compat import Use

try:  # private, so each may be missing from another torch: `require` says so before any of them is used
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _ComputationType
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.distributed.tensor.experimental._context_parallel import _attention
except ImportError:
    _Action = _add_send_recv = _ComputationType = compute_local_shape_and_global_offset = None
    set_rotate_method = _attention = None

CHECKED = ">=2.13,<2.15"

V_SCHEDULE_EVAL = Use("torch", CHECKED, "pipeline evaluation with a V schedule (ZBVZeroBubble, DualPipeV)")
RING_ATTENTION = Use("torch", CHECKED, "context parallelism (torch's ring attention)")
LOCAL_BLOCKS = Use("torch", CHECKED, "loading a full-state checkpoint into FSDP2 x TP shards")
PERSISTENT_BUFFERS = Use("torch", CHECKED, "saving a pipeline stage's trained buffers")


def forward_order_with_comms(stages: dict[int, list[tuple[int, int]]], stage_to_rank, num_stages: int) -> dict:
    """A forward-only pipeline order for a runtime schedule: `stages` gives each pipeline rank its (stage,
    microbatch) forwards in order; torch adds the sends and receives between them (`_add_send_recv`, what its
    schedules' `_prepare_schedule_with_comms` runs after a validation that demands a backward per forward)."""
    V_SCHEDULE_EVAL.require()
    order = {rank: [_Action(stage, _ComputationType.FORWARD, mb) for stage, mb in actions]
             for rank, actions in stages.items()}
    return _add_send_recv(order, stage_to_rank=stage_to_rank, num_stages=num_stages)


@contextmanager
def running_order(schedule, order: dict):
    """Run `schedule` (a torch runtime schedule) with `order` (from `forward_order_with_comms`) in place of its own
    while the block runs: the stages stay initialised by the one schedule that owns them."""
    V_SCHEDULE_EVAL.require()
    kept = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = order
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = kept


def ring_attention_kernels() -> set[str]:
    """The SDPA kernels torch's ring attention dispatches (its custom DTensor handlers), by name."""
    RING_ATTENTION.require()
    return {str(op) for op in _attention.custom_ops}


def set_ring_rotate_method(method: str) -> None:
    """How torch's ring attention passes key/value blocks around the context group ("allgather" or "alltoall")."""
    RING_ATTENTION.require()
    set_rotate_method(method)


def local_block(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and offset of this rank's block of a tensor of `shape` placed by `placements` on `mesh`."""
    LOCAL_BLOCKS.require()
    return compute_local_shape_and_global_offset(shape, mesh, placements)


def persistent_buffers(module: nn.Module) -> dict[str, object]:
    """`module`'s own persistent buffers by name (those `state_dict` would hold), without serialising anything."""
    PERSISTENT_BUFFERS.require()
    return {name: buffer for name, buffer in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set}


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` compiled this module in place."""
    return getattr(module, "_compiled_call_impl", None) is not None
