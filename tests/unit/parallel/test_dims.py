"""parallel/dims.py: the layout record, against the rank orders the backends document and the backend choice the
strategy rules call for (written out by hand)."""

from __future__ import annotations

import functools
import itertools

import pytest

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.parallel import (
    Backend,
    ParallelDims,
    layout_of,
)
from hftrain.parallel.base import data_share
from hftrain.parallel.context import RingAttention
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch
from hftrain.parallel.pipeline import PipelineBackend, ShardedStages
from hftrain.parallel.sequence import UlyssesAttention
from hftrain.parallel.tensor import TensorParallel


def test_pipeline_ranks_follow_the_documented_order():
    """parallel/pipeline/: rank = (stage_rank * copies + copy) * tp_size + tp_rank."""
    dims = ParallelDims(world=8, strategy="ddp", pp=2, tp=2)
    assert dims.mesh == (("pp", 2), ("dp", 2), ("tp", 2)) and dims.replicas == 4 and dims.dp == 2
    for stage, copy, tp_rank in itertools.product(range(2), range(2), range(2)):
        rank = (stage * 2 + copy) * 2 + tp_rank
        assert dims.coordinates(rank) == {"pp": stage, "dp": copy, "tp": tp_rank}


def test_tensor_and_context_ranks_follow_the_documented_order():
    """parallel/context.py: tp x cp puts rank = (dp_rank * cp + cp_rank) * tp + tp_rank; accelerate's cp alone
    rank = dp_rank * cp + cp_rank."""
    dims = ParallelDims(world=8, strategy="fsdp2", cp=2, tp=2)
    assert dims.mesh == (("dp", 2), ("cp", 2), ("tp", 2)) and dims.fsdp == 4
    for dp_rank, cp_rank, tp_rank in itertools.product(range(2), range(2), range(2)):
        assert dims.coordinates((dp_rank * 2 + cp_rank) * 2 + tp_rank) == {"dp": dp_rank, "cp": cp_rank,
                                                                            "tp": tp_rank}
    cp_only = ParallelDims(world=4, strategy="fsdp2", cp=2)
    assert [cp_only.coordinates(r) for r in range(4)] == [{"dp": r // 2, "cp": r % 2} for r in range(4)]


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2), (8, 4), (6, 3)])
def test_the_data_share_of_tensor_parallelism_is_the_records(world, tp):
    dims = ParallelDims(world=world, strategy="ddp", tp=tp)
    for rank in range(world):
        assert data_share(world, rank, tp) == (dims.dp, dims.coordinates(rank)["dp"])


def test_copies_and_shards():
    assert ParallelDims(world=4, strategy="fsdp2").fsdp == 4
    assert ParallelDims(world=8, strategy="fsdp2", tp=2).fsdp == 4  # FSDP2 x TP: fsdp_size = processes / tp
    assert ParallelDims(world=8, strategy="fsdp2", pp=2).fsdp == 4  # each stage over its data-parallel ranks
    assert ParallelDims(world=4, strategy="ddp").fsdp == 1
    assert ParallelDims(world=4, strategy="deepspeed", sp=2).replicas == 2
    assert ParallelDims(world=1, strategy="single").mesh == (("dp", 1),)


def test_the_layout_is_built_from_the_recipe_and_the_launch():
    dims = ParallelDims.build(Recipe(pp_size=2, tp_size=2), Launch("ddp", 8, 8))
    assert (dims.world, dims.strategy, dims.pp, dims.tp, dims.cp, dims.sp) == (8, "ddp", 2, 2, 1, 1)
    assert dims.describe() == "pp 2 x dp 2 x tp 2 (DDP-style copies)"


def test_problems_name_the_sizes_that_do_not_divide_the_processes():
    assert ParallelDims(world=8, strategy="ddp", pp=2, tp=2).problems() == []
    (problem,) = ParallelDims(world=6, strategy="ddp", pp=2, tp=2).problems()
    assert "pp_size=2 x tp_size=2 = 4 does not divide the 6 processes" in problem
    assert ParallelDims(world=2, strategy="ddp", tp=0).problems() == ["tp_size must be >= 1 (1 = off), got 0"]
    with pytest.raises(ValueError, match="strategy"):
        ParallelDims(world=2, strategy="fsdp")


@pytest.mark.parametrize(("strategy", "sizes", "expected"), [
    ("single", {}, (Backend, ())),
    ("ddp", {}, (Backend, ())),
    ("fsdp2", {}, (FSDP2Backend, ())),
    ("deepspeed", {}, (DeepSpeedBackend, ())),
    ("ddp", {"tp": 2}, (Backend, (TensorParallel,))),
    ("fsdp2", {"tp": 2}, (FSDP2Backend, (TensorParallel,))),
    ("fsdp2", {"cp": 2}, (FSDP2Backend, (RingAttention,))),
    ("fsdp2", {"cp": 2, "tp": 2}, (FSDP2Backend, (TensorParallel, RingAttention))),
    ("deepspeed", {"sp": 2}, (DeepSpeedBackend, (UlyssesAttention,))),
    ("ddp", {"pp": 2}, (PipelineBackend, ())),
    ("ddp", {"pp": 2, "tp": 2}, (PipelineBackend, (TensorParallel,))),
    ("fsdp2", {"pp": 2}, ((PipelineBackend, {"holding": ShardedStages}), ())),
])
def test_each_layout_the_preflight_lets_through_has_its_backend(strategy, sizes, expected):
    """The backend that holds the model (the pipeline: with its stages held as the strategy holds them), and the
    transforms of the other axes over it."""
    backend, transforms = layout_of(ParallelDims(world=8, strategy=strategy, **sizes))
    if isinstance(backend, functools.partial):
        backend = (backend.func, backend.keywords)
    assert (backend, transforms) == expected


@pytest.mark.parametrize(("strategy", "sizes"), [("deepspeed", {"tp": 2}), ("ddp", {"cp": 2}), ("ddp", {"sp": 2}),
                                                 ("fsdp2", {"pp": 2, "tp": 2}), ("fsdp2", {"pp": 2, "cp": 2}),
                                                 ("deepspeed", {"sp": 2, "tp": 2}), ("fsdp2", {"sp": 2})])
def test_a_layout_without_a_backend_is_refused_in_words(strategy, sizes):
    with pytest.raises(HftrainError, match="no hftrain backend runs"):
        layout_of(ParallelDims(world=8, strategy=strategy, **sizes))
