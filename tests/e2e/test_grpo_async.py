"""async_generation end to end on the tiny model that often ends its completions: the rollout worker (a second
process) with max_staleness 0 and weight_sync_steps 1 gives the synchronous run (the same rollouts, losses,
evaluations and weights); with max_staleness 1 each completion's recorded policy version and behaviour log-probs
are those of that version's weights (recomputed from the checkpoints), and each step's update equals the step written
in plain PyTorch from rollouts.jsonl, with TRL's importance-sampling correction (sequence_mask) and without it (a run
with vllm_importance_sampling_correction false), the two updates differing where the policy versions differ; a worker
killed or frozen mid-run stops the run within seconds with a message naming it and the checkpoint it saved; 2 DDP
processes equal one, and so do 2 under ZeRO-3 and FSDP2 (the weights gathered for each push); LoRA (the worker
receives the merged weights) with max_staleness 0 equals the synchronous LoRA run, and QLoRA's worker samples with the
dequantized base, its adapter merged; a run resumed from a checkpoint that holds a stale window equals the
uninterrupted one; the shipped recipe learns.

Runs of 2-3 steps of 8 completions of <= 6 tokens, with SGD (its update is proportional to the gradient)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from hftrain.paths import REPORT_DIR
from hftrain.report import write_report
from tests.conftest import FSDP_LAUNCHER, REPO, launch, run_script
from tests.e2e.test_grpo import (  # noqa: F401 - ending_model: the fixture
    BASE,
    LORA,
    ONE_BY_EIGHT,
    TINY,
    TWO_PROCS,
    ending_model,
    evaluating,
    token_log_probs,
)

SAVE = ["--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false"]


def args(model: Path, steps: int) -> list[str]:
    """BASE on `model`, num_iterations 1, beta 0, `steps` steps of one 8-completion window each."""
    out = [str(model) if a == TINY else a for a in BASE]
    for name, value in (("--num_iterations", "1"), ("--beta", "0"), ("--max_steps", str(steps))):
        out[out.index(name) + 1] = value
    return [*out, *ONE_BY_EIGHT]


def rows_of(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def weights_at(run, model: Path, step: int):
    """The causal LM after `step` optimizer steps (0: the starting model)."""
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if step:
        lm.load_state_dict({k.removeprefix("lm."): v for k, v in
                            load_file(run.output_dir / f"checkpoint-{step}" / "model.safetensors").items()})
    return lm


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ending_model):  # noqa: F811 - the imported fixture
    tmp = tmp_path_factory.mktemp("grpo-async")
    # a smaller step and another seed: the policy moves by about a nat per token in a step (the importance weights
    # are 0.2-0.3, one masked), and the second window's rewards differ within its groups
    stale = [*args(ending_model, 2), "--learning_rate", "0.02", "--seed", "4", "--async_generation", "true",
             "--max_staleness", "1", *SAVE]
    async0 = [*args(ending_model, 3), "--async_generation", "true", "--max_staleness", "0"]
    return {
        # both evaluate after step 2 and at the end (the trainer completes the eval prompts itself)
        "sync": run_script(tmp / "sync", *args(ending_model, 3), *evaluating(tmp)),
        "async0": run_script(tmp / "async0", *async0, *evaluating(tmp)),
        "stale": run_script(tmp / "stale", *stale),
        "stale-raw": run_script(tmp / "stale-raw", *stale, "--vllm_importance_sampling_correction", "false"),
        # 2 processes under DDP, each with its worker for its rows: 2 x 2 completions x accumulation 2
        "stale-2procs": launch(tmp / "stale-2procs", *stale, *TWO_PROCS, preset="cpu_ddp"),
        # ZeRO-3 and FSDP2: the weights gathered whole on every rank for each push to its worker (versions 0-2)
        "async0-zero3": launch(tmp / "async0-zero3", *async0, *TWO_PROCS, preset="zero3"),
        "async0-fsdp2": launch(tmp / "async0-fsdp2", *async0, *TWO_PROCS, preset="fsdp2", processes=2,
                               script=FSDP_LAUNCHER),
        # LoRA (the worker receives the base with the adapter merged in): synchronous, and max_staleness 0
        "lora-sync": run_script(tmp / "lora-sync", *args(ending_model, 3), *LORA),
        "lora-async0": run_script(tmp / "lora-async0", *args(ending_model, 3), *LORA, "--async_generation", "true",
                                  "--max_staleness", "0", *SAVE),
        # QLoRA: the worker receives the 4-bit base dequantized, the adapter merged
        "qlora-async0": run_script(tmp / "qlora-async0", *args(ending_model, 2), *LORA, "--load_in_4bit",
                                   "--async_generation", "true", "--max_staleness", "0", *SAVE),
    }


def test_max_staleness_0_is_the_synchronous_run(runs):
    sync, async0 = runs["sync"], runs["async0"]
    a, b = rows_of(sync), rows_of(async0)
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in b]), torch.tensor([r["advantage"] for r in a]))
    assert [r["policy_version"] for r in b] == [r["step"] - 1 for r in b]  # every window by the weights before it
    # the worker's behaviour log-probs come from generate's incremental forward, the trainer's from one forward over
    # the whole rows: equal within ~1e-7 per token, so the importance weights are 1 within ~1e-6 (losses near 0 here)
    assert [m["loss"] for m in async0.train_rows()] == pytest.approx([m["loss"] for m in sync.train_rows()],
                                                                     rel=1e-5, abs=1e-6)
    got, want = load_file(async0.output_dir / "final" / "model.safetensors"), \
        load_file(sync.output_dir / "final" / "model.safetensors")
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    evaluations = [m for m in async0.metrics() if "eval_reward" in m]
    assert [m["step"] for m in evaluations] == [2, 3]
    assert [m["eval_reward"] for m in evaluations] == pytest.approx(
        [m["eval_reward"] for m in sync.metrics() if "eval_reward" in m], rel=1e-6)
    metrics = async0.train_rows()
    assert all(m["sample/staleness_max"] == 0 for m in metrics)
    assert {"rollout/worker_busy_s", "perf/rollout_wait_s", "sampling/importance_sampling_ratio/mean"} <= set(
        metrics[0])


def test_lora_max_staleness_0_is_the_synchronous_lora_run(runs, ending_model):  # noqa: F811
    """LoRA: at each push the worker receives the base weights with the adapter merged in. With max_staleness 0 it
    samples, and the run trains, what the synchronous LoRA run does: the same rollouts, advantages, losses and final
    adapter. The adapter has moved the policy by step 2, and the behaviour log-probs the worker recorded for step 2
    are those of the base with checkpoint-1's adapter (peft on plain transformers), not the base model's."""
    sync, lora = runs["lora-sync"], runs["lora-async0"]
    a, b = rows_of(sync), rows_of(lora)
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in b]), torch.tensor([r["advantage"] for r in a]))
    assert [r["policy_version"] for r in b] == [r["step"] - 1 for r in b]
    # steps 2 and 3 log losses of ~1e-7 (their advantages cancel): float rounding of the merged weights' forward
    assert [m["loss"] for m in lora.train_rows()] == pytest.approx([m["loss"] for m in sync.train_rows()],
                                                                    rel=1e-5, abs=1e-6)
    got, want = load_file(lora.output_dir / "final" / "adapter_model.safetensors"), \
        load_file(sync.output_dir / "final" / "adapter_model.safetensors")
    assert want and sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trained = {k.removeprefix("lm."): v for k, v in
               load_file(lora.output_dir / "checkpoint-1" / "model.safetensors").items()}
    missing, unexpected = policy.load_state_dict(trained, strict=False)
    assert trained and not unexpected and not [k for k in missing if "lora_" in k]
    base = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    moved = 0.0
    with torch.no_grad():
        for r in (r for r in b if r["step"] == 2):
            behaviour = torch.tensor(r["behaviour_logps"])
            torch.testing.assert_close(behaviour, token_log_probs(policy, r), rtol=1e-5, atol=1e-5)
            moved = max(moved, (token_log_probs(base, r) - behaviour).abs().max().item())
    assert moved > 1e-2, moved  # a worker sampling with the base alone would fail the comparison above


def test_qlora_pushes_the_dequantized_base_with_the_adapter_merged(runs, ending_model):  # noqa: F811
    """QLoRA (4-bit nf4 base): at each push the worker receives the base dequantized with the adapter merged in, so
    step 2's behaviour log-probs equal a plain model built here another way: transformers' `dequantize()` of the same
    4-bit load with checkpoint-1's adapter merged by peft's `merge_and_unload`. The trainer's policy (the 4-bit
    layers, the adapter unmerged) differs from that by rounding only on CPU (bitsandbytes dequantizes for the
    training matmul), and the importance-sampling weights step 2 logged (sequence_mask: one per completion) equal
    exp(sum_t(trainer log-prob - behaviour log-prob)) recomputed here from rollouts.jsonl."""
    run = runs["qlora-async0"]
    rows = [r for r in rows_of(run) if r["step"] == 2]
    assert len(rows) == 8 and {r["policy_version"] for r in rows} == {1}
    adapter = {k.removeprefix("lm."): v for k, v in
               load_file(run.output_dir / "checkpoint-1" / "model.safetensors").items() if "lora_" in k}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    def four_bit():
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(ending_model, quantization_config=quantization,
                                                    dtype=torch.float32)

    def with_adapter(model):
        policy = get_peft_model(model, config)
        missing, unexpected = policy.load_state_dict(adapter, strict=False)
        assert adapter and not unexpected and not [k for k in missing if "lora_" in k]
        return policy

    # in train mode, as the trainer's forward (in eval mode on a CPU with AVX512-BF16 bitsandbytes repacks the weights
    # for its inference kernel, with bfloat16 scales)
    trainer = with_adapter(four_bit()).train()
    plain = with_adapter(four_bit().dequantize(dtype=torch.float32)).merge_and_unload()
    base = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    weights, moved = [], 0.0
    with torch.no_grad():
        for r in rows:
            behaviour = torch.tensor(r["behaviour_logps"])
            torch.testing.assert_close(behaviour, token_log_probs(plain, r), rtol=1e-5, atol=1e-5)
            moved = max(moved, (token_log_probs(base, r) - behaviour).abs().max().item())
            weight = math.exp((token_log_probs(trainer, r) - behaviour).sum().item())
            weights.append(0.0 if weight > 3.0 else weight)
    assert moved > 1e-2, moved  # neither the unquantized base: the 4-bit rounding and the adapter show
    logged = run.train_rows()[1]
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-5)
    assert logged["sampling/importance_sampling_ratio/min"] == pytest.approx(min(weights), abs=1e-5)
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(max(weights), abs=1e-5)


def plain_step(before, rows: list[dict], corrected: bool, lr: float = 0.02) -> dict[str, torch.Tensor]:
    """One dapo step of the trainer's weights `before` on `rows` (first pass: ratio exp(logp - logp.detach())),
    each completion's token losses times TRL's sequence_mask weight exp(sum_t (logp_old - behaviour)) (0 above
    vllm_importance_sampling_clip_max 3.0) when `corrected`, then clipping at 1.0 and SGD at `lr`."""
    loss, tokens = 0.0, 0
    for r in rows:
        logps = token_log_probs(before, r)
        weight = 1.0
        if corrected:
            weight = math.exp((logps.detach() - torch.tensor(r["behaviour_logps"])).sum().item())
            weight = 0.0 if weight > 3.0 else weight
        loss = loss - (r["advantage"] * torch.exp(logps - logps.detach()) * weight).sum()
        tokens += len(r["completion_ids"])
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(before.parameters(), 1.0)
    torch.optim.SGD(before.parameters(), lr=lr).step()
    return before.state_dict()


def test_stale_windows_carry_their_policy_and_train_as_written_out(runs, ending_model):  # noqa: F811
    """max_staleness 1: windows 0 and 1 are sampled by version 0 (the starting model), window 1 trained at step 2
    by the weights after step 1; the recorded behaviour log-probs are version 0's, the IS weights differ from 1, and
    each run's checkpoint-2 equals its step written out: with the correction, and without it, and the two differ."""
    stale, raw = runs["stale"], runs["stale-raw"]
    rows = rows_of(stale)
    assert [r["policy_version"] for r in rows] == [0] * 16
    assert [r["completion_ids"] for r in rows] == [r["completion_ids"] for r in rows_of(raw)]
    start = weights_at(stale, ending_model, 0)
    with torch.no_grad():
        for r in rows:
            torch.testing.assert_close(torch.tensor(r["behaviour_logps"]), token_log_probs(start, r),
                                       rtol=1e-5, atol=1e-5)
    step2 = [r for r in rows if r["step"] == 2]
    with torch.no_grad():
        after1 = weights_at(stale, ending_model, 1)
        drift = [(token_log_probs(after1, r) - torch.tensor(r["behaviour_logps"])).sum().item() for r in step2]
    assert max(abs(d) for d in drift) > 0.5  # the version differs: the correction has something to do
    assert any(r["advantage"] != 0 for r in step2)
    results = {}
    for name, run, corrected in (("corrected", stale, True), ("raw", raw, False)):
        want = plain_step(weights_at(run, ending_model, 1), [r for r in rows_of(run) if r["step"] == 2], corrected)
        got = {k.removeprefix("lm."): v for k, v in
               load_file(run.output_dir / "checkpoint-2" / "model.safetensors").items()}
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-6, msg=lambda m, key=key: f"{key}: {m}")
        results[name] = got
    before = {k: v for k, v in weights_at(stale, ending_model, 1).state_dict().items()}
    update = max((results["raw"][k] - before[k]).abs().max().item() for k in before)
    apart = max((results["corrected"][k] - results["raw"][k]).abs().max().item() for k in before)
    assert update > 0 and apart > 0.1 * update  # the correction changes the update materially
    assert runs["stale"].train_rows()[1]["sample/staleness_max"] == 1


def test_two_processes_equal_one(runs):
    """The max_staleness 1 run on 2 processes (each its own worker, 2 completions per micro-batch, accumulation 2):
    the same rollouts, policy versions and behaviour log-probs, losses and weights as on one."""
    one, two = runs["stale"], runs["stale-2procs"]
    a, b = rows_of(one), rows_of(two)
    assert [(r["completion_ids"], r["policy_version"]) for r in a] == [(r["completion_ids"], r["policy_version"])
                                                                       for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(y["behaviour_logps"]), torch.tensor(x["behaviour_logps"]),
                                   rtol=1e-5, atol=1e-5)
    assert [m["loss"] for m in two.train_rows()] == pytest.approx([m["loss"] for m in one.train_rows()], rel=1e-4,
                                                                  abs=1e-6)
    got, want = load_file(two.output_dir / "final" / "model.safetensors"), \
        load_file(one.output_dir / "final" / "model.safetensors")
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("preset, wrapper", [("zero3", "DeepSpeedEngine"), ("fsdp2", "FSDPGRPOLoss")])
def test_sharded_trainers_push_whole_weights_to_their_workers(runs, preset, wrapper):
    """max_staleness 0 on 2 processes under ZeRO-3 (partitioned weights) and FSDP2 (sharded DTensors): each rank
    gathers the whole weights for each push to its worker, so every window after the first is sampled by the trained
    weights (versions 1 and 2) and the run equals the one-process run (itself the synchronous run, above): the same
    rollouts, policy versions and behaviour log-probs, losses and final weights."""
    one, two = runs["async0"], runs[f"async0-{preset}"]
    info = two.state()["launch"]
    assert (info["num_processes"], info["model_wrapper"], info["backend"]) == (2, wrapper, "gloo")
    if preset == "zero3":
        assert info["deepspeed_config"]["zero_optimization"]["stage"] == 3
    a, b = rows_of(one), rows_of(two)
    assert [(r["completion_ids"], r["policy_version"]) for r in b] == [(r["completion_ids"], r["policy_version"])
                                                                       for r in a]
    assert sorted({r["policy_version"] for r in b}) == [0, 1, 2]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(y["behaviour_logps"]), torch.tensor(x["behaviour_logps"]),
                                   rtol=1e-5, atol=1e-5)
    assert [m["loss"] for m in two.train_rows()] == pytest.approx([m["loss"] for m in one.train_rows()], rel=1e-4,
                                                                  abs=1e-6)
    got, want = load_file(two.output_dir / "final" / "model.safetensors"), \
        load_file(one.output_dir / "final" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_run_resumed_mid_queue_equals_the_uninterrupted_run(runs, tmp_path):
    """The max_staleness 1 run's checkpoint-1 holds window 1 (sampled by version 0, which the resumed run cannot push
    again: its weights are version 1); resumed from it, step 2 trains the same rollouts and ends with the same
    weights as the uninterrupted run."""
    stale = runs["stale"]
    state = json.loads((stale.output_dir / "checkpoint-1" / "data_stream_process0.json").read_text())
    assert state["async_complete"] and [w["window"] for w in state["async_windows"]] == [1]
    assert [w["version"] for w in state["async_windows"]] == [0]
    config = stale.output_dir / "hftrain_config.yaml"
    resumed = run_script(tmp_path / "resumed", "--config", str(config), "--output_dir", str(tmp_path / "resumed"),
                         "--resume_from_checkpoint", str(stale.output_dir / "checkpoint-1"))
    want = [r for r in rows_of(stale) if r["step"] == 2]
    assert [(r["completion_ids"], r["behaviour_logps"], r["advantage"]) for r in rows_of(resumed)] == \
        [(r["completion_ids"], r["behaviour_logps"], r["advantage"]) for r in want]
    got, expected = load_file(resumed.output_dir / "final" / "model.safetensors"), \
        load_file(stale.output_dir / "final" / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


KILLER = """import os, signal
from hftrain.rl.example_rewards import vowel_share
CALLS = []


def signalled_vowel_share(prompts, completions, completion_ids, **kwargs):
    CALLS.append(1)
    if len(CALLS) == 2:  # the second window: signal this process's rollout worker (its spawned child process)
        for pid in os.listdir("/proc"):
            try:
                status = open(f"/proc/{pid}/status").read()
                command = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if f"PPid:\\t{os.getpid()}\\n" in status and b"spawn_main" in command:
                os.kill(int(pid), getattr(signal, os.environ["WORKER_SIGNAL"]))
    return vowel_share(prompts, completions, completion_ids)
"""


@pytest.mark.parametrize("signal_name, what", [
    ("SIGKILL", r"died \(exit code -9\)"),
    ("SIGSTOP", r"made no progress for \d+ s while the trainer waited for generation batch 2 \(hung; hang_timeout 3 "
                r"s\); it was killed")])
def test_a_dead_or_hung_worker_stops_the_run_naming_it(tmp_path, ending_model, signal_name, what):  # noqa: F811
    """The worker killed (SIGKILL) or frozen (SIGSTOP) after it sent the second window: the trainer stops within
    seconds (hang_timeout 3) at step 3, every rank at once, with a checkpoint and one paragraph naming the worker."""
    reward = tmp_path / "signalled.py"
    reward.write_text(KILLER)
    run = run_script(tmp_path / "dead", *args(ending_model, 6), "--async_generation", "true", "--max_staleness", "0",
                     "--reward_funcs", f"{reward}:signalled_vowel_share", "--hang_timeout", "3", check=False,
                     timeout=300, env={"WORKER_SIGNAL": signal_name})
    assert run.returncode != 0
    message = " ".join(run.stderr.split())
    assert re.search(r"the rollout worker of process 0 \(pid \d+\) " + what + r", so generation batch 2 "
                     r"\(training step 3\) has no rollouts\. The state after step 2 is in \S+checkpoint-2", message), \
        message[-1500:]
    assert "Traceback" not in message
    assert not (run.output_dir / "final").exists()


def test_tiny_grpo_async_recipe_learns(tmp_path):
    """recipes/tiny-grpo-async.yaml as shipped: the mean reward of the last 5 steps is above the first 5 steps',
    every window after the first two sampled one version behind the trainer."""
    run = run_script(tmp_path / "tiny-grpo-async", "--config", str(REPO / "recipes" / "tiny-grpo-async.yaml"),
                     "--logging_steps", "1")
    rewards = [m["reward"] for m in run.train_rows()]
    assert len(rewards) == 20 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    assert [m["sample/staleness_max"] for m in run.train_rows()] == [0] + [1] * 19
    rows = rows_of(run)
    assert [r["policy_version"] for r in rows[::16]] == [0, 0, *range(1, 19)]
    assert all(len(r["behaviour_logps"]) == len(r["completion_ids"]) for r in rows)
    # hftrain report's staleness histogram counts what rollouts.jsonl says: trained at step s by version s - 1
    behind = [r["step"] - 1 - r["policy_version"] for r in rows[::16]]
    said = write_report(run.output_dir).read_text()
    assert (f"logged windows by staleness (weight syncs behind the trainer) 0: {behind.count(0)}, 1: "
            f"{behind.count(1)};") in said and (run.output_dir / REPORT_DIR / "async.png").exists()
