"""hftrain/memory.py, the one model-state memory model: its arithmetic against bytes written out by hand, and its two
callers (a backend's start-up line, `hftrain estimate`'s rows) giving the same numbers for the same layout."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import OffloadPolicy
from transformers import LlamaConfig

from hftrain.config import Recipe
from hftrain.estimate import estimate, model_shape
from hftrain.memory import (
    SINGLE,
    ModelState,
    ParameterCounts,
    Placement,
    fsdp,
    optimizer_bytes,
    zero,
    zero_offload_state,
)
from hftrain.parallel.base import Backend
from hftrain.parallel.deepspeed import DeepSpeedBackend
from hftrain.parallel.fsdp import FSDP2Backend
from tests.unit.parallel.conftest import fake_accelerator

H, L, INTER, V, HEADS, KV_HEADS = 64, 2, 160, 96, 4, 2
KV = KV_HEADS * H // HEADS
UNIT = H * H + 2 * H * KV + H * H + 3 * H * INTER + 2 * H  # one decoder layer: its linears and two norms
N = V * H + L * UNIT + H + V * H  # embedding, layers, final norm, untied head


def test_one_process_holds_everything_and_sgd_momentum_one_buffer():
    P, T = 1000, 250
    held = SINGLE.per_device(ModelState.of(P, T, 4, optimizer_bytes(adamw=True)))
    assert (held.weights, held.gradients, held.optimizer, held.cpu) == (4000, 1000, 2000, 0)
    assert (optimizer_bytes(False, 0.9), optimizer_bytes(False, 0.0)) == (4, 0)


def test_zero_stages_shard_the_parts_in_order_and_offload_moves_them_to_cpu():
    state = ModelState.of(1000, 1000, 2, 12)  # 16-bit weights and gradients; fp32 master + two moments
    assert zero(1, 4).per_device(state).on_device == 2000 + 2000 + 3000
    assert zero(2, 4).per_device(state).on_device == 2000 + 500 + 3000
    assert zero(3, 4).per_device(state).on_device == 500 + 500 + 3000
    held = zero(3, 4, ("weights", "optimizer")).per_device(state)
    assert (held.weights, held.gradients, held.optimizer, held.cpu) == (0, 0, 0, 500 + 500 + 3000)


def test_zero_offload_takes_the_gradient_partitions_to_cpu():
    """Optimizer offload: each process's gradient partition lives in CPU memory beside its optimizer partition, at
    stage 1 too (DeepSpeed reduces into the partition the CPU optimizer steps), fp32 at stages 1-2."""
    state = ModelState.of(1000, 1000, 2, 12)
    for stage in (1, 2):
        held = zero(stage, 4, ("optimizer",)).per_device(zero_offload_state(state, 1000, stage))
        assert (held.weights, held.gradients, held.optimizer, held.cpu) == (2000, 0, 0, 4000 // 4 + 12000 // 4)
    held = zero(3, 4, ("optimizer",)).per_device(zero_offload_state(state, 1000, 3))  # 16-bit at stage 3
    assert (held.weights, held.gradients, held.optimizer, held.cpu) == (500, 0, 0, 2000 // 4 + 12000 // 4)


def test_tp_and_pp_split_what_is_not_sharded_and_each_part_rounds_down():
    """FSDP2 SHARD_GRAD_OP x tp 2 on 8 processes: the weights are whole over fsdp, split over the 2 tp shards; the
    gradients and moments are split over all 8."""
    held = Placement(8, 2, ("gradients", "optimizer")).per_device(ModelState.of(1001, 1001, 4, 8))
    assert (held.weights, held.gradients, held.optimizer) == (4004 // 2, 4004 // 8, 8008 // 8)
    assert fsdp(4, full_shard=False) == Placement(4, 1, ("gradients", "optimizer"))


def test_a_frozen_copy_is_placed_like_the_trained_weights():
    assert SINGLE.frozen(4000).weights == 4000  # DDP: whole on every process
    assert zero(2, 4).frozen(2000).weights == 2000  # ZeRO-1/2 replicate the weights
    assert zero(3, 4).frozen(2000).weights == 500
    offloaded = zero(3, 4, ("weights", "optimizer")).frozen(2000)
    assert (offloaded.weights, offloaded.cpu) == (0, 500)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=H, num_hidden_layers=L, intermediate_size=INTER, vocab_size=V, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, tie_word_embeddings=False).save_pretrained(folder)
    shape = model_shape(str(folder))
    assert (shape.params, shape.largest_layer_params) == (N, UNIT)
    return {r.strategy: r for r in estimate(shape, gpus=4, batch=1, seq=8, precision="bf16").rows}


def deepspeed(stage: int, **offload) -> Backend:
    config = {"zero_optimization": {"stage": stage, **offload}}
    return DeepSpeedBackend(fake_accelerator(4, kind="DEEPSPEED", deepspeed_config=config), Recipe(bf16=True))


def fsdp2() -> Backend:
    plugin = type("Plugin", (), {"reshard_after_forward": True, "cpu_offload": OffloadPolicy(),
                                 "mixed_precision_policy": None})()
    return FSDP2Backend(fake_accelerator(4, kind="FSDP", fsdp_plugin=plugin), Recipe(bf16=True))


CPU = {"device": "cpu"}


@pytest.mark.parametrize("strategy, backend, on_device, cpu, beyond", [
    # full fine-tuning of N parameters on 4 GPUs, bf16 mixed precision, AdamW, by hand. `beyond`: what the estimate
    # adds to the model state (weights, gradients): autocast's bf16 weight copy and DDP's all-reduce buckets, the
    # two layers ZeRO-3 / FSDP gather for compute and FSDP's unsharded gradient of one layer
    ("DDP", lambda: Backend(fake_accelerator(4), Recipe(bf16=True)), 4 * N + 4 * N + 8 * N, 0, (2 * N, 4 * N)),
    ("ZeRO-1", lambda: deepspeed(1), 2 * N + 2 * N + 12 * N // 4, 0, (0, 0)),
    ("ZeRO-2", lambda: deepspeed(2), 2 * N + 2 * N // 4 + 12 * N // 4, 0, (0, 0)),
    ("ZeRO-3", lambda: deepspeed(3), 2 * N // 4 + 2 * N // 4 + 12 * N // 4, 0, (2 * 2 * UNIT, 0)),
    ("FSDP full shard", fsdp2, 4 * N // 4 + 4 * N // 4 + 8 * N // 4, 0, (2 * 2 * UNIT, 4 * UNIT)),
    # optimizer offload: the gradient partitions in CPU memory too, fp32 at stage 2
    ("ZeRO-2 + optimizer offload", lambda: deepspeed(2, offload_optimizer=CPU), 2 * N, 4 * N // 4 + 12 * N // 4,
     (0, 0)),
    ("ZeRO-3 + parameter and optimizer offload", lambda: deepspeed(3, offload_optimizer=CPU, offload_param=CPU),
     0, 2 * N // 4 + 2 * N // 4 + 12 * N // 4, (2 * 2 * UNIT, 0)),
])
def test_the_start_up_line_and_the_estimate_give_the_same_model_state(rows, strategy, backend, on_device, cpu,
                                                                      beyond):
    started = backend().memory(ParameterCounts.uniform(N, N, 4))  # fp32 weights, all trained
    assert (started["per_device_bytes"], started["offloaded_bytes"]) == (on_device, cpu)
    row = rows[strategy]
    weights, grads = beyond
    assert row.weights - weights + row.grads - grads + row.optimizer == on_device
    assert row.cpu == cpu


def test_the_estimate_places_a_reference_and_a_teacher_on_the_sequence_parallel_rows_as_their_strategy(tmp_path):
    """dpo's reference and distill's teacher beside ZeRO-3 + Ulysses are ZeRO-3's (16-bit, partitioned over the
    GPUs), beside the ring (FSDP2) FSDP's (fp32, sharded): on the GPUs, not in host memory, and not whole."""
    LlamaConfig(hidden_size=H, num_hidden_layers=L, intermediate_size=INTER, vocab_size=V, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, tie_word_embeddings=False).save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    sft = {r.strategy: r for r in estimate(shape, gpus=4, batch=2, seq=8, sp=2).rows}
    for other in (estimate(shape, gpus=4, batch=1, seq=8, sp=2, objective="dpo"),
                  estimate(shape, gpus=4, batch=2, seq=8, sp=2, objective="distill", teacher=shape)):
        copies = {r.strategy: r for r in other.rows}
        for name, copy in (("ZeRO-3 + Ulysses sequence parallel sp=2", 2 * N // 4),
                           ("FSDP full shard + ring attention context parallel cp=2", 4 * N // 4)):
            assert (copies[name].weights, copies[name].cpu) == (sft[name].weights + copy, 0), name
