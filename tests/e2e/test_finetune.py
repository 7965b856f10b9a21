"""End-to-end runs of the real entry script through `accelerate launch` on the tiny model.

Two processes against one with the same global batch: test_parallelism.py (DDP and every other preset).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, TINY_CHAT, launch, run_script
from tests.model_cards import check_card

pytestmark = pytest.mark.launch

TRAIN_KEYS = {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens",
              "samples_per_second", "peak_memory_mb"}


def final_params(run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def test_default_recipe_single_process(tmp_path):
    run = launch(tmp_path / "out", *TINY_CHAT, "--max_steps", "30", "--logging_steps", "5", "--eval_steps", "15",
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
    # its model card: the hub's parser reads it, the losses are the logged ones, the quick start runs
    check_card(run.output_dir / "final", library="transformers", base_model=REPO / "models" / "tiny-llama",
               tags={"sft", "full"}, rows=run.metrics(), run_quick_start=True)
    # the last line says how to talk to the model and make the report (issue 49)
    last = [line for line in run.stdout.splitlines() if line.startswith("hftrain: ")][-1]
    assert last == (f"hftrain: next: hftrain chat {run.output_dir / 'final'} to talk to the model; hftrain report "
                    f"{run.output_dir} for plots and a summary of the run")


def test_resume_mid_epoch_reproduces_uninterrupted_run(tmp_path):
    # 64 examples / 8 per step = 8 steps per epoch; resuming at step 10 starts mid-way through epoch 2
    common = [*TINY_CHAT, "--max_samples", "64", "--validation_split_percentage", "0", "--max_steps", "14",
              "--per_device_train_batch_size", "8", "--logging_steps", "1", "--save_steps", "5",
              "--train_sampling_strategy", "random", "--lr_scheduler_type", "cosine"]
    full = run_script(tmp_path / "full", *common)  # without the launcher: it is the reference, not the property
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
    run = launch(out, *TINY_CHAT, *args, check=False)
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
    run = launch(out, *TINY_CHAT, "--max_steps", "2", check=False)
    assert run.returncode != 0 and "already holds a run" in run.stderr  # the launcher turns exit 2 into 1
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5"]


def test_epoch_strategies_from_a_trl_recipe(tmp_path):
    """eval_strategy / save_strategy epoch (TrainingArguments' names): an evaluation and a checkpoint after every
    epoch, the final evaluation not repeated."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("eval_strategy: epoch\nsave_strategy: epoch\nnum_train_epochs: 2\nmax_samples: 16\n"
                      "per_device_train_batch_size: 4\nlogging_steps: 1\ndata_seed: 5\n")
    run = run_script(tmp_path / "out", "--config", str(recipe))
    assert [r["step"] for r in run.eval_rows()] == [4, 8]
    assert sorted(p.name for p in run.output_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]


def test_scale_lr_follows_the_effective_batch_and_a_resume_with_another_batch(tmp_path):
    """scale_lr sqrt: 4 examples per step for a learning rate tuned at 16 runs at half of it (printed, recorded,
    logged); resumed at step 2 with 2 x 8 accumulation, the schedule continues at its step with the peak for 16."""
    common = [*TINY_CHAT, "--learning_rate", "1e-3", "--scale_lr", "sqrt", "--base_batch_size", "16",
              "--lr_scheduler_type", "linear", "--warmup_steps", "0", "--max_steps", "4", "--logging_steps", "1",
              "--eval_steps", "100",
              "--save_steps", "2", "--disable_tqdm"]
    out = tmp_path / "out"
    first = run_script(out, *common, "--per_device_train_batch_size", "4")
    assert "learning rate 0.0005 = 0.001 x 0.5 (scale_lr sqrt: effective batch 4 for base_batch_size 16)" in \
        " ".join(first.stdout.split())
    assert first.state()["lr_scaling"] == {"rule": "sqrt", "base_batch_size": 16, "effective_batch_size": 4,
                                           "base_learning_rate": 1e-3, "factor": 0.5, "learning_rate": 5e-4}
    # linear decay over 4 steps: step n runs at peak x (4 - n + 1) / 4
    assert [r["learning_rate"] for r in first.train_rows()] == pytest.approx([5e-4 * f for f in (1, .75, .5, .25)])
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-4")
    resumed = run_script(out, *common, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
                         "--resume_from_checkpoint", "latest")
    assert resumed.state()["lr_scaling"]["effective_batch_size"] == 16
    assert [r["learning_rate"] for r in resumed.train_rows() if r["step"] > 2] == pytest.approx([1e-3 * .5,
                                                                                                1e-3 * .25])


def test_hftrain_launch_shows_the_processes_error_without_the_launchers_traceback(tmp_path):
    """`hftrain launch` on 2 processes that fail after they started (resume_from_checkpoint latest with no checkpoint
    is found in setup): each process's one-paragraph error, then one line for torchrun's ChildFailedError traceback
    and summary (which only say that a rank exited with status 2)."""
    proc = subprocess.run([sys.executable, "-m", "hftrain", "launch", "--preset", "cpu_ddp", "--config",
                           str(REPO / "recipes" / "tiny-chat.yaml"), "--resume_from_checkpoint", "latest",
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert "resume_from_checkpoint=latest but" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]  # torchrun names whichever process failed first
    assert re.fullmatch(r"hftrain launch: process [01] exited with status 2 \(its error is above\); the launcher "
                        r"stopped the others", last), last


def bad_data(folder, case: str):
    """A chat file the data phase refuses: a line that is not JSON, a missing messages column, fewer examples than
    one global batch of the recipe (16 per device x 2 processes)."""
    lines = (REPO / "data" / "chat.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    text = {"bad_row": "".join(lines[:40]) + '{"messages": [{"role": "user", "content": "hi"}]\n',
            "no_column": "".join(lines[:40]).replace('"messages"', '"msgs"'),
            "too_few": "".join(lines[:10])}[case]
    path = folder / f"{case}.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("launcher, case, expected", [
    ("hftrain", "bad_row", "bad_row.jsonl, line 41: not JSON"),
    ("accelerate", "no_column", "has columns ['msgs'], which do not match any known format"),
    ("accelerate", "too_few", "the training set has 9 usable examples, fewer than one global batch of 32"),
])
def test_a_data_error_under_ddp_is_the_launchs_only_error(tmp_path, launcher, case, expected):
    """Issue 49: a data error under cpu_ddp, met by rank 0 while rank 1 waits for it (main process first), ended in
    rank 1's gloo traceback ("Connection closed by peer") after hftrain's paragraph in 5 of 6 tries; an error every
    rank meets after the read was printed twice. Now rank 1 learns that rank 0 failed and waits, silent, for the
    launcher to stop it: the paragraph once, no other traceback than the plain launcher's own, process 0 the one
    that failed. torchrun checks its processes every 3 s (not 0.1 s), so rank 1 had time to print on the old code
    before it was stopped: the test does not depend on that race."""
    data, out = bad_data(tmp_path, case), tmp_path / "out"
    if launcher == "hftrain":
        proc = subprocess.run([sys.executable, "-m", "hftrain", "launch", "--preset", "cpu_ddp", "--monitor_interval",
                               "3", *TINY_CHAT, "--dataset_name", str(data), "--output_dir", str(out)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        code, stderr = proc.returncode, proc.stderr
    else:
        run = launch(out, *TINY_CHAT, "--dataset_name", str(data), preset="cpu_ddp", check=False, timeout=300,
                     launch_args=("--main_process_port", "0", "--monitor_interval", "3"))
        code, stderr = run.returncode, run.stderr
    assert code != 0
    assert expected in " ".join(stderr.split()) and stderr.count("hftrain: error:") == 1, stderr[-3000:]
    assert "Connection closed by peer" not in stderr and "gloo" not in stderr.lower(), stderr[-3000:]
    if launcher == "hftrain":
        assert "Traceback" not in stderr, stderr[-3000:]
        assert stderr.rstrip().splitlines()[-1] == ("hftrain launch: process 0 exited with status 2 (its error is "
                                                     "above); the launcher stopped the others")
    else:  # the only traceback is accelerate's launcher's, after the paragraph, saying that a process failed
        assert stderr.count("Traceback") == 1 and "ChildFailedError" in stderr[stderr.index("Traceback"):]
        assert stderr.index("hftrain: error:") < stderr.index("Traceback"), stderr[-3000:]
    assert not out.exists(), "nothing may be written for refused data"


@pytest.mark.parametrize("launcher", ["hftrain", "accelerate"])
def test_a_one_process_launchs_error_shows_once(tmp_path, launcher):
    """Issue 49: accelerate 1.16's one-process launcher keeps the process's standard error and raises it again
    (`CalledProcessError` from `RuntimeError(<the text>)`): every error printed twice. Once under either launcher,
    with the exit status; a plain `accelerate launch` still ends with its own traceback, as under 1.15."""
    data, out = bad_data(tmp_path, "no_column"), tmp_path / "out"
    if launcher == "hftrain":
        proc = subprocess.run([sys.executable, "-m", "hftrain", "launch", "--preset", "cpu", *TINY_CHAT,
                               "--dataset_name", str(data), "--output_dir", str(out)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        code, stderr = proc.returncode, proc.stderr
    else:
        run = launch(out, *TINY_CHAT, "--dataset_name", str(data), preset="cpu", check=False, timeout=300)
        code, stderr = run.returncode, run.stderr
    assert code != 0
    assert stderr.count("which do not match any known format") == 1, stderr[-3000:]
    assert "RuntimeError: " not in stderr, stderr[-3000:]
    if launcher == "hftrain":
        assert "Traceback" not in stderr
        assert stderr.rstrip().splitlines()[-1] == "hftrain launch: the run exited with status 2 (its error is above)"
    else:
        assert "returned non-zero exit status 2" in stderr, stderr[-3000:]


@pytest.mark.parametrize("args, expected", [
    (["--preset", "cpu_ddp", "--learning_rate", "-1"], "learning_rate must be > 0"),  # the recipe
    (["--preset", "fsdp2", "--max_steps", "1"], "asks for FSDP but accelerate would select MULTI_CPU"),  # the machine
])
def test_hftrain_launch_refuses_once_before_starting_the_processes(tmp_path, args, expected):
    """What every process would refuse is refused by `hftrain launch` itself, before it starts them: one paragraph,
    exit status 2, no launcher (the fsdp2 preset on a CPU machine started 8 processes that each printed it)."""
    if "fsdp2" in args and torch.cuda.is_available():
        pytest.skip("FSDP is refused only on a machine without CUDA")
    proc = subprocess.run([sys.executable, "-m", "hftrain", "launch", *args, "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("hftrain: error:") == 1 and expected in " ".join(proc.stderr.split()), proc.stderr
    assert "hftrain launch: process" not in proc.stderr and "torch.distributed" not in proc.stderr  # none started
    assert not (tmp_path / "out").exists()


def test_eval_and_save_strategy_no_on_the_command_line_turn_the_shipped_recipes_cadence_off(tmp_path):
    """tiny-chat.yaml sets eval_steps and save_steps: `--eval_strategy no --save_strategy no` alone runs (it was
    refused until --eval_steps null --save_steps null were added), with no evaluation and no checkpoint."""
    run = run_script(tmp_path / "out", *TINY_CHAT, "--max_steps", "2", "--eval_strategy", "no", "--save_strategy",
                     "no")
    assert not run.eval_rows() and [r["step"] for r in run.train_rows()] == [1, 2]
    assert not list(run.output_dir.glob("checkpoint-*")) and (run.output_dir / "final").is_dir()
    assert "eval_strategy no: eval_steps=30 not used" in run.stdout
    assert "save_strategy no: save_steps=30, save_total_limit=2 not used" in run.stdout
    assert run.state()["data"]["eval_examples"] == 0  # nothing held out


def test_a_one_process_cpu_launch_prints_no_launcher_warning(tmp_path):
    """accelerate's launcher, left to choose the CPU threads of a process (no OMP_NUM_THREADS), prints a warning block
    on every launch to say it chose physical cores / processes; `hftrain launch` passes that same number itself."""
    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    if cores < 2:
        pytest.skip("accelerate warns only when it picks more than one thread per process")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "hftrain", "launch", "--preset", "cpu", *TINY_CHAT, "--output_dir",
           str(tmp_path / "out"), "--max_steps", "2", "--eval_steps", "none", "--save_steps", "none"]
    dry = subprocess.run([*cmd, "--dry_run"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert f" --num_cpu_threads_per_process {cores} " in dry.stdout, dry.stdout
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "num_cpu_threads_per_process" not in proc.stderr and "were not passed to" not in proc.stderr, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
