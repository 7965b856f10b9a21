"""The core runs that every supported version of the stack must train alike: full fine-tuning, LoRA, DPO, GRPO and a
two-process DDP launch, each a few steps of the tiny model through the real entry script.

In any environment each run is checked against a value computed independently of hftrain's training (the DPO loss at
policy = reference is log 2; LoRA starts from the unchanged model, so its first loss is full fine-tuning's; two DDP
processes of 2 rows give the losses of one process of 4). `make test-lower` runs this file at the lower end of
pyproject.toml's ranges (constraints/lower.txt) with HFTRAIN_COMPARE_PYTHON naming the interpreter of the locked
environment (.venv): the same runs there must log the same losses, step by step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENTRY, PRESETS, REPO, Run, launch_env

pytestmark = pytest.mark.launch
TINY = str(REPO / "models" / "tiny-llama")
COMMON = ["--model_name_or_path", TINY, "--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no",
          "--save_strategy", "no", "--report_to", "none", "--train_sampling_strategy", "sequential",
          "--validation_split_percentage", "0", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
          "--gradient_accumulation_steps", "1", "--seed", "3"]
CHAT = [*COMMON, "--dataset_name", str(REPO / "data" / "chat.jsonl"), "--assistant_only_loss", "--max_length", "256",
        "--learning_rate", "3e-3"]
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2"]
RUNS: dict[str, tuple[list[str], int]] = {  # name -> (arguments, processes)
    "full": ([*CHAT, "--per_device_train_batch_size", "4"], 1),
    "lora": ([*CHAT, "--per_device_train_batch_size", "4", *LORA], 1),
    "ddp": ([*CHAT, "--per_device_train_batch_size", "2"], 2),
    "dpo": ([*COMMON, "--dataset_name", str(REPO / "data" / "preference.jsonl"), "--objective", "dpo", "--beta", "0.1",
             "--max_length", "128", "--learning_rate", "1e-3", "--per_device_train_batch_size", "4"], 1),
    # SGD: the update is proportional to the gradient (AdamW's first step would magnify rounding in ~0 gradients)
    "grpo": ([*COMMON, "--dataset_name", str(REPO / "data" / "prompt_completion.jsonl"), "--objective", "grpo",
              "--reward_funcs", "hftrain.rl.example_rewards.vowel_share", "--num_generations", "4",
              "--max_completion_length", "6", "--per_device_train_batch_size", "8", "--optim", "sgd",
              "--learning_rate", "1.0", "--max_grad_norm", "1.0"], 1),
}
COMPARED = ("loss", "grad_norm", "rewards/margins", "reward")


def run_all(python: str, folder: Path) -> dict[str, Run]:
    """Every run of RUNS under `python` (its environment's hftrain and libraries), two at a time."""
    procs = {}
    for name, (args, processes) in RUNS.items():
        out = folder / name
        if processes == 1:
            cmd = [python, str(ENTRY)]
        else:
            cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(PRESETS / "cpu_ddp.yaml"),
                   "--num_processes", str(processes), "--main_process_port", "0", str(ENTRY)]
        procs[name] = (out, subprocess.Popen([*cmd, "--output_dir", str(out), *args], stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=REPO))
    runs = {}
    for name, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} under {python} failed:\n{stderr[-4000:]}"
        runs[name] = Run(proc.returncode, stdout, stderr, out)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    return run_all(sys.executable, tmp_path_factory.mktemp("core"))


def test_full_and_lora_learn_and_lora_starts_from_the_base_model(runs):
    full, lora = runs["full"].train_rows(), runs["lora"].train_rows()
    assert len(full) == len(lora) == 4
    assert all(math.isfinite(r["loss"]) for r in full + lora)
    assert full[-1]["loss"] < full[0]["loss"] and lora[-1]["loss"] < lora[0]["loss"]
    # LoRA's B starts at zero: its first forward is the base model's, on the same rows
    assert lora[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6)
    assert (runs["lora"].output_dir / "final" / "adapter_model.safetensors").exists()


def test_two_ddp_processes_equal_one(runs):
    one, two = runs["full"].train_rows(), runs["ddp"].train_rows()
    assert runs["ddp"].state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)


def test_dpo_starts_at_log_2_and_grpo_trains(runs):
    dpo = runs["dpo"].train_rows()
    assert dpo[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert dpo[0]["rewards/margins"] == 0
    assert all(abs(r["loss"] - math.log(2)) > 1e-5 for r in dpo[1:])  # the policy moved away from the reference
    grpo = runs["grpo"].train_rows()
    assert len(grpo) == 4 and all(math.isfinite(r["loss"]) for r in grpo)
    rollouts = [json.loads(line) for line in (runs["grpo"].output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 8 and all("completion" in r for r in rollouts)


@pytest.mark.skipif("HFTRAIN_COMPARE_PYTHON" not in os.environ,
                    reason="HFTRAIN_COMPARE_PYTHON (another environment's python) is not set: `make test-lower` sets "
                           "it to the locked .venv's")
def test_the_same_runs_log_the_same_values_in_the_compared_environment(runs, tmp_path_factory):
    other = run_all(os.environ["HFTRAIN_COMPARE_PYTHON"], tmp_path_factory.mktemp("compared"))
    for name, run in runs.items():
        here, there = run.train_rows(), other[name].train_rows()
        assert len(here) == len(there), name
        for a, b in zip(here, there):
            for key in COMPARED:
                if key in a or key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
