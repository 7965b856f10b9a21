"""hftrain.metrics without a launch: FLOP formula, GPU peak table, timers, rank checks on made-up rank tables."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain import metrics
from hftrain.metrics import (
    FlopCounter,
    RunMeter,
    StepTimer,
    UtilizationSampler,
    param_checksum,
    peak_tflops,
    utilization_sampler,
)

H, LAYERS, INTER, VOCAB, HEADS = 64, 3, 96, 500, 4


def llama(tied: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=H, num_hidden_layers=LAYERS, intermediate_size=INTER, vocab_size=VOCAB,
                         num_attention_heads=HEADS, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def hand_matmul_params() -> int:
    kv = 2 * (H // HEADS)  # 2 key/value heads of head_dim 16
    attention = H * H + 2 * H * kv + H * H  # q, k, v, o
    norms = 2 * H
    return LAYERS * (attention + 3 * H * INTER + norms) + H + VOCAB * H  # + final norm + lm_head


def test_flops_full_fine_tuning_are_6n_plus_attention():
    counter = FlopCounter(llama())
    n = hand_matmul_params()
    assert counter.matmul_params == n and counter.per_token == 6 * n
    b, s = 3, 40
    assert counter.batch(b, s) == b * s * (6 * n + 12 * LAYERS * H * s)


def test_flops_frozen_weights_skip_weight_gradients_and_tied_head_counts():
    model = llama(tied=True)
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)  # e.g. adapters only on the MLP
    counter = FlopCounter(model)
    n = hand_matmul_params()  # the tied head still costs a matmul
    trainable = LAYERS * 3 * H * INTER
    assert (counter.matmul_params, counter.trainable_matmul_params) == (n, trainable)
    assert counter.per_token == 4 * n + 2 * trainable


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA A10G", 70.0), ("Tesla T4", None),
])
def test_peak_table_matches_gpu_names(monkeypatch, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0), None) == expected
    assert peak_tflops(torch.device("cuda", 0), 100.0) == 100.0  # the recipe's value wins


def test_no_peak_on_cpu_unless_given():
    assert peak_tflops(torch.device("cpu"), None) is None and peak_tflops(torch.device("cpu"), 1.5) == 1.5


class Clock:
    """A perf_counter the test moves by hand: phase times are then exact, whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    return clock


def test_step_timer_splits_phases_and_skips_time_between_steps(clock):
    timer = StepTimer(torch.device("cpu"))
    clock.sleep(0.05)  # before the step: not counted once restarted
    timer.restart()
    clock.sleep(0.02)
    timer.lap("data_wait")
    clock.sleep(0.03)
    timer.lap("forward")
    clock.sleep(0.01)
    timer.lap("forward")  # a second micro-batch adds to the same phase
    got = timer.collect()
    assert set(got) == set(metrics.TIMER_PHASES)
    assert got["data_wait"] == pytest.approx(0.02) and got["forward"] == pytest.approx(0.04)
    assert got["optimizer"] == 0
    assert timer.collect()["forward"] == 0  # collect starts a new window


def test_generation_timed_by_the_feed_moves_out_of_the_data_wait(clock):
    """grpo's feed samples a generation window inside the loop's wait for micro-batches and says how long it took:
    those seconds are generation, the rest of the wait stays data wait, and the step's total is unchanged."""
    timer = StepTimer(torch.device("cpu"))
    timer.restart()
    clock.sleep(0.05)
    timer.lap("data_wait")
    timer.move("data_wait", "generation", 0.03)
    got = timer.collect()
    assert got["generation"] == 0.03 and got["data_wait"] == pytest.approx(0.02)
    ranks = [rank(0.4, data_wait=0.1, generation=0.3), rank(0.4, data_wait=0.2, generation=0.5)]
    row = fake_meter(2, [])._metrics(ranks, steps=2, global_tokens=800, global_examples=20)
    assert row["generation_time"] == pytest.approx(0.4 / 2) and row["data_wait_time"] == pytest.approx(0.15 / 2)
    assert row["step_time"] == pytest.approx((0.2 + 0.5 + 0.4 + 0.5 + 0.1) / 2)  # rank 1's busy time, per step
    assert "generation_time" not in fake_meter(2, [])._metrics([rank(0.4), rank(0.4)], steps=2, global_tokens=800,
                                                               global_examples=20)


def fake_meter(world: int, warnings: list[str], threshold: float = 0.2) -> RunMeter:
    accelerator = SimpleNamespace(num_processes=world, process_index=0, device=torch.device("cpu"))
    return RunMeter(accelerator, FlopCounter(llama()), straggler_threshold=threshold, peak_tflops_override=None,
                    cost_per_gpu_hour=None, effective_batch_size=8, device_hours_before=0.0, warn=warnings.append)


def rank(forward: float, **overrides) -> dict:
    row = dict.fromkeys(RunMeter.FIELDS, 0.0)
    row.update(processed_tokens=1000, trained_tokens=400, loss_units=400, loss_sum=800.0, data_wait=0.1,
               forward=forward, backward=0.5, optimizer=0.1, step=10, loss=2.0, grad_norm=1.5, param_checksum=123.456,
               flops=1e9, peak_memory_mb=500.0)
    row.update(overrides)
    return row


def test_straggler_is_the_rank_slow_in_its_own_time_not_in_wall_clock():
    warnings: list[str] = []
    meter = fake_meter(4, warnings)
    ranks = [rank(0.4), rank(0.4), rank(0.4), rank(0.9)]  # rank 3: 1000 / 1.0 s vs 1000 / 0.5 s of own time
    meter._metrics(ranks, steps=5, global_tokens=1600, global_examples=40)
    assert warnings == []  # one slow window may be noise: the warning needs the same rank twice in a row
    row = meter._metrics(ranks, steps=5, global_tokens=1600, global_examples=40)
    assert row["slowest_rank"] == 3 and row["slowest_rank_ratio"] == pytest.approx(0.5)
    assert row["rank3/own_tokens_per_second"] == pytest.approx(1000.0)
    assert len(warnings) == 1 and "straggler: rank 3" in warnings[0] and "50% below" in warnings[0]
    assert row["ranks_in_sync"] is True
    # the wall-clock view: every rank trained 400 tokens in the slowest rank's busy time (1.6 s)
    assert row["rank0/tokens_per_second"] == row["rank3/tokens_per_second"] == pytest.approx(400 / 1.6)
    assert row["tokens_per_second"] == pytest.approx(1600 / 1.6) and row["step_time"] == pytest.approx(1.6 / 5)


def test_under_pp_a_rank_is_compared_only_with_its_stage_peers():
    """pp 2 x 2 copies: ranks {0, 1} hold stage 0 and {2, 3} stage 1, which does half the work per token here. Against
    all ranks both stage-0 ranks would look 50% slow every window; against their peers nobody is a straggler, and a
    slow copy of stage 1 is found. A pipeline of one copy has no peers: no check."""
    warnings: list[str] = []
    accelerator = SimpleNamespace(num_processes=4, process_index=0, device=torch.device("cpu"))
    meter = RunMeter(accelerator, FlopCounter(llama()), straggler_threshold=0.2, peak_tflops_override=None,
                     cost_per_gpu_hour=None, effective_batch_size=8, device_hours_before=0.0, warn=warnings.append,
                     peers=[[0, 1], [2, 3]])
    stages = [rank(0.9), rank(0.9), rank(0.4), rank(0.4)]
    for _ in range(3):
        row = meter._metrics(stages, 5, 1600, 40)
    assert row["slowest_rank_ratio"] == pytest.approx(1.0) and warnings == []
    slow_copy = [rank(0.9), rank(0.9), rank(0.4), rank(0.9)]
    for _ in range(2):
        row = meter._metrics(slow_copy, 5, 1600, 40)
    assert row["slowest_rank"] == 3 and row["slowest_rank_ratio"] == pytest.approx(0.5)
    assert len(warnings) == 1 and "straggler: rank 3" in warnings[0] and "below its peers' median" in warnings[0]
    alone = RunMeter(SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu")),
                     FlopCounter(llama()), straggler_threshold=0.2, peak_tflops_override=None, cost_per_gpu_hour=None,
                     effective_batch_size=8, device_hours_before=0.0, warn=warnings.append, peers=[[0], [1]])
    assert "slowest_rank" not in alone._metrics([rank(0.9), rank(0.4)], 5, 800, 40)


def test_within_threshold_is_not_a_straggler():
    warnings: list[str] = []
    row = fake_meter(2, warnings)._metrics([rank(0.4), rank(0.5)], 5, 800, 40)  # 2000 vs 1667 tok/s: 17% slower
    assert row["slowest_rank"] == 1 and row["slowest_rank_ratio"] == pytest.approx((1000 / 0.6) / 2000)
    assert warnings == []


@pytest.mark.parametrize("key, value", [("param_checksum", 123.457), ("loss", 2.01), ("step", 11.0),
                                        ("grad_norm", 1.6)])
def test_desync_names_the_disagreeing_value(key, value):
    warnings: list[str] = []
    row = fake_meter(2, warnings)._metrics([rank(0.4), rank(0.4, **{key: value})], 5, 800, 40)
    assert row["ranks_in_sync"] is False
    assert len(warnings) == 1 and f"desync: ranks disagree on {key}" in warnings[0]


def test_single_process_has_no_rank_checks():
    warnings: list[str] = []
    row = fake_meter(1, warnings)._metrics([rank(0.4)], 5, 400, 20)
    assert "slowest_rank" not in row and "ranks_in_sync" not in row and "mfu" not in row and warnings == []
    assert row["tflops_per_device"] == pytest.approx(1e9 / 1.1 / 1e12)


def test_param_checksum_sums_every_parameter_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    expected = sum(p.double().sum().item() for p in model.parameters())
    assert param_checksum(model) == pytest.approx(expected, rel=1e-15)


def test_first_window_reports_the_slowest_rank_without_warning():
    warnings: list[str] = []
    row = fake_meter(2, warnings)._metrics([rank(0.4), rank(0.9)], 5, 800, 40, first=True)  # warm-up window
    assert row["slowest_rank"] == 1 and row["slowest_rank_ratio"] == pytest.approx(0.5) and warnings == []


def test_a_different_slow_rank_each_window_is_noise_not_a_straggler():
    warnings: list[str] = []
    meter = fake_meter(2, warnings)
    for slow in (0, 1, 0, 1):
        ranks = [rank(0.9 if r == slow else 0.4) for r in range(2)]
        assert meter._metrics(ranks, 5, 800, 40)["slowest_rank"] == slow
    assert warnings == []


def test_multi_node_runs_report_each_nodes_throughput():
    """2 nodes x 2 ranks, ranks numbered node by node: node 1's ranks trained 3x node 0's tokens and examples, so
    node 1 gets 3/4 of the step's 1600 tokens and 40 examples over the window's 1.1 s; one node reports nothing."""
    accelerator = SimpleNamespace(num_processes=4, process_index=0, device=torch.device("cpu"))
    meter = RunMeter(accelerator, FlopCounter(llama()), straggler_threshold=0.2, peak_tflops_override=None,
                     cost_per_gpu_hour=None, effective_batch_size=8, device_hours_before=0.0, warn=print, machines=2)
    ranks = [rank(0.4, trained_tokens=t, examples=e) for t, e in ((100, 2), (100, 3), (300, 7), (300, 8))]
    row = meter._metrics(ranks, steps=1, global_tokens=1600, global_examples=40)
    train_time = 0.1 + 0.4 + 0.5 + 0.1
    assert row["node0/tokens_per_second"] == pytest.approx(400 / train_time)
    assert row["node1/tokens_per_second"] == pytest.approx(1200 / train_time)
    assert row["node0/samples_per_second"] == pytest.approx(40 * 5 / 20 / train_time)
    assert row["node1/samples_per_second"] == pytest.approx(40 * 15 / 20 / train_time)
    assert row["node0/tokens_per_second"] + row["node1/tokens_per_second"] == pytest.approx(row["tokens_per_second"])
    assert not any(k.startswith("node") for k in fake_meter(4, [])._metrics(ranks, 1, 1600, 40))


class FakeSampler(UtilizationSampler):
    """A utilisation sampler whose readings the test gives (no thread, no NVML)."""

    def __init__(self, name: str, values: list[float]):
        super().__init__(name, None)
        self.samples = list(values)


def test_gpu_utilization_is_logged_per_rank_and_a_low_minimum_twice_warns_with_the_phase():
    """Rank 1's GPU is at 40% for two windows and its step is mostly data wait: one warning naming it, at the second
    window; the first window after a (re)start never warns."""
    warnings: list[str] = []
    accelerator = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    meter = RunMeter(accelerator, FlopCounter(llama()), straggler_threshold=0.2, peak_tflops_override=None,
                     cost_per_gpu_hour=None, effective_batch_size=8, device_hours_before=0.0, warn=warnings.append,
                     utilization=FakeSampler("gpu_utilization", [90.0, 94.0]))
    assert meter.utilization.window_mean() == pytest.approx(92.0) and math.isnan(meter.utilization.window_mean())
    ranks = [rank(0.4, utilization=92.0), rank(0.4, utilization=40.0, data_wait=0.9)]
    row = meter._metrics(ranks, 5, 800, 40, first=True)
    assert (row["gpu_utilization"], row["min_gpu_utilization"], row["rank1/gpu_utilization"]) == (66.0, 40.0, 40.0)
    assert warnings == []
    meter._metrics(ranks, 5, 800, 40)
    low = [w for w in warnings if "utilization" in w]  # (rank 1 is also a straggler in its own time: warned apart)
    assert len(low) == 1 and "low gpu_utilization: rank 1 at 40%" in low[0]
    assert "data wait" in low[0] and "47% of it" in low[0]  # 0.9 of 0.9 + 0.1 + 0.4 + 0.5
    ranks[1]["utilization"] = 85.0
    meter._metrics(ranks, 5, 800, 40)
    assert len([w for w in warnings if "utilization" in w]) == 1  # recovered


def test_cpu_utilization_is_reported_without_warnings_and_missing_samples_are_left_out():
    warnings: list[str] = []
    accelerator = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    meter = RunMeter(accelerator, FlopCounter(llama()), straggler_threshold=0.2, peak_tflops_override=None,
                     cost_per_gpu_hour=None, effective_batch_size=8, device_hours_before=0.0, warn=warnings.append,
                     utilization=FakeSampler("cpu_utilization", []))
    for _ in range(3):
        row = meter._metrics([rank(0.4, utilization=30.0), rank(0.4, utilization=float("nan"))], 5, 800, 40)
    assert row["cpu_utilization"] == row["min_cpu_utilization"] == 30.0 and "rank1/cpu_utilization" not in row
    assert not any("utilization" in w for w in warnings)
    none = meter._metrics([rank(0.4, utilization=float("nan"))] * 2, 5, 800, 40)
    assert "cpu_utilization" not in none


def test_the_cpu_sampler_measures_this_process():
    sampler = utilization_sampler(torch.device("cpu"), interval=0.05)
    deadline = time.perf_counter() + 0.6
    while time.perf_counter() < deadline:  # keep one core busy
        sum(i * i for i in range(1000))
    sampler.stop()
    assert sampler.name == "cpu_utilization" and 0 < sampler.window_mean() <= 100


def test_tensor_and_pipeline_groups_count_each_tokens_work_once():
    """pp 2 x tp 2 on 4 processes, one model copy: every rank sees the step's 2 rows of 64 tokens and does a quarter
    of their FLOPs. The window's totals are one copy's: 128 processed tokens and FlopCounter's FLOPs of the batch per
    step, spread over the 4 devices; without the division the run claimed 4x both (MFU under pp counted the whole
    model on every stage)."""
    flops = FlopCounter(llama())
    accelerator = SimpleNamespace(num_processes=4, process_index=0, device=torch.device("cpu"))
    meter = RunMeter(accelerator, flops, straggler_threshold=0.2, peak_tflops_override=None, cost_per_gpu_hour=None,
                     effective_batch_size=2, device_hours_before=0.0, warn=[].append, model_shards=4,
                     peers=[[0, 1], [2, 3]])
    meter.count([(2, 64)], torch.tensor(100.0))
    assert meter.processed == 128 and meter.window_flops == flops.batch(2, 64)  # what this rank saw
    ranks = [rank(0.4, processed_tokens=meter.processed, flops=meter.window_flops) for _ in range(4)]
    row = meter._metrics(ranks, steps=1, global_tokens=100, global_examples=2)
    train_time = 1.1  # each rank's phases: data 0.1 + forward 0.4 + backward 0.5 + optimizer 0.1
    assert row["total_tokens_per_second"] == pytest.approx(2 * 64 / train_time)
    assert row["tflops_per_device"] == pytest.approx(flops.batch(2, 64) / train_time / 4 / 1e12)
    assert row["rank0/own_tokens_per_second"] == pytest.approx(128 / 0.5)  # a rank's own rate: every token it saw


def test_a_ranks_loss_is_its_loss_sum_over_the_objectives_units_not_its_tokens():
    """dpo sums one loss per pair: a rank's loss is its sum over its pairs (the step loss's units), as `loss` is;
    dividing by its trained tokens made rank0/loss 0.46 beside a loss of 6.7."""
    pairs = [rank(0.4, loss_sum=13.4, loss_units=2, trained_tokens=58), rank(0.4, loss_sum=6.0, loss_units=1,
                                                                               trained_tokens=30)]
    row = fake_meter(2, [])._metrics(pairs, steps=1, global_tokens=88, global_examples=3)
    assert row["rank0/loss"] == pytest.approx(6.7) and row["rank1/loss"] == pytest.approx(6.0)
