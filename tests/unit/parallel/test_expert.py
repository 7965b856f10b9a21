"""parallel/expert.py and the ep axis of the layout record: the layouts expert parallelism runs, the backend that runs
them, and every refusal (one problem each, before weights load). The launched run: tests/e2e/test_expert_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hftrain import versions
from hftrain.compat.transformers import unmask_dispatched_experts
from hftrain.config import Recipe
from hftrain.errors import ConfigError, HftrainError
from hftrain.estimate import estimate, model_shape
from hftrain.fields.parallel import problems as parallel_problems
from hftrain.metrics import num_experts
from hftrain.parallel import ParallelDims, layout_of
from hftrain.parallel.base import Backend
from hftrain.parallel.checkpoint_io import AccelerateCheckpoints, FullStateCheckpoints
from hftrain.parallel.expert import ExpertParallel, expert_problems, load_kwargs
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import Launch
from hftrain.parallel.tensor import TensorParallel
from hftrain.preflight import preflight
from tests.conftest import REPO

DDP2, DDP4 = Launch("ddp", 2, 2), Launch("ddp", 4, 4)
# The model rules need the expert plans (base_model_ep_plan) that transformers' configs carry from 5.23; below it
# (CI's lower end, 5.17) every ep run meets the version's refusal first: test_an_older_transformers_refuses_first.
TOO_OLD = versions.feature_problem("expert_parallel")
needs_ep = pytest.mark.skipif(TOO_OLD is not None, reason=f"transformers {transformers.__version__} has no expert "
                              "plans in its model configs (5.23 brings them); here only the version refusal applies")
MOE = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, hidden_size=32)
DENSE = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32)


def test_experts_are_a_second_view_of_the_data_parallel_ranks():
    """transformers' expert mesh (efsdp, ep), ep innermost: ep ranks hold every expert once, efsdp of them the same
    experts; expert parallelism shares no batches, so the data-parallel copies stay the processes."""
    dims = ParallelDims(world=4, strategy="ddp", ep=2)
    assert (dims.dp, dims.replicas, dims.efsdp, dims.axes) == (4, 1, 2, frozenset({"ep"}))
    assert dims.describe() == "dp 4 (DDP-style copies, experts over ep 2)"
    assert dims.problems() == []


@pytest.mark.parametrize(("dims", "expected"), [
    (ParallelDims(world=3, strategy="ddp", ep=2), "ep_size=2 does not divide the 3 processes of a pipeline stage"),
    (ParallelDims(world=4, strategy="ddp", tp=2, ep=3), "ep_size=3 is not a multiple of tp_size=2"),
    (ParallelDims(world=2, strategy="ddp", ep=0), "ep_size must be >= 1 (1 = off), got 0"),
])
def test_layouts_the_experts_cannot_split_over(dims, expected):
    (problem,) = dims.problems()
    assert problem.startswith(expected)


def test_expert_parallelism_runs_on_transformers_fsdp2_layout_under_either_preset():
    """No backend class of its own: a transform over the FSDP2 strategy, which holds the layouts transformers loads
    and FSDP2-wraps."""
    for strategy in ("ddp", "fsdp2"):
        assert layout_of(ParallelDims(world=2, strategy=strategy, ep=2)) == (FSDP2Backend, (ExpertParallel,))
    assert load_kwargs(2) == {"ep_size": 2, "ep_implementation": "all_to_all"} and load_kwargs(1) == {}


@pytest.mark.parametrize(("strategy", "world", "sizes", "backend"), [
    ("ddp", 2, {"tp": 2, "ep": 2}, Backend),  # the expert group is the tensor-parallel pair: one batch, no copies
    ("ddp", 4, {"tp": 2, "ep": 2}, Backend),  # two whole copies of it, averaged as tensor parallelism's copies
    ("ddp", 4, {"tp": 2, "ep": 4}, FSDP2Backend),  # an expert group over two batches: transformers' FSDP2 layout
    ("fsdp2", 4, {"tp": 2, "ep": 2}, FSDP2Backend),
])
def test_expert_and_tensor_parallelism_are_two_transforms_over_one_strategy(strategy, world, sizes, backend):
    """ep x tp: no backend of its own either. The strategy that holds the model is tensor parallelism's unless an
    expert group spans ranks of different batches (ep > tp), which transformers lays out over FSDP2's ranks only."""
    dims = ParallelDims(world=world, strategy=strategy, **sizes)
    assert dims.problems() == []
    assert layout_of(dims) == (backend, (TensorParallel, ExpertParallel))


def test_the_experts_count_is_read_under_each_familys_name():
    assert num_experts(MOE) == 4
    assert num_experts(transformers.MixtralConfig(num_local_experts=6)) == 6
    assert num_experts(DENSE) is None


@needs_ep
@pytest.mark.parametrize(("launch", "values", "config", "expected"), [
    (DDP2, {"ep_size": 2}, DENSE, "ep_size=2: the model ('llama') has no expert-parallel plan with token dispatch"),
    (Launch("ddp", 3, 3), {"ep_size": 3}, MOE, "ep_size=3 does not divide the model's 4 experts per layer"),
    (Launch("ddp", 3, 3), {"ep_size": 2}, MOE, "ep_size=2 does not divide the 3 processes of a pipeline stage"),
    (Launch("single", 1, 1), {"ep_size": 2}, MOE, "ep_size=2 needs ep_size (or a multiple of it) processes"),
    (Launch("deepspeed", 2, 2, deepspeed_config={}), {"ep_size": 2}, MOE, "ep_size=2 with a DeepSpeed preset"),
    (DDP2, {"ep_size": 2, "bf16": False, "fp16": True}, MOE, "fp16 with ep_size=2"),
    (DDP2, {"ep_size": 2, "load_in_4bit": True, "use_peft": True}, MOE, "ep_size=2 with a quantized (QLoRA) base"),
])
def test_expert_layouts_that_cannot_run_are_refused(launch, values, config, expected):
    (problem,) = expert_problems(Recipe(**values), launch, config)
    assert problem.startswith(expected)


@needs_ep
def test_expert_layouts_that_run():
    assert expert_problems(Recipe(ep_size=2), DDP2, MOE) == []
    assert expert_problems(Recipe(ep_size=2), DDP4, MOE) == []  # two copies of each expert
    assert expert_problems(Recipe(ep_size=4), Launch("fsdp2", 4, 4), MOE) == []
    assert expert_problems(Recipe(), Launch("single", 1, 1), DENSE) == []


def test_a_transformers_without_trained_token_dispatch_is_refused(monkeypatch):
    """5.19 brought ep_size, but its dispatch exchanged tokens without a backward: refused by version, first."""
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.22.0"}.get(package))
    (problem,) = expert_problems(Recipe(ep_size=2), DDP2, DENSE)
    assert problem.startswith("ep_size=2: expert parallelism (ep_size > 1) needs transformers >= 5.23.0")


@pytest.mark.skipif(TOO_OLD is None, reason=f"transformers {transformers.__version__} runs expert parallelism")
def test_an_older_transformers_refuses_first():
    """At the lower end, the real installed version (nothing patched): one paragraph naming the version that brings
    it, whatever the model."""
    (problem,) = expert_problems(Recipe(ep_size=2), DDP2, MOE)
    assert problem == f"ep_size=2: {TOO_OLD}"


@pytest.mark.parametrize(("values", "expected"), [
    ({"ep_size": 2, "pp_size": 2}, "ep_size=2 with pp_size=2: hftrain runs expert parallelism with data and tensor "
     "parallelism only"),
    ({"ep_size": 2, "sp_size": 2}, "ep_size=2 with sp_size=2: hftrain runs expert parallelism with data and tensor "
     "parallelism only"),
    ({"ep_size": 2, "objective": "dpo"}, "ep_size=2 with objective=dpo: expert parallelism is verified for the "),
    ({"ep_size": 0}, "ep_size must be >= 1 (1 = off), got 0"),
])
def test_the_recipe_alone_refuses(values, expected):
    (problem,) = parallel_problems(Recipe(**values))
    assert problem.startswith(expected)


def test_the_recipe_takes_expert_with_tensor_parallelism():
    assert parallel_problems(Recipe(ep_size=2, tp_size=2)) == []


@needs_ep
def test_ep_x_tp_layouts_that_run_and_those_refused():
    """transformers' rule (`DistributedConfig._validate_mesh_config`): ep a multiple of tp, dividing fsdp x tp."""
    assert expert_problems(Recipe(ep_size=2, tp_size=2), DDP2, MOE) == []
    assert expert_problems(Recipe(ep_size=4, tp_size=2), DDP4, MOE) == []
    (problem,) = expert_problems(Recipe(ep_size=2, tp_size=4), DDP4, MOE)
    assert problem.startswith("ep_size=2 is not a multiple of tp_size=4")


@needs_ep
def test_the_preflight_refuses_a_dense_model_in_one_paragraph_before_weights_load():
    recipe = Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), ep_size=2)
    with pytest.raises(ConfigError) as error:
        preflight(recipe, DDP2, cuda=False)
    assert "the model ('llama') has no expert-parallel plan" in str(error.value)
    recipe = Recipe(model_name_or_path=str(REPO / "models" / "tiny-moe"), ep_size=2)
    assert preflight(recipe, DDP2, cuda=False).model_type == "qwen3_moe"


def test_the_estimate_splits_each_layers_experts_over_ep():
    """`hftrain estimate --ep 2`: the model state per GPU is FSDP's (every weight sharded over the GPUs), but the unit
    gathered for compute holds only this GPU's half of a layer's experts: models/tiny-moe's layer has 8 experts of
    gate_up (2 x 32 x 64) and down (64 x 32) weights."""
    shape = model_shape(str(REPO / "models" / "tiny-moe"))
    layer_experts = 8 * (2 * 32 * 64 + 64 * 32)
    assert (shape.experts, shape.layer_expert_params) == (8, layer_experts)
    rows = {row.strategy: row for row in estimate(shape, gpus=4, batch=1, seq=128, ep=2).rows}
    fsdp, ep = rows["FSDP full shard"], rows["FSDP full shard + expert parallel ep=2"]
    assert ep.optimizer == fsdp.optimizer and ep.activations == fsdp.activations
    assert fsdp.weights - ep.weights == 2 * 2 * (layer_experts // 2)  # two bf16 units in flight, half the experts
    assert "4 of 8 experts per GPU" in ep.note
    assert "expert parallel" not in " ".join(estimate(shape, gpus=4, batch=1, seq=128).rows[i].strategy
                                            for i in range(3))


SAVED = {"tp_size": 1, "ep_size": 1, "pp_size": 1, "deepspeed_config": None, "sharded_modules": []}


@pytest.mark.parametrize(("saved", "refusal"), [
    ({}, None),  # one process or DDP: accelerate's whole files, cut into each rank's blocks (the e2e resumes)
    ({"ep_size": 2}, None),
    ({"ep_size": 4, "tp_size": 2}, None),  # full training state, any sizes
    ({"ep_size": 2, "tp_size": 2}, None),
    ({"pp_size": 2}, None),  # a pipeline's DCP folder, converted to whole files
    ({"deepspeed_config": {}}, "this checkpoint was written with DeepSpeed and this run has ep_size=2"),
    ({"sharded_modules": ["LlamaDecoderLayer"]}, "this checkpoint was written with FSDP2 and this run has ep_size=2"),
])
def test_an_expert_parallel_run_resumes_whole_or_full_state_checkpoints(saved, refusal):
    checkpoints = FullStateCheckpoints(SimpleNamespace(recipe=SimpleNamespace(tp_size=1, ep_size=2)), slices=True)
    if refusal is None:
        checkpoints.check_resumable({**SAVED, **saved})
        return
    with pytest.raises(HftrainError, match=refusal):
        checkpoints.check_resumable({**SAVED, **saved})


@pytest.mark.parametrize(("saved", "refusal"), [
    ({"tp_size": 2, "ep_size": 2}, None),  # an expert-parallel full state, converted to whole files (the e2e resume)
    ({"tp_size": 2}, None),  # a tensor-parallel full state alike
    ({"pp_size": 2, "tp_size": 2}, None),  # a pipeline's DCP folder, converted to whole files
])
def test_one_process_resumes_an_ep_x_tp_checkpoint_as_an_expert_parallel_one(saved, refusal):
    backend = SimpleNamespace(recipe=SimpleNamespace(tp_size=1, ep_size=1),
                              accelerator=SimpleNamespace(distributed_type="NO"))
    checkpoints = AccelerateCheckpoints(backend)
    if refusal is None:
        checkpoints.check_resumable({**SAVED, **saved})
        return
    with pytest.raises(HftrainError, match=refusal):
        checkpoints.check_resumable({**SAVED, **saved})


@needs_ep
def test_dispatched_experts_without_the_route_masks_equal_a_per_expert_loop():
    """The rows `AllToAllEP` hands a rank's experts (grouped by sending rank, then by local expert; local ids, top-1,
    unit weights) through transformers' default experts implementation (grouped_mm) with the off-rank route masks
    cleared (`unmask_dispatched_experts`), against plain PyTorch one expert at a time (each row through its expert's
    SwiGLU): the output and the gradients of the rows and of both expert weights. One local expert gets no rows."""
    config = transformers.Qwen3MoeConfig(num_experts=4, hidden_size=32, moe_intermediate_size=16,
                                         experts_implementation="grouped_mm")
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.3)
        experts.down_proj.normal_(std=0.3)
    experts._is_expert_parallel = True  # as transformers' MoEParamShard marks the experts it splits over ep ranks
    assert unmask_dispatched_experts(torch.nn.Sequential(experts)) == 1

    counts = torch.tensor([[3, 0, 5, 2], [4, 0, 6, 1]])  # rows from rank 0, then rank 1, per local expert
    ids = torch.arange(4).repeat(2).repeat_interleave(counts.reshape(-1))
    rows = torch.randn(len(ids), 32, requires_grad=True)
    out = experts(rows, ids.unsqueeze(-1), torch.ones(len(ids), 1))
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, (rows, experts.gate_up_proj, experts.down_proj), upstream)

    gate_up = experts.gate_up_proj.detach().clone().requires_grad_()
    down = experts.down_proj.detach().clone().requires_grad_()
    expected = torch.zeros(len(ids), 32)
    for e in range(4):
        picked = ids == e
        gate, up = (rows[picked] @ gate_up[e].T).chunk(2, dim=-1)
        expected = expected.index_put((picked.nonzero()[:, 0],), (torch.nn.functional.silu(gate) * up) @ down[e].T)
    want = torch.autograd.grad(expected, (rows, gate_up, down), upstream)
    torch.testing.assert_close(out, expected)
    for name, a, b in zip(("rows", "gate_up_proj", "down_proj"), got, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    assert got[1][1].abs().sum() == 0  # the expert without rows: no gradient
