"""parallel/tensor.py: the tensor-parallel data split, transformers' load arguments, checkpoint compatibility."""

from __future__ import annotations

import pytest

from hftrain.errors import HftrainError
from hftrain.parallel.base import Backend
from hftrain.parallel.tensor import TensorParallelBackend, data_share, model_load_kwargs


@pytest.mark.parametrize("processes, index, expected", [(2, 1, (1, 0)), (4, 1, (2, 0)), (4, 2, (2, 1)), (6, 5, (3, 2))])
def test_tensor_parallel_groups_of_consecutive_ranks_share_one_data_share(processes, index, expected):
    assert data_share(processes, index, 2) == expected


def test_tensor_parallel_copies_keep_transformers_mesh_without_its_fsdp():
    config = model_load_kwargs(2, world=4)["distributed_config"]
    assert (config.tp_size, config.dp_replicate_size, config.fsdp_size) == (2, 2, 1)  # the mesh covers 4 ranks
    assert config.dp_size == 1  # transformers applies FSDP2 only when dp_size > 1: hftrain averages the copies
    config = model_load_kwargs(2, world=2)["distributed_config"]
    assert (config.tp_size, config.dp_replicate_size, config.dp_size) == (2, 1, 1)


@pytest.mark.parametrize("backend, saved_tp", [(Backend, 2), (TensorParallelBackend, 1)])
def test_tensor_parallel_checkpoints_resume_only_with_tensor_parallelism(backend, saved_tp):
    unbound = object.__new__(backend)  # check_resumable reads only the recipe
    unbound.recipe = type("R", (), {"tp_size": 1 if backend is Backend else 2})()
    with pytest.raises(HftrainError, match=f"written with tp_size={saved_tp} and this run has tp_size="):
        unbound.check_resumable({"tp_size": saved_tp, "num_processes": 2})
