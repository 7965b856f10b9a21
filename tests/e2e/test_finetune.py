"""End-to-end runs of the real entry script through `accelerate launch` on the tiny model."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, launch

pytestmark = pytest.mark.launch

DEFAULT = ["--config", str(REPO / "recipes" / "tiny-chat.yaml")]
TRAIN_KEYS = {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens",
              "samples_per_second", "peak_memory_mb"}


def final_params(run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def test_default_recipe_single_process(tmp_path):
    run = launch(tmp_path / "out", *DEFAULT, "--max_steps", "30", "--logging_steps", "5", "--eval_steps", "15",
                 "--save_steps", "10", "--save_total_limit", "2")
    launch_info = run.state()["launch"]
    assert (launch_info["distributed_type"], launch_info["num_processes"]) == ("NO", 1)
    assert launch_info["model_wrapper"] == "CausalLMTokenLoss"

    rows = run.train_rows()
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    assert all(TRAIN_KEYS <= set(r) for r in rows)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], "loss did not fall"
    # trained_tokens is cumulative and grows; throughput is positive
    assert all(b["trained_tokens"] > a["trained_tokens"] for a, b in zip(rows, rows[1:]))
    assert all(r["tokens_per_second"] > 0 and r["grad_norm"] > 0 for r in rows)
    evals = run.eval_rows()
    assert [r["step"] for r in evals] == [15, 30]
    assert all("loss" not in r and abs(r["eval_perplexity"] - torch.tensor(r["eval_loss"]).exp()) < 1e-3
               for r in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]

    # save_total_limit=2 keeps the two newest; each checkpoint records its run
    names = sorted(p.name for p in run.output_dir.glob("checkpoint-*"))
    assert names == ["checkpoint-20", "checkpoint-30"]
    for name, step in (("checkpoint-20", 20), ("checkpoint-30", 30)):
        state = run.state(name)
        assert state["progress"]["step"] == step and state["versions"]["torch"] == torch.__version__
        assert (run.output_dir / name / "hftrain_config.yaml").exists()
        assert (run.output_dir / name / "model.safetensors").exists()
        assert (run.output_dir / name / "optimizer.bin").exists()
    assert not list(run.output_dir.glob(".tmp-*"))

    # the final model loads with the standard tools and differs from the starting weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run.output_dir / "final")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    start = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    assert not torch.equal(model.model.embed_tokens.weight, start.model.embed_tokens.weight)


def test_two_process_ddp_matches_one_process(tmp_path):
    """2 ranks x 8 examples equals 1 rank x 8 x 2 accumulation: same losses, schedule and weights."""
    common = [*DEFAULT, "--max_steps", "8", "--logging_steps", "1", "--lr_scheduler_type", "cosine",
              "--warmup_steps", "3", "--validation_split_percentage", "0", "--save_steps", "4"]
    one = launch(tmp_path / "one", *common, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2")
    two = launch(tmp_path / "two", *common, "--per_device_train_batch_size", "8", preset="cpu_ddp")

    info = two.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["backend"]) == ("MULTI_CPU", 2, "gloo")
    assert info["model_wrapper"] == "DistributedDataParallel"
    assert two.state()["effective_batch_size"] == one.state()["effective_batch_size"] == 16

    rows_one, rows_two = one.train_rows(), two.train_rows()
    # the schedule is defined in optimizer steps, not in per-process scheduler calls
    assert [r["learning_rate"] for r in rows_two] == [r["learning_rate"] for r in rows_one]
    assert [r["trained_tokens"] for r in rows_two] == [r["trained_tokens"] for r in rows_one]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows_two]),
                               torch.tensor([r["loss"] for r in rows_one]), rtol=1e-5, atol=1e-6)
    p1, p2 = final_params(one), final_params(two)
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-4, atol=1e-6)
    # a 2-process checkpoint is complete (one RNG state per rank)
    assert sorted(p.name for p in (two.output_dir / "checkpoint-4").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]


def test_resume_mid_epoch_reproduces_uninterrupted_run(tmp_path):
    # 64 examples / 8 per step = 8 steps per epoch; resuming at step 10 starts mid-way through epoch 2
    common = [*DEFAULT, "--max_samples", "64", "--validation_split_percentage", "0", "--max_steps", "14",
              "--per_device_train_batch_size", "8", "--logging_steps", "1", "--save_steps", "5",
              "--train_sampling_strategy", "random", "--lr_scheduler_type", "cosine"]
    full = launch(tmp_path / "full", *common)
    assert full.state("checkpoint-10")["progress"] == {"step": 10, "epoch": 1, "step_in_epoch": 2,
                                                       "trained_tokens": sum(r["trained_tokens"] for r in
                                                                             full.train_rows()[9:10]),
                                                       "world_size": 1, "nan_skipped_steps": 0}
    # resume into the same folder, as a preempted job would, after dropping what came after step 10
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "final")
    resumed = launch(resumed_dir, *common, "--resume_from_checkpoint", "latest",
                     "--save_steps", "100")  # latest = checkpoint-10
    assert "resuming from" in resumed.stdout and "at step 10" in resumed.stdout

    rows_full, rows_resumed = full.train_rows(), resumed.train_rows()
    assert [r["step"] for r in rows_resumed] == list(range(1, 15))  # rows after the checkpoint were replaced
    for a, b in zip(rows_full[10:], rows_resumed[10:]):
        assert a["learning_rate"] == b["learning_rate"] and a["trained_tokens"] == b["trained_tokens"]
        assert abs(a["loss"] - b["loss"]) < 1e-6
    p_full, p_resumed = final_params(full), final_params(resumed)
    for name in p_full:
        torch.testing.assert_close(p_resumed[name], p_full[name], rtol=0, atol=1e-7)


def test_text_data_bf16_with_python_m(tmp_path):
    """`python -m hftrain.finetune` works without the launcher; bf16 autocast is really on."""
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hftrain.finetune", "--dataset_name", str(REPO / "data" / "text.jsonl"),
         "--output_dir", str(out), "--max_steps", "12", "--learning_rate", "3e-3", "--bf16", "--logging_steps", "4",
         "--max_length", "128", "--per_device_train_batch_size", "8"],
        capture_output=True, text=True, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tests.conftest import Run

    run = Run(0, proc.stdout, proc.stderr, out)
    assert run.state()["launch"]["mixed_precision"] == "bf16"
    assert run.state()["data"]["sources"][0]["format"] == "text"
    rows = run.train_rows()
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("args, expected", [
    (["--learning_rate", "abc", "--bogus", "1", "--bf16", "--fp16"],
     ["learning_rate: expected a number", "unknown argument '--bogus'", "bf16 and fp16 are both true"]),
    (["--dataset_name", "data/missing.jsonl"], ["dataset_name 'data/missing.jsonl' does not exist"]),
    (["--fp16"], ["fp16 needs a CUDA GPU"]),
])
def test_bad_input_fails_fast_with_one_paragraph(tmp_path, args, expected):
    out = tmp_path / "out"
    run = launch(out, *DEFAULT, *args, check=False)
    assert run.returncode != 0
    lines = run.stderr[run.stderr.index("hftrain: error:"):].splitlines()
    paragraph = []
    for line in lines:  # the paragraph ends where the launcher's own report starts
        if not line.strip() or line.startswith(("Traceback", "subprocess.")):
            break
        paragraph.append(line)
    message = " ".join(paragraph)
    assert len(message) < 1000
    for text in expected:
        assert text in message
    assert "Traceback" not in run.stderr[: run.stderr.index("hftrain: error:")]
    assert not out.exists(), "nothing may be written for a refused recipe"


def test_refuses_to_overwrite_a_previous_run(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    run = launch(out, *DEFAULT, "--max_steps", "2", check=False)
    assert run.returncode != 0 and "already holds a run" in run.stderr  # the launcher turns exit 2 into 1
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5"]
