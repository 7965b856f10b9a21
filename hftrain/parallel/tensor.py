"""Tensor parallelism (`tp_size`): every linear layer split over `tp_size` processes by transformers at load time, a
transform over the strategy that holds the model (`TensorParallel`).

`--tp_size N` loads the model with transformers' `DistributedConfig(tp_size=N)`, its predefined tensor-parallel plan
(`tp_plan="auto"`): each process reads only its shards. The strategy completes the config and holds the laid-out
model (`Backend.laid_out`):

- DDP-type presets (`Backend`): with more processes than tp_size (a multiple of it), each group of tp_size
  consecutive ranks holds one sharded copy and trains on its own share of the data; the gradients of the ranks that
  hold the same shard are averaged (`base.ReplicaGradients`; DDP cannot hold DTensor weights), and the model is not
  wrapped by accelerate.
- FSDP2 presets (`FSDP2Backend`): the data-parallel ranks shard instead of copying: transformers loads with
  `DistributedConfig(tp_size=T, fsdp_size=processes/T)` and applies FSDP2 itself, so every weight is a DTensor on its
  ("fsdp", "tp") mesh and FSDP2's reduce-scatter does what `ReplicaGradients` does for copies.

Checkpoints are full state (`checkpoint_io.FullStateCheckpoints`), gathered and re-sharded, so they do not depend on
the layout; frozen copies and generation follow the shards (`base.LaidOutAtLoad`).

- The pipeline (`pipeline.PipelineBackend`, DDP-type presets): every rank loads with the plan over its tp group and
  keeps its stages' layers; the stages' checkpoints and schedule are the pipeline's, the gradients' sums over the
  stages and tp shards its clipping's.

Process layout (transformers' device mesh, TP innermost): rank = dp_rank * tp + tp_rank. With 4 processes and
tp_size=2: TP groups {0,1} {2,3} hold the two halves of every linear layer; data-parallel groups {0,2} {1,3} hold
the same half, train on different batches and average their gradients (or, under FSDP2, each hold half of it).
"""

from __future__ import annotations

import dataclasses

from hftrain.compat.transformers import accumulation_safe_partial_gradients
from hftrain.parallel.base import ALL_PARTS, LaidOutAtLoad, Parallelism, with_copies, with_part


def _shard(size: int, parts: int, index: int) -> int:
    """The length of block `index` when `size` is cut into `parts` as torch cuts (torch.chunk, DTensor's Shard):
    blocks of ceil(size / parts), the last ones short or empty."""
    block = -(-size // parts)
    start = min(size, index * block)
    return min(size, start + block) - start


def fsdp_tp_blocks_disagree(size: int, fsdp: int, tp: int) -> bool:
    """Whether transformers' FSDP2 x TP loader and FSDP2 cut a dimension of `size` split by both (dim 0 of the
    embedding, the head and the column-wise projections) into blocks of different lengths on some rank. FSDP2 cuts
    each tp rank's block into fsdp pieces (`fully_shard`: torch.chunk); transformers' loader (`DtensorShardOperation`
    for [_StridedShard(0, sf=tp), Shard(0)]) takes piece f of every tp block and re-cuts their concatenation into tp
    equal parts. The two agree when, for every f, piece f has the length of its re-cut part (always when tp x fsdp
    divides the size). Otherwise transformers refuses its own load ("Reinit due to size mismatch"): the tiny
    model's 753-token vocabulary over fsdp 4 x tp 2 gives one rank 93 rows for FSDP2's 92."""
    blocks = [_shard(size, tp, t) for t in range(tp)]
    for f in range(fsdp):
        pieces = [_shard(block, fsdp, f) for block in blocks]
        if any(_shard(sum(pieces), tp, t) != piece for t, piece in enumerate(pieces)):
            return True
    return False


class TensorParallel(LaidOutAtLoad):
    """tp_size over a DDP-type strategy (whole copies of the tp-split weights: "tensor parallel (tp_size=2) x 2
    data-parallel copies"), FSDP2 ("FSDP2 FULL_SHARD (fsdp_size=2) x tensor parallel (tp_size=2)") or the pipeline's
    stages ("pipeline parallel (...) x tensor parallel (tp_size=2)": each stage's layers split by the same plan, the
    pipeline's whole-copy stages only), beside ring attention (tp x cp, parallel/context.py)."""

    axis = "tp"
    strategies = frozenset({"ddp", "fsdp2"})
    beside = frozenset({"cp", "ep", "pp"})

    @classmethod
    def runs_over(cls, dims) -> bool:
        """Beside pp only under a DDP-type launch: tp inside FSDP2-sharded stages is not built."""
        return super().runs_over(dims) and not (dims.pp > 1 and dims.strategy != "ddp")

    @property
    def tp(self) -> int:
        return self.backend.recipe.tp_size

    def distributed_fields(self) -> dict:
        return {"tp_size": self.tp}  # the model's own tp_plan ("auto")

    def apply(self, model) -> None:
        """The weights whose gradient transformers sums over the group after each backward (Qwen3's q_norm / k_norm)
        made right under gradient accumulation (`accumulation_safe_partial_gradients`)."""
        accumulation_safe_partial_gradients(model.lm, self.tp)

    def describe(self, record: Parallelism) -> Parallelism:
        """Over a strategy that shards nothing itself, the layout is tensor parallelism's (every part of the model
        state split over the group: norms replicated, counted split); over FSDP2, a part of its name."""
        if not record.sharded:
            name = with_copies(f"tensor parallel (tp_size={self.tp})", record.processes, self.tp)
            return dataclasses.replace(record, kind="tp", name=name, sharded=ALL_PARTS)
        return dataclasses.replace(record, kind=f"{record.kind}_tp",
                                   name=with_part(record.name, f" x tensor parallel (tp_size={self.tp})"))

    def frozen_how(self) -> str:
        return f"sharded over the tensor-parallel group (tp_size={self.tp})"
