"""parallel/base.py: the parallelism record and the model-state memory model, against hand-written accounting; how a
backend composes the transforms of its layout."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from hftrain.config import Recipe
from hftrain.parallel.base import Backend, Parallelism, Transform
from hftrain.parallel.checkpoint_io import DeepSpeedCheckpoints
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.sequence import UlyssesAttention
from hftrain.parallel.tensor import TensorParallelBackend

P, T = 1_000_000, 250_000  # parameters, of which trained


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
        memory = backend.memory(T, P)
        assert memory["per_device_bytes"] == 4 * P + 4 * T + 8 * T  # fp32 weights, gradients, AdamW moments
        assert memory["offloaded_bytes"] == 0 and memory["processes"] == processes
        assert backend.record.kind == ("ddp" if processes == 2 else "single")
        assert (backend.dp.world, backend.dp.rank) == (processes, 0)


def test_sgd_with_momentum_holds_one_buffer_and_plain_sgd_none(accelerator):
    assert Backend(accelerator(), Recipe(optim="sgd", sgd_momentum=0.9)).memory(T, P)["per_device_bytes"] == \
        4 * P + 4 * T + 4 * T
    assert Backend(accelerator(), Recipe(optim="sgd")).memory(T, P)["per_device_bytes"] == 4 * P + 4 * T


@pytest.mark.parametrize("stage, offload, expected, offloaded", [
    # bf16 under DeepSpeed: 2-byte weights and gradients, fp32 master copy + Adam moments = 12 bytes of state
    (1, {}, 2 * P + 2 * T + 12 * T // 4, 0),
    (2, {}, 2 * P + 2 * T // 4 + 12 * T // 4, 0),
    (3, {}, 2 * P // 4 + 2 * T // 4 + 12 * T // 4, 0),
    (2, {"offload_optimizer": {"device": "cpu"}}, 2 * P + 2 * T // 4, 12 * T // 4),
    (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, 2 * T // 4,
     2 * P // 4 + 12 * T // 4),
])
def test_zero_stages_shard_their_parts_and_offload_moves_them_to_cpu(accelerator, stage, offload, expected,
                                                                       offloaded):
    config = {"zero_optimization": {"stage": stage, **offload}}
    backend = DeepSpeedBackend(accelerator(4, kind="DEEPSPEED", deepspeed_config=config), Recipe(bf16=True))
    memory = backend.memory(T, P)
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
    memory = backend.memory(T, P)
    assert abs(memory["per_device_bytes"] - expected) <= 3  # each part rounds down separately
    assert memory["strategy"] == name and backend.record.kind == "fsdp2"


def test_tensor_parallel_splits_over_the_group_and_each_copy_holds_it_again(accelerator, monkeypatch):
    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    backend = TensorParallelBackend(accelerator(4, index=3, kind="MULTI_CPU"), Recipe(tp_size=2))
    memory = backend.memory(T, P)
    assert memory["per_device_bytes"] == (4 * P) // 2 + (4 * T) // 2 + (8 * T) // 2
    assert memory["strategy"] == "tensor parallel (tp_size=2) x 2 data-parallel copies"
    assert (backend.dp.world, backend.dp.rank, backend.dp.replicas) == (2, 1, 2)


def test_sequence_parallel_devices_hold_the_activations_of_a_slice_of_each_sequence(accelerator):
    import dataclasses

    backend = Backend(accelerator(2), Recipe(per_device_train_batch_size=2, max_length=1024))
    assert backend.memory(T, P)["activations"] == "activations extra: at most 2,048 tokens per device"
    backend.record = dataclasses.replace(backend.record, sp_size=2)
    memory = backend.memory(T, P)
    assert memory["activation_tokens_per_device"] == 1024
    assert memory["activations"] == "activations extra: at most 1,024 tokens per device, 1/2 of each sequence"


@pytest.mark.parametrize("reshard, expected", [(True, (4 * P + 4 * T + 8 * T) // 4),
                                               (False, 4 * P // 2 + (4 * T + 8 * T) // 4)])
def test_fsdp2_x_tp_shard_grad_op_keeps_each_ranks_tp_shard_of_the_weights(accelerator, monkeypatch, reshard,
                                                                          expected):
    """FSDP2 x TP on 4 processes (fsdp 2 x tp 2): FULL_SHARD splits every part over all 4; SHARD_GRAD_OP keeps the
    weights gathered over fsdp only, so each rank holds its tp shard of them (half), not the whole model."""
    from torch.distributed.fsdp import OffloadPolicy

    from hftrain.parallel.tensor import FSDP2TensorParallelBackend

    monkeypatch.setattr("hftrain.parallel.base.tp_groups", lambda world, tp: (None, None))  # no process group here
    plugin = type("Plugin", (), {"reshard_after_forward": reshard, "cpu_offload": OffloadPolicy(),
                                 "mixed_precision_policy": None})()
    backend = FSDP2TensorParallelBackend(accelerator(4, kind="FSDP", fsdp_plugin=plugin), Recipe(tp_size=2))
    assert backend.record.model_shards == 2
    assert abs(backend.memory(T, P)["per_device_bytes"] - expected) <= 3  # each part rounds down separately


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
