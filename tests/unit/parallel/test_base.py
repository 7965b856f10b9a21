"""parallel/base.py: the parallelism record and the model-state memory model, against hand-written accounting; how a
backend composes the transforms of its layout."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from hftrain.config import Recipe
from hftrain.memory import ParameterCounts
from hftrain.parallel.base import ALL_PARTS, Backend, Parallelism, Transform
from hftrain.parallel.checkpoint_io import DeepSpeedCheckpoints
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.sequence import UlyssesAttention
from hftrain.parallel.tensor import TensorParallel
from hftrain.versions import feature_problem

P, T = 1_000_000, 250_000  # parameters, of which trained
FP32 = ParameterCounts.uniform(T, P, 4)


@pytest.mark.parametrize("record, words", [
    (Parallelism("single", "single process", 1, 1, None), "1 process, no distribution"),
    (Parallelism("ddp", "DDP", 2, 1, "gloo"), "DDP over 2 processes (gloo)"),
    (Parallelism("deepspeed", "DeepSpeed ZeRO-3", 16, 2, "nccl"), "DeepSpeed ZeRO-3 over 16 processes on 2 machines "
                                                                   "(nccl)"),
])
def test_the_start_up_line_says_the_layout_in_words(record, words):
    assert record.describe() == words


def test_one_process_and_ddp_hold_everything_on_every_device(accelerator):
    for processes in (1, 2):
        backend = Backend(accelerator(processes), Recipe())
        memory = backend.memory(FP32)
        assert memory["per_device_bytes"] == 4 * P + 4 * T + 8 * T  # fp32 weights, gradients, AdamW moments
        assert memory["offloaded_bytes"] == 0 and memory["processes"] == processes
        assert backend.record.kind == ("ddp" if processes == 2 else "single")
        assert (backend.dp.world, backend.dp.rank) == (processes, 0)


def test_sgd_with_momentum_holds_one_buffer_and_plain_sgd_none(accelerator):
    assert Backend(accelerator(), Recipe(optim="sgd", sgd_momentum=0.9)).memory(FP32)["per_device_bytes"] == \
        4 * P + 4 * T + 4 * T
    assert Backend(accelerator(), Recipe(optim="sgd")).memory(FP32)["per_device_bytes"] == 4 * P + 4 * T


@pytest.mark.parametrize("stage, offload, expected, offloaded", [
    # bf16 under DeepSpeed: 2-byte weights and gradients, fp32 master copy + Adam moments = 12 bytes of state
    (1, {}, 2 * P + 2 * T + 12 * T // 4, 0),
    (2, {}, 2 * P + 2 * T // 4 + 12 * T // 4, 0),
    (3, {}, 2 * P // 4 + 2 * T // 4 + 12 * T // 4, 0),
    # optimizer offload takes each process's gradient partition to CPU memory too (fp32 at stages 1-2)
    (2, {"offload_optimizer": {"device": "cpu"}}, 2 * P, 4 * T // 4 + 12 * T // 4),
    (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, 0,
     2 * P // 4 + 2 * T // 4 + 12 * T // 4),
])
def test_zero_stages_shard_their_parts_and_offload_moves_them_to_cpu(accelerator, stage, offload, expected,
                                                                       offloaded):
    config = {"zero_optimization": {"stage": stage, **offload}}
    backend = DeepSpeedBackend(accelerator(4, kind="DEEPSPEED", deepspeed_config=config), Recipe(bf16=True))
    memory = backend.memory(FP32)
    assert (memory["per_device_bytes"], memory["offloaded_bytes"]) == (expected, offloaded)
    assert memory["strategy"] == f"DeepSpeed ZeRO-{stage}" + (" + offload" if offload else "")
    assert backend.record.zero_stage == stage and backend.step_applied_in_backward


@pytest.mark.parametrize("reshard, expected, name", [(True, (4 * P + 4 * T + 8 * T) // 4, "FSDP2 FULL_SHARD"),
                                                     (False, 4 * P + (4 * T + 8 * T) // 4, "FSDP2 SHARD_GRAD_OP")])
def test_fsdp2_full_shard_splits_everything_and_shard_grad_op_keeps_the_weights(accelerator, reshard, expected, name):
    from torch.distributed.fsdp import OffloadPolicy

    plugin = type("Plugin", (), {"reshard_after_forward": reshard, "cpu_offload": OffloadPolicy(),
                                 "mixed_precision_policy": None})()
    backend = FSDP2Backend(accelerator(4, kind="FSDP", fsdp_plugin=plugin), Recipe())
    memory = backend.memory(FP32)
    assert abs(memory["per_device_bytes"] - expected) <= 3  # each part rounds down separately
    assert memory["strategy"] == name and backend.record.kind == "fsdp2"


def test_tensor_parallel_splits_over_the_group_and_each_copy_holds_it_again(accelerator, monkeypatch):
    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    backend = Backend(accelerator(4, index=3, kind="MULTI_CPU"), Recipe(tp_size=2), transforms=(TensorParallel,))
    memory = backend.memory(FP32)
    assert memory["per_device_bytes"] == (4 * P) // 2 + (4 * T) // 2 + (8 * T) // 2
    assert memory["strategy"] == "tensor parallel (tp_size=2) x 2 data-parallel copies"
    assert (backend.dp.world, backend.dp.rank, backend.dp.replicas) == (2, 1, 2)


def test_sequence_parallel_devices_hold_the_activations_of_a_slice_of_each_sequence(accelerator):
    import dataclasses

    backend = Backend(accelerator(2), Recipe(per_device_train_batch_size=2, max_length=1024))
    assert backend.memory(FP32)["activations"] == "activations extra: at most 2,048 tokens per device"
    backend.record = dataclasses.replace(backend.record, sp_size=2)
    memory = backend.memory(FP32)
    assert memory["activation_tokens_per_device"] == 1024
    assert memory["activations"] == "activations extra: at most 1,024 tokens per device, 1/2 of each sequence"


@pytest.mark.parametrize("reshard, expected", [(True, (4 * P + 4 * T + 8 * T) // 4),
                                               (False, 4 * P // 2 + (4 * T + 8 * T) // 4)])
def test_fsdp2_x_tp_shard_grad_op_keeps_each_ranks_tp_shard_of_the_weights(accelerator, monkeypatch, reshard,
                                                                          expected):
    """FSDP2 x TP on 4 processes (fsdp 2 x tp 2): FULL_SHARD splits every part over all 4; SHARD_GRAD_OP keeps the
    weights gathered over fsdp only, so each rank holds its tp shard of them (half), not the whole model."""
    from torch.distributed.fsdp import OffloadPolicy


    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    plugin = type("Plugin", (), {"reshard_after_forward": reshard, "cpu_offload": OffloadPolicy(),
                                 "mixed_precision_policy": None})()
    backend = FSDP2Backend(accelerator(4, kind="FSDP", fsdp_plugin=plugin), Recipe(tp_size=2),
                           transforms=(TensorParallel,))
    assert backend.record.model_shards == 2
    assert abs(backend.memory(FP32)["per_device_bytes"] - expected) <= 3  # each part rounds down separately


def test_prepare_applies_the_transforms_in_their_order_then_the_wrapper_and_nests_their_micro_batch_contexts(
        accelerator):
    seen = []

    def transform(name):
        class Axis(Transform):
            def apply(self, model):
                seen.append(f"{name} applied to {model}")

            @contextmanager
            def micro_batch(self, batch):
                seen.append(f"{name} enters")
                yield {**batch, name: sorted(batch)}  # what this axis received
                seen.append(f"{name} leaves")

        return Axis

    class Wrapper(Backend):
        def wrap(self, model, optimizer):
            seen.append(f"wrapped {model}")
            return model, optimizer

    backend = Wrapper(accelerator(), Recipe(), transforms=(transform("cp"), transform("ep")))
    assert backend.prepare("model", "optimizer") == ("model", "optimizer")
    assert seen == ["cp applied to model", "ep applied to model", "wrapped model"]
    seen.clear()
    with backend.micro_batch({"input_ids": 0}) as inputs:
        assert inputs == {"input_ids": 0, "cp": ["input_ids"], "ep": ["cp", "input_ids"]}  # the second gets the first's
    assert seen == ["cp enters", "ep enters", "ep leaves", "cp leaves"]


def test_ulysses_over_deepspeed_names_both_and_shares_each_batch_over_its_group(accelerator, monkeypatch):
    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, size: (None, None))  # no process group here
    config = {"zero_optimization": {"stage": 2}}
    backend = DeepSpeedBackend(accelerator(4, index=3, kind="DEEPSPEED", deepspeed_config=config), Recipe(sp_size=2),
                               transforms=(UlyssesAttention,))
    assert backend.record.name == "DeepSpeed ZeRO-2 + Ulysses sequence parallel (sp_size=2) x 2 data-parallel copies"
    assert (backend.record.kind, backend.record.sp_size, backend.record.zero_stage) == ("deepspeed", 2, 2)
    assert (backend.dp.world, backend.dp.rank, backend.dp.replicas) == (2, 1, 2)  # ranks {2, 3}: the second copy
    assert isinstance(backend.checkpoints, DeepSpeedCheckpoints)


# ------------------------------------------------------------------------ axes transformers lays out at load
def plugin(reshard=True, offload=False):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return type("Plugin", (), {"reshard_after_forward": reshard, "mixed_precision_policy": None,
                               "cpu_offload": CPUOffloadPolicy() if offload else OffloadPolicy()})()


def test_a_strategy_alone_keeps_its_own_checkpoints_generation_and_loading(accelerator):
    from hftrain.parallel.checkpoint_io import AccelerateCheckpoints, FSDP2Checkpoints
    from hftrain.parallel.generation import FSDP2Generation, WholeModel, ZeRO3Generation

    for backend, checkpoints, generation in (
            (Backend(accelerator(2), Recipe()), AccelerateCheckpoints, WholeModel),
            (FSDP2Backend(accelerator(2, kind="FSDP", fsdp_plugin=plugin()), Recipe()), FSDP2Checkpoints,
             FSDP2Generation),
            (DeepSpeedBackend(accelerator(2, kind="DEEPSPEED", deepspeed_config={"zero_optimization": {"stage": 3}}),
                              Recipe()), DeepSpeedCheckpoints, ZeRO3Generation)):
        assert not backend.laid_out and backend.model_load_kwargs() == {}
        assert type(backend.checkpoints) is checkpoints and type(backend.generation) is generation
    with Backend(accelerator(1), Recipe()).generation_context("model") as generating:
        assert generating == ("model", False)  # the whole model, no collectives


@pytest.mark.skipif(feature_problem("tensor_parallel") is not None, reason=str(feature_problem("tensor_parallel")))
def test_tensor_parallel_over_ddp_and_over_fsdp2_changes_loading_checkpoints_and_generation(accelerator,
                                                                                           monkeypatch):
    """The transform's DistributedConfig fields completed by each strategy: whole copies of the tp group under DDP,
    transformers' FSDP2 over processes / tp under FSDP2 (its full-state checkpoints loaded in blocks), generation
    through the shards under both; the offload note stays last in the name."""
    from hftrain.parallel.checkpoint_io import FullStateCheckpoints, FullStateSlices, FullTrainingState
    from hftrain.parallel.generation import LaidOutShards

    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    copies = Backend(accelerator(4, kind="MULTI_CPU"), Recipe(tp_size=2), transforms=(TensorParallel,))
    config = copies.model_load_kwargs()["distributed_config"]
    assert (config.tp_size, config.dp_replicate_size, config.dp_size) == (2, 2, 1)
    sharded = FSDP2Backend(accelerator(4, kind="FSDP", fsdp_plugin=plugin(offload=True)), Recipe(tp_size=2),
                           transforms=(TensorParallel,))
    config = sharded.model_load_kwargs()["distributed_config"]
    assert (config.tp_size, config.fsdp_size, config.fsdp_cpu_offload) == (2, 2, True)
    assert sharded.record.name == "FSDP2 FULL_SHARD (fsdp_size=2) x tensor parallel (tp_size=2) + offload"
    assert (sharded.record.kind, sharded.record.offloaded) == ("fsdp2_tp", ALL_PARTS)
    for backend, state in ((copies, FullTrainingState), (sharded, FullStateSlices)):
        assert backend.laid_out and isinstance(backend.checkpoints, FullStateCheckpoints)
        assert backend.checkpoints.state_class is state and type(backend.generation) is LaidOutShards
        with backend.generation_context("model") as generating:
            assert generating == ("model", True)  # through the shards: every rank's forwards stay in step


@pytest.mark.skipif(feature_problem("expert_parallel") is not None, reason=str(feature_problem("expert_parallel")))
def test_expert_parallelism_under_a_ddp_preset_is_held_by_transformers_fsdp2(accelerator):
    """ep_size=2 on 2 processes of a DDP-type preset (no FSDP plugin): FSDP2 FULL_SHARD of the dense weights over
    both, the experts split over ep, the record naming both."""
    from hftrain.parallel import ParallelDims, layout_of
    from hftrain.parallel.expert import ExpertParallel

    held, transforms = layout_of(ParallelDims(world=2, strategy="ddp", ep=2))
    backend = held(accelerator(2, kind="MULTI_CPU"), Recipe(ep_size=2), transforms=transforms)
    config = backend.model_load_kwargs()["distributed_config"]
    assert (config.tp_size, config.fsdp_size, config.ep_size, config.ep_implementation) == (1, 2, 2, "all_to_all")
    assert not config.fsdp_cpu_offload
    assert backend.record.name == ("expert parallel (ep_size=2: 1/2 of every MoE layer's experts per process), dense "
                                   "weights FSDP2 FULL_SHARD (fsdp_size=2)")
    assert (backend.record.kind, backend.record.ep_size, backend.record.sharded) == ("fsdp2_ep", 2, ALL_PARTS)
    assert transforms == (ExpertParallel,) and backend.shard_count() == 2


def test_a_frozen_copy_of_a_laid_out_model_holds_each_ranks_own_shards(accelerator, monkeypatch):
    """dpo's reference under tp: the rebuilt model with this rank's values copied in (a deep copy cannot copy
    DTensors over a group's storage); placed as loaded, said in words."""
    import torch

    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))
    backend = Backend(accelerator(2, kind="MULTI_CPU"), Recipe(tp_size=2), transforms=(TensorParallel,))
    trained = torch.nn.Linear(3, 2)
    copy = backend.frozen_copy(trained, rebuild=lambda: torch.nn.Linear(3, 2))
    assert copy is not trained and torch.equal(copy.weight, trained.weight) and torch.equal(copy.bias, trained.bias)
    module, how = backend.prepare_frozen(copy)
    assert module is copy and not module.training and how == "sharded over the tensor-parallel group (tp_size=2)"
