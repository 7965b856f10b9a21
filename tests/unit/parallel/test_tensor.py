"""parallel/tensor.py: the tensor-parallel data split, transformers' load arguments, checkpoint compatibility,
FSDP2 x TP's full-state loading by local blocks (on a fake 4-rank process group: meshes without communication), and
the data-parallel gather and agreement check of tp groups (parallel/base.py's DataParallel)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from hftrain.compat.transformers import PARTIAL_GRADIENTS, _unsum_accumulated, accumulation_safe_partial_gradients
from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.parallel.base import DataParallel, data_share, replicated_config
from hftrain.parallel.checkpoint_io import AccelerateCheckpoints, FullStateCheckpoints, _local_blocks
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.tensor import TensorParallel, fsdp_tp_blocks_disagree
from hftrain.versions import available, feature_problem
from tests.conftest import REPO

# transformers' own tensor-parallel load as hftrain runs it (refused by the preflight on an older transformers)
NEEDS_TP = pytest.mark.skipif(not available("tensor_parallel"), reason=str(feature_problem("tensor_parallel")))

@pytest.mark.parametrize("processes, index, expected", [(2, 1, (1, 0)), (4, 1, (2, 0)), (4, 2, (2, 1)), (6, 5, (3, 2))])
def test_tensor_parallel_groups_of_consecutive_ranks_share_one_data_share(processes, index, expected):
    assert data_share(processes, index, 2) == expected


@NEEDS_TP
def test_tensor_parallel_copies_keep_transformers_mesh_without_its_fsdp():
    config = replicated_config({"tp_size": 2}, 2)
    assert (config.tp_size, config.dp_replicate_size, config.fsdp_size) == (2, 2, 1)  # the mesh covers 4 ranks
    assert config.dp_size == 1  # transformers applies FSDP2 only when dp_size > 1: hftrain averages the copies
    config = replicated_config({"tp_size": 2}, 1)
    assert (config.tp_size, config.dp_replicate_size, config.dp_size) == (2, 1, 1)


SAVED = {"tp_size": 1, "ep_size": 1, "pp_size": 1, "deepspeed_config": None, "sharded_modules": [], "num_processes": 2}


@pytest.mark.parametrize("checkpoints, tp, distributed_type, saved, refusal", [
    # a tp checkpoint (one full-state file) resumes on one process / DDP (converted to their files) ...
    (AccelerateCheckpoints, 1, "MULTI_CPU", {"tp_size": 2}, None),
    # ... but not under a sharding strategy, whose loader reads only its own files
    (AccelerateCheckpoints, 1, "FSDP", {"tp_size": 2}, "written with tp_size=2 and this run shards the model with "
                                                       "FSDP2"),
    (AccelerateCheckpoints, 1, "DEEPSPEED", {"tp_size": 2, "ep_size": 2}, "written with tp_size=2 x ep_size=2 and "
                                                                          "this run shards the model with DeepSpeed"),
    # a tp run reads full-state checkpoints of any sizes and those of one process / DDP (cut into its blocks)
    (FullStateCheckpoints, 2, "MULTI_CPU", {"tp_size": 4}, None),
    (FullStateCheckpoints, 2, "MULTI_CPU", {}, None),
    (FullStateCheckpoints, 2, "MULTI_CPU", {"pp_size": 2, "tp_size": 2}, None),  # converted to whole files
    (FullStateCheckpoints, 2, "MULTI_CPU", {"deepspeed_config": {}}, "written with DeepSpeed and this run has "
                                                                      "tp_size=2"),
    (FullStateCheckpoints, 2, "MULTI_CPU", {"sharded_modules": ["LlamaDecoderLayer"]}, "written with FSDP2 and this "
                                                                                        "run has tp_size=2"),
])
def test_which_checkpoints_a_layout_resumes_with_or_without_tensor_parallelism(checkpoints, tp, distributed_type,
                                                                              saved, refusal):
    """check_resumable reads the recipe, the launch and the saved launch record only (the resumes themselves:
    tests/e2e/test_parallelism.py)."""
    layout = SimpleNamespace(recipe=SimpleNamespace(tp_size=tp, ep_size=1),
                             accelerator=SimpleNamespace(distributed_type=distributed_type))
    if refusal is None:
        checkpoints(layout).check_resumable({**SAVED, **saved})
        return
    with pytest.raises(HftrainError, match=refusal):
        checkpoints(layout).check_resumable({**SAVED, **saved})


@NEEDS_TP
def test_fsdp2_x_tensor_parallel_loads_on_transformers_fsdp_by_tp_mesh(accelerator, monkeypatch):
    """8 processes, tp_size=2: transformers' mesh is 4 fsdp ranks x 2 tp ranks, and it applies FSDP2 (dp_size > 1)."""
    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    plugin = SimpleNamespace(cpu_offload=OffloadPolicy(), reshard_after_forward=True, mixed_precision_policy=None)
    backend = FSDP2Backend(accelerator(8, kind="FSDP", fsdp_plugin=plugin), Recipe(tp_size=2),
                           transforms=(TensorParallel,))
    config = backend.model_load_kwargs()["distributed_config"]
    assert (config.tp_size, config.fsdp_size, config.dp_replicate_size, config.dp_size) == (2, 4, 1, 4)
    assert not config.fsdp_cpu_offload and not config.fsdp_mixed_precision  # fp32 on CPU: no policy


@contextmanager
def fake_rank(rank: int, world: int):
    """This process as `rank` of a `world`-rank fake process group (no communication): enough for a DeviceMesh."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("fsdp", "tp"))
    finally:
        dist.destroy_process_group()


def shard_of(full: torch.Tensor, mesh, placements) -> DTensor:
    """A DTensor of this rank's shape, filled with zeros: what `get_state_dict` returns for the rank's shard."""
    shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return DTensor.from_local(torch.zeros(shape), mesh, placements, shape=full.shape, stride=full.stride())


# the placements FSDP2 x TP gives a weight: FSDP's dim-0 shard of a TP shard (colwise: dim 0; rowwise: dim 1)
COLWISE, ROWWISE = (_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Shard(1))


@pytest.mark.parametrize("placements", [COLWISE, ROWWISE])
def test_full_state_is_cut_into_each_ranks_block_as_torch_distributes_it(placements):
    """Where torch's own scatter works (dimensions the 2x2 mesh splits evenly), each rank's block is what
    `distribute_tensor` gives it (local split, no communication); plain values come from the full state."""
    full = torch.randn(12, 8)
    for rank in range(4):
        with fake_rank(rank, 4) as mesh:
            state = _local_blocks({"w": shard_of(full, mesh, placements), "step": 0}, {"w": full, "step": 7})
            expected = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
            assert torch.equal(state["w"].to_local(), expected) and state["step"] == 7


def test_an_uneven_vocabulary_is_cut_into_blocks_that_tile_it():
    """753 rows (the tiny model's vocabulary) over tp 2 then fsdp 2, which torch's scatter refuses: TP rank 0 holds
    rows 0-376, TP rank 1 rows 377-752, each split 189/188 and 188/188 by FSDP; every row exactly once."""
    full = torch.arange(753 * 3, dtype=torch.float32).reshape(753, 3)
    rows = {}
    for rank in range(4):
        with fake_rank(rank, 4) as mesh:
            rows[rank] = _local_blocks({"w": shard_of(full, mesh, COLWISE)}, {"w": full})["w"].to_local()
    fsdp_tp = {(r // 2, r % 2): rows[r] for r in rows}  # rank = fsdp_rank * tp + tp_rank
    assert [len(fsdp_tp[k]) for k in [(0, 0), (1, 0), (0, 1), (1, 1)]] == [189, 188, 188, 188]
    assert torch.equal(torch.cat([fsdp_tp[k] for k in [(0, 0), (1, 0), (0, 1), (1, 1)]]), full)


def test_a_checkpoint_without_a_weight_of_this_model_is_refused():
    with pytest.raises(HftrainError, match=r"the checkpoint lacks \['lm.w'\]"):
        _local_blocks({"lm.w": torch.zeros(1), "b": torch.zeros(1)}, {"b": torch.ones(1)})


def test_data_parallel_gather_counts_each_tensor_parallel_group_once(accelerator):
    """4 processes, tp_size 2 (rank = dp_rank x 2 + tp_rank): the world gather holds each group's rows twice; the
    data-parallel gather keeps one copy per group, in data-parallel rank order."""
    rows = {rank: torch.tensor([[10.0 * (rank // 2), 1.0], [10.0 * (rank // 2) + 1, 2.0]]) for rank in range(4)}
    fake = accelerator(4, 1)
    fake.gather = lambda tensor: torch.cat([rows[r] for r in range(4)])  # accelerate's: every process's, in order
    dp = DataParallel(2, 0, fake, replicas=2, groups=(None, None))
    torch.testing.assert_close(dp.gather(rows[1]), torch.cat([rows[0], rows[2]]))
    fake.gather = lambda tensor: torch.cat([rows[0], rows[0]])  # one tp group of 2, no copies
    torch.testing.assert_close(DataParallel(1, 0, fake, replicas=2, groups=(None, None)).gather(rows[0]), rows[0])


def _check_agreement(rank: int, store_path: str, same: bool, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        fake = SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu"))
        dp = DataParallel(1, 0, fake, replicas=2, groups=(None, dist.new_group([0, 1])))
        sampled = torch.tensor([[3.0, 7.0], [2.0, 5.0 + (0 if same else rank)]])
        try:
            dp.check_replicas_agree(sampled, "completions")
            results.put((rank, None))
        except HftrainError as exc:
            results.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("same", [True, False])
def test_a_tensor_parallel_group_that_sampled_differently_stops_on_every_rank(tmp_path, same):
    """check_replicas_agree on a real 2-process gloo group (forked): equal values pass, one differing value raises
    on both ranks (not only on the one that differs)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_check_agreement, args=(rank, str(tmp_path / "store"), same, results))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    said = dict(results.get(timeout=5) for _ in range(2))
    if same:
        assert said == {0: None, 1: None}
    else:
        assert all(m and "the 2 ranks of a tensor-parallel group computed different completions" in m
                   for m in said.values()), said


def loader_and_fsdp2_lengths(size: int, fsdp: int, tp: int):
    """Each rank's block length of a dimension split by tp and fsdp, two ways, both computed by torch: as the DTensor
    spec [_StridedShard(0, sf=tp), Shard(0)] places it (what transformers' loader slices from the checkpoint) and as
    FSDP2 cuts each tp rank's block (torch.chunk of torch.chunk)."""
    for f in range(fsdp):
        for t in range(tp):
            (spec,), _ = _compute_local_shape_and_global_offset((size,), (fsdp, tp), [f, t],
                                                                [_StridedShard(0, split_factor=tp), Shard(0)])
            blocks = torch.arange(size).chunk(tp)
            pieces = blocks[t].chunk(fsdp) if t < len(blocks) else ()
            yield spec, len(pieces[f]) if f < len(pieces) else 0


@pytest.mark.parametrize("fsdp, tp", [(2, 2), (4, 2), (2, 4), (3, 2), (4, 4), (8, 2)])
def test_the_fsdp_x_tp_split_check_agrees_with_torch(fsdp, tp):
    verdicts = {size: fsdp_tp_blocks_disagree(size, fsdp, tp) for size in range(1, 400)}
    assert verdicts == {size: any(a != b for a, b in loader_and_fsdp2_lengths(size, fsdp, tp)) for size in verdicts}
    assert not any(verdicts[size] for size in verdicts if size % (fsdp * tp) == 0)  # an even split always agrees


LOAD = """
import sys, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

rank, fsdp, tp = map(int, sys.argv[1:])
dist.init_process_group("fake", rank=rank, world_size=fsdp * tp, store=FakeStore())
config = DistributedConfig(tp_size=tp, fsdp_size=fsdp)
AutoModelForCausalLM.from_pretrained("models/tiny-llama", distributed_config=config)
"""


@NEEDS_TP
@pytest.mark.parametrize("fsdp, tp", [(4, 2), (2, 4)])
def test_the_check_predicts_transformers_own_load(fsdp, tp):
    """The tiny model's 753-token vocabulary, loaded by transformers as rank 6 of a fake process group (no
    communication): over fsdp 4 x tp 2 transformers refuses its load ("size mismatch", the check's verdict); over
    fsdp 2 x tp 4 it loads."""
    proc = subprocess.run([sys.executable, "-c", LOAD, "6", str(fsdp), str(tp)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert fsdp_tp_blocks_disagree(753, fsdp, tp) == (proc.returncode != 0)
    if proc.returncode:
        assert "size mismatch" in proc.stdout + proc.stderr


@pytest.mark.skipif(PARTIAL_GRADIENTS.problem() is not None, reason=str(PARTIAL_GRADIENTS.problem()))
def test_partial_gradients_summed_after_each_backward_count_each_micro_batch_once():
    """Qwen3's q_norm / k_norm: transformers sums each rank's partial gradient over the tensor-parallel group after
    every backward, accumulated `.grad` included. Two ranks played by two copies of the weight, transformers' sum by
    the function below, two micro-batches: with hftrain's hook the gradient is the four partials' sum, as one process
    would accumulate it; without it, micro-batch 1 counts twice."""
    from tests.unit.test_moe import tiny

    lm = tiny("qwen3_moe")
    names = accumulation_safe_partial_gradients(lm, tp=2)
    assert names == [f"model.layers.{i}.self_attn.{n}_norm" for i in range(2) for n in ("q", "k")]
    assert accumulation_safe_partial_gradients(lm, tp=1) == []

    def summed_weights(hooked: bool) -> torch.Tensor:
        ranks = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
        if hooked:
            for p in ranks:
                p.register_hook(_unsum_accumulated(p, 2))
        partial = {(0, 0): [1.0, 2.0, 3.0], (0, 1): [4.0, 5.0, 6.0], (1, 0): [0.5, 0.25, 2.0], (1, 1): [8.0, 1.0, 0.0]}
        for micro in range(2):
            for rank, p in enumerate(ranks):
                (p * torch.tensor(partial[(micro, rank)])).sum().backward()
            total = ranks[0].grad + ranks[1].grad  # transformers' all_reduce(param.grad) on each rank
            for p in ranks:
                p.grad = total.clone()
        assert torch.equal(ranks[0].grad, ranks[1].grad)
        return ranks[0].grad

    one_process = torch.tensor([1.0 + 4.0 + 0.5 + 8.0, 2.0 + 5.0 + 0.25 + 1.0, 3.0 + 6.0 + 2.0 + 0.0])
    assert torch.equal(summed_weights(hooked=True), one_process)
    assert torch.equal(summed_weights(hooked=False), one_process + torch.tensor([5.0, 7.0, 9.0]))  # micro-batch 1 again
