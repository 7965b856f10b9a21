"""Faults through the real launcher: preemption signals, kill -9 while checkpointing, damaged checkpoints, NaNs.

Each test compares against an uninterrupted run of the same recipe: what survives a fault must be
indistinguishable from never having had it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from hftrain import checkpoint
from tests.conftest import (
    FAULTY_RANK,
    REPO,
    TINY_CHAT,
    Run,
    free_port,
    launch,
    launch_command,
    launch_env,
    run_main_cases,
    run_script,
    write_jsonl,
)

pytestmark = pytest.mark.launch
RECIPE = [*TINY_CHAT, "--max_samples", "160",
          "--validation_split_percentage", "0", "--per_device_train_batch_size", "8", "--logging_steps", "1",
          "--lr_scheduler_type", "cosine", "--train_sampling_strategy", "random", "--eval_steps", "none",
          "--save_total_limit", "none"]


def start(output_dir: Path, *args: str, preset: str = "cpu", **launch_kwargs) -> subprocess.Popen:
    """`launch` without waiting: the test sends signals to the training processes while they run, so they are
    started as users start them (fresh interpreters, the launcher their parent)."""
    return subprocess.Popen(launch_command(output_dir, *args, preset=preset, fresh=True, **launch_kwargs), cwd=REPO,
                            env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def trainers(launcher: subprocess.Popen, expected: int, timeout: float = 120,
             script: str = "finetune.py") -> list[psutil.Process]:
    """The training processes (not the launcher): the ones whose command line runs `script`. A short-lived child of
    the launcher may end (or be a zombie) between the listing and the reading of its command line: not a trainer."""

    def command_line(process: psutil.Process) -> list[str]:
        try:
            return process.cmdline()
        except psutil.NoSuchProcess:  # ZombieProcess included
            return []

    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                 if any(part.endswith(script) for part in command_line(p))]
        if len(found) == expected:
            return found
        time.sleep(0.05)
    raise AssertionError(f"did not find {expected} training processes")


def wait_for_step(output_dir: Path, step: int, launcher: subprocess.Popen, timeout: float = 180) -> None:
    deadline, metrics = time.time() + timeout, output_dir / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached")


def params(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_run(resumed: Run, reference: Run) -> None:
    by_step = {r["step"]: r for r in reference.train_rows()}
    rows = resumed.train_rows()
    assert [r["step"] for r in rows] == sorted(by_step)
    for row in rows:
        assert row["learning_rate"] == by_step[row["step"]]["learning_rate"]
        assert abs(row["loss"] - by_step[row["step"]]["loss"]) < 1e-5, row["step"]
    expected = params(reference.output_dir / "final")
    for name, value in params(resumed.output_dir / "final").items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """The uninterrupted 1-process run, saving synchronously: checkpoints every 10 steps (saving changes no number),
    written inside the loop. Without the launcher: the preemption and kill tests launch their own 1-process runs
    through it."""
    return run_script(tmp_path_factory.mktemp("reference") / "out", *RECIPE, "--max_steps", "30", "--save_steps", "10",
                      "--async_checkpointing", "false")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Run:
    """The reference's recipe with its checkpoints written in the background (async_checkpointing)."""
    return run_script(tmp_path_factory.mktemp("async") / "out", *RECIPE, "--max_steps", "30", "--save_steps", "10",
                      "--async_checkpointing", "true")


@pytest.fixture(scope="module")
def reference_2proc(tmp_path_factory) -> Run:
    return launch(tmp_path_factory.mktemp("reference2") / "out", *RECIPE, "--max_steps", "30",
                  "--per_device_train_batch_size", "4", preset="cpu_ddp")


@pytest.mark.parametrize("processes, signal_to_send", [(1, signal.SIGTERM), (2, signal.SIGUSR1)])
def test_preemption_then_resume_equals_uninterrupted(tmp_path, reference, reference_2proc, processes,
                                                     signal_to_send):
    out = tmp_path / "out"
    # checkpoints every 5 steps, written in the background: the preemption's save waits for the one in flight
    args = [*RECIPE, "--max_steps", "30", "--save_steps", "5", "--async_checkpointing", "true"] + \
        (["--per_device_train_batch_size", "4"] if processes == 2 else [])
    preset = "cpu_ddp" if processes == 2 else "cpu"
    launcher = start(out, *args, preset=preset)
    workers = trainers(launcher, processes)
    wait_for_step(out, 6, launcher)
    workers[-1].send_signal(signal_to_send)  # one rank only: the stop must reach the others
    psutil.wait_procs(workers, timeout=120)  # the training processes, not the launcher, decide when it is over
    launcher.wait(timeout=60)
    stderr = launcher.stderr.read()
    # the main process names the signal, wherever it arrived, in one line; the launcher reports exit code 75
    assert stderr.count(f"stopped by {signal.Signals(signal_to_send).name} after step") == 1, stderr[-3000:]
    assert stderr.count("hftrain: stopped by") == 1
    codes = re.findall(r"exit status (-?\d+)|exitcode\s*:\s*(-?\d+)", stderr)
    assert codes and {a or b for a, b in codes} == {"75"}, codes
    saved = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    stopped_at = int(saved[-1].name.split("-")[1])
    assert 6 <= stopped_at < 30 and json.loads((saved[-1] / "hftrain_state.json").read_text())[
        "progress"]["step"] == stopped_at
    assert not (out / "final").exists()

    resumed = launch(out, *args, "--resume_from_checkpoint", "latest", preset=preset)
    assert f"at step {stopped_at}" in resumed.stdout
    assert_same_run(resumed, reference if processes == 1 else reference_2proc)


@pytest.mark.parametrize("processes", [1, 2])
def test_ctrl_c_under_hftrain_launch_is_one_line_naming_the_checkpoint_and_the_command_that_resumes(
        tmp_path, reference, processes):
    """Ctrl-C at a terminal: SIGINT to the foreground process group, here the group of `hftrain launch` (started in a
    session of its own, as a shell starts a job). One line on its own line names the checkpoint and the resume
    command; no traceback from accelerate's launcher or torchrun's agent; exit status 75. The printed command, run as
    printed, continues the one-process run to the uninterrupted run's numbers."""
    out = tmp_path / "out"
    args = [*RECIPE, "--max_steps", "30"] + (["--per_device_train_batch_size", "4"] if processes == 2 else [])
    cmd = [sys.executable, "-m", "hftrain", "launch", "--preset", "cpu_ddp" if processes == 2 else "cpu",
           "--main_process_port", "0", "--output_dir", str(out), *args]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    wait_for_step(out, 3, launcher)
    os.killpg(launcher.pid, signal.SIGINT)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr and "exitcode" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.split("\n") if "stopped by" in line]
    found = re.fullmatch(r"hftrain: stopped by SIGINT after step (\d+); state saved in (\S+); resume with: (.+)", line)
    assert found, stderr[-3000:]
    step, saved, command = int(found[1]), Path(found[2]), shlex.split(found[3])
    assert saved == out / f"checkpoint-{step}" and saved.is_dir() and not (out / "final").exists()
    assert command == [sys.executable, "-m", "hftrain", *cmd[3:], "--resume_from_checkpoint", str(saved)]
    if processes == 1:
        resumed = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stderr[-3000:]
        assert_same_run(Run(0, resumed.stdout, resumed.stderr, out), reference)


def test_preempted_dpo_with_precomputed_reference_resumes_exactly(tmp_path):
    """dpo with precompute_ref_log_probs: the checkpoint written at SIGTERM carries the reference log-probs, the
    resumed run reads them from it (not from a recomputation with the trained model) and its steps, rewards and
    final weights equal an uninterrupted run's."""
    steps = 24
    args = ["--config", str(REPO / "recipes" / "tiny-dpo.yaml"), "--max_steps", str(steps), "--logging_steps", "1",
            "--save_steps", "100", "--validation_split_percentage", "0", "--train_sampling_strategy", "random",
            "--precompute_ref_log_probs", "true"]
    env = {"HF_HOME": str(tmp_path / "hf")}  # this test's own reference cache
    uninterrupted = run_script(tmp_path / "whole", *args, env=env)
    out = tmp_path / "out"
    launcher = subprocess.Popen(launch_command(out, *args, fresh=True), cwd=REPO, env=launch_env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (worker,) = trainers(launcher, 1)
    wait_for_step(out, 3, launcher)
    worker.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)
    assert "stopped by SIGTERM after step" in launcher.stderr.read()
    (saved,) = out.glob("checkpoint-*")
    stopped_at = int(saved.name.split("-")[1])
    assert 3 <= stopped_at < steps and (saved / "reference_log_probs.safetensors").exists()
    resumed = run_script(out, *args, "--resume_from_checkpoint", "latest", env=env)
    assert f"saved in {saved}" in " ".join(resumed.stdout.split())
    expected = {r["step"]: r for r in uninterrupted.train_rows()}
    rows = resumed.train_rows()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows[stopped_at:]:
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-5, abs=1e-7), (row["step"], key)
    weights = params(uninterrupted.output_dir / "final")
    for name, value in params(out / "final").items():
        torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-7)


def test_kill_9_at_any_moment_of_constant_checkpointing_leaves_a_resumable_run(tmp_path, reference):
    """With a checkpoint after every step, most of the time is spent writing one: SIGKILL lands mid-write. The first
    run writes them in the background (async_checkpointing) and is killed once a `.tmp-checkpoint-N` holds its run
    files, which the loop writes after staging, i.e. while the background thread writes the weights; the second,
    resumed from it, saves synchronously. The synchronous reference decides."""
    out = tmp_path / "out"
    args = [*RECIPE, "--max_steps", "30", "--save_steps", "1"]
    for kill_after, more in ((4, []), (9, ["--resume_from_checkpoint", "latest", "--async_checkpointing", "false"])):
        launcher = start(out, *args, *(more or ["--async_checkpointing", "true"]))
        (worker,) = trainers(launcher, 1)
        wait_for_step(out, kill_after, launcher)
        while not more and not list(out.glob(".tmp-checkpoint-*/hftrain_state.json")) and launcher.poll() is None:
            time.sleep(0.001)
        worker.kill()
        worker.wait(timeout=30)
        launcher.wait(timeout=60)
        for unfinished in out.glob(".tmp-checkpoint-*"):  # `latest` never points at a checkpoint being written
            assert not (out / unfinished.name.removeprefix(".tmp-")).exists()
    assert not (out / "final").exists()
    resumed = launch(out, *args, "--resume_from_checkpoint", "latest")
    assert_same_run(resumed, reference)


def test_async_checkpoints_are_those_of_synchronous_saves_and_change_no_number(async_run, reference):
    """Saving in the background changes no loss or weight, and each checkpoint holds byte for byte the files the
    synchronous reference wrote inside its loop (weights, optimizer, RNG state); the damage test below resumes from
    one of them."""
    assert async_run.state()["async_checkpointing"] is True and reference.state()["async_checkpointing"] is False
    assert [r["loss"] for r in async_run.train_rows()] == [r["loss"] for r in reference.train_rows()]
    for step in (10, 20, 30):
        ours, theirs = (run.output_dir / f"checkpoint-{step}" for run in (async_run, reference))
        assert checkpoint.verify(ours) == []
        files = sorted(p.name for p in theirs.iterdir() if p.suffix in (".safetensors", ".bin", ".pkl"))
        assert files == sorted(p.name for p in ours.iterdir() if p.suffix in (".safetensors", ".bin", ".pkl"))
        for name in files:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (step, name)
    assert not list(async_run.output_dir.glob(".tmp-*"))
    assert (async_run.output_dir / "final" / "model.safetensors").read_bytes() == \
        (reference.output_dir / "final" / "model.safetensors").read_bytes()


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, async_run, reference):
    out = tmp_path / "out"
    args = [*RECIPE, "--max_steps", "30", "--save_steps", "10"]  # the async run's own recipe
    shutil.copytree(async_run.output_dir, out)  # the run, as if it had stopped after writing checkpoint-20
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-30")
    model_file = out / "checkpoint-20" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated, as by a full disk
    resumed = launch(out, *args, "--resume_from_checkpoint", "latest")
    assert "skipping damaged checkpoint" in resumed.stderr and "at step 10" in resumed.stdout
    assert_same_run(resumed, reference)


def test_a_failing_final_save_keeps_the_trained_state_and_a_resume_saves_it(tmp_path, reference):
    out = tmp_path / "out"
    args = [*RECIPE, "--max_steps", "30", "--save_steps", "10"]  # the reference's own recipe
    failed = run_script(out, *args, script=FAULTY_RANK, env={"HFTRAIN_TEST_FAULTS": "final_save", "RANK": "0"},
                        check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    message = " ".join(failed.stderr.split())  # one paragraph, wrapped
    assert "saving the final model" in message and "(injected fault: cannot write the tokenizer)" in message
    assert f"is kept in {out / 'checkpoint-30'}" in message
    assert not (out / "final").exists()  # nothing that looks like a finished model
    assert json.loads((out / "checkpoint-30" / "hftrain_state.json").read_text())["progress"]["step"] == 30

    resumed = run_script(out, *args, "--resume_from_checkpoint", "latest")
    assert "at step 30" in resumed.stdout
    # nothing trained again: metrics.jsonl still has each of the 30 steps once (the failed run's rows)
    assert [row["step"] for row in resumed.train_rows()] == list(range(1, 31))
    expected = params(reference.output_dir / "final")
    for name, value in params(out / "final").items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_an_error_inside_training_keeps_the_last_completed_step_and_a_resume_continues_it(tmp_path, reference):
    """Issue 17 item 6: an unexpected exception after step 1 leaves a rescue checkpoint of the last completed step
    (one process: its parameters are those of step 12, since step 13 failed before its update). Resumed without the
    fault, the run ends where the uninterrupted one does."""
    out = tmp_path / "out"
    args = [*RECIPE, "--max_steps", "30", "--save_steps", "10"]  # the reference's own recipe
    failed = run_script(out, *args, script=FAULTY_RANK, env={"HFTRAIN_TEST_FAULTS": "step_error", "RANK": "0"},
                        check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    message = " ".join(failed.stderr.split())
    assert "training step 13 failed (RuntimeError: injected fault: a forward failed)" in message
    assert f"is kept in {out / 'checkpoint-12'}" in message
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12"]
    assert json.loads((out / "checkpoint-12" / "hftrain_state.json").read_text())["progress"]["step"] == 12
    assert not (out / "final").exists()

    resumed = run_script(out, *args, "--resume_from_checkpoint", "latest")
    assert "at step 12" in resumed.stdout
    assert_same_run(resumed, reference)


def test_checkpoint_preflight_round_trips_before_step_1_and_changes_no_number(tmp_path, reference):
    """The reference run saves checkpoints, so it saved and loaded its initial state first: said, cleaned up, and
    the same losses and weights as the same run without the preflight."""
    said = " ".join(reference.stdout.split())
    assert "checkpoint preflight: a " in said and "weights and optimizer state unchanged" in said
    assert not (reference.output_dir / ".tmp-preflight").exists()
    without = run_script(tmp_path / "out", *RECIPE, "--max_steps", "30", "--save_steps", "10",
                         "--checkpoint_preflight", "false")
    assert "checkpoint preflight" not in without.stdout
    assert [r["loss"] for r in without.train_rows()] == [r["loss"] for r in reference.train_rows()]
    expected = params(reference.output_dir / "final")
    for name, value in params(without.output_dir / "final").items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


@pytest.mark.parametrize("fault, said", [
    ("unloadable_checkpoint", "saving or loading a checkpoint of the initial state under"),
    ("no_op_load", "loaded back with other weights or optimizer state than were saved"),
])
def test_a_checkpoint_that_would_not_load_stops_the_run_before_step_1(tmp_path, fault, said):
    out = tmp_path / "out"
    failed = run_script(out, *TINY_CHAT, "--max_samples", "64", "--max_steps", "4", "--save_steps", "2",
                        script=FAULTY_RANK, env={"HFTRAIN_TEST_FAULTS": fault, "RANK": "0"}, check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    message = " ".join(failed.stderr.split())
    assert "checkpoint preflight:" in message and said in message and "Nothing was trained" in message
    assert not list(out.glob("checkpoint-*")) and not (out / ".tmp-preflight").exists() and not (out / "final").exists()
    assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()


def test_a_failing_final_evaluation_comes_after_the_final_model_is_saved(tmp_path):
    out = tmp_path / "out"
    failed = run_script(out, *TINY_CHAT, "--max_samples", "64", "--max_steps", "2", "--validation_split_percentage",
                        "25", script=FAULTY_RANK, env={"HFTRAIN_TEST_FAULTS": "final_eval", "RANK": "0"},
                        check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    message = " ".join(failed.stderr.split())
    assert "the final evaluation failed (injected fault" in message and f"was saved to {out / 'final'}" in message
    assert json.loads((out / "final" / "hftrain_state.json").read_text())["progress"]["step"] == 2
    assert set(params(out / "final")) == set(params(REPO / "models" / "tiny-llama"))


# ------------------------------------------------------------------------------ numerics
@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, tiny_model):
    """A model whose embedding of <|im_start|> is inf, and text data where 2 of 40 examples contain it."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("poisoned")
    shutil.copytree(tiny_model, folder / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    weights = load_file(folder / "model" / "model.safetensors")
    weights["model.embed_tokens.weight"][tokenizer.convert_tokens_to_ids("<|im_start|>")] = float("inf")
    save_file(weights, folder / "model" / "model.safetensors", metadata={"format": "pt"})
    rows = [{"text": f"What is {i % 10} + 1? {i % 10} + 1 = {i % 10 + 1}."} for i in range(40)]
    for i in (13, 29):  # sequential order, 4 per step: steps 4 and 8
        rows[i]["text"] = "<|im_start|> " + rows[i]["text"]
    return folder / "model", write_jsonl(folder / "data.jsonl", rows)


def nan_args(poisoned) -> list[str]:
    model, data = poisoned
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--validation_split_percentage", "0",
            "--train_sampling_strategy", "sequential", "--per_device_train_batch_size", "4", "--max_steps", "10",
            "--logging_steps", "1", "--learning_rate", "1e-3"]


def test_nan_steps_are_skipped_and_counted(tmp_path, poisoned):
    run = run_script(tmp_path / "out", *nan_args(poisoned), "--nan_policy", "skip_step")
    rows = run.train_rows()
    assert [r["nan_skipped_steps"] for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert rows[3]["loss"] is None and rows[7]["loss"] is None  # a skipped step contributes no loss
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for i, r in enumerate(rows) if i not in (3, 7))
    final = params(run.output_dir / "final")
    assert all(torch.isfinite(v).all() for k, v in final.items() if k != "model.embed_tokens.weight")
    assert run.state()["progress"]["nan_skipped_steps"] == 2


def test_nan_stops_with_a_checkpoint_of_the_last_good_step(tmp_path, poisoned):
    run = run_script(tmp_path / "out", *nan_args(poisoned), check=False)  # nan_policy defaults to stop
    assert run.returncode != 0
    assert "step 4 has a non-finite gradient norm" in run.stderr.replace("\n", " ")
    assert sorted(p.name for p in run.output_dir.glob("checkpoint-*")) == ["checkpoint-3"]
    assert not (run.output_dir / "final").exists()
    state = json.loads((run.output_dir / "checkpoint-3" / "hftrain_state.json").read_text())
    assert state["progress"]["step"] == 3


def test_nan_policy_under_dpo(tmp_path, poisoned):
    """The same policies with objective dpo: pairs 13 and 29 (steps 4 and 8) hold the inf token in their prompt, so
    the policy's and the frozen reference's log-probs of that pair are NaN. skip_step applies no update there and
    logs neither a loss nor rewards for it; stop saves the last good step."""
    model, _ = poisoned
    pairs = [{"prompt": f"What is {i % 10} + 1?", "chosen": f" {i % 10 + 1}.", "rejected": f" {i % 10 + 2}."}
             for i in range(40)]
    for i in (13, 29):
        pairs[i]["prompt"] = "<|im_start|> " + pairs[i]["prompt"]
    args = [*nan_args((model, write_jsonl(tmp_path / "pairs.jsonl", pairs))), "--objective", "dpo"]
    run = run_script(tmp_path / "skip", *args, "--nan_policy", "skip_step")
    rows = run.train_rows()
    assert [r["nan_skipped_steps"] for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    for i, row in enumerate(rows):
        if i in (3, 7):
            assert row["loss"] is None and row.get("rewards/margins") is None, row
        else:
            assert all(math.isfinite(row[k]) for k in ("loss", "rewards/margins", "logps/chosen")), row
    assert rows[-1]["rewards/margins"] != 0  # the policy moved away from the reference on the good steps
    final = params(run.output_dir / "final")
    assert all(torch.isfinite(v).all() for k, v in final.items() if k != "model.embed_tokens.weight")
    stopped = run_script(tmp_path / "stop", *args, check=False)
    assert stopped.returncode != 0 and "step 4 has a non-finite gradient norm" in stopped.stderr.replace("\n", " ")
    assert sorted(p.name for p in stopped.output_dir.glob("checkpoint-*")) == ["checkpoint-3"]


# ---------------------------------------------------------------------------- bad input
def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


BAD_INPUT = {
    "unknown key": (lambda d: ["--config", str(write(d / "r.yaml", "learning_rat: 0.1\n"))],
                    "unknown key 'learning_rat' (did you mean learning_rate?)"),
    "wrong type": (lambda d: ["--max_steps", "ten"], "max_steps: expected an integer, got 'ten'"),
    "unknown flag": (lambda d: ["--lora_rr", "8"], "unknown argument '--lora_rr'"),
    "invalid yaml": (lambda d: ["--config", str(write(d / "r.yaml", "a: [1,\n"))], "is not valid YAML"),
    "recipe not a mapping": (lambda d: ["--config", str(write(d / "r.yaml", "- 1\n"))], "must be a mapping"),
    "missing recipe file": (lambda d: ["--config", str(d / "nope.yaml")], "cannot read recipe file"),
    "bf16 and fp16": (lambda d: ["--bf16", "--fp16"], "bf16 and fp16 are both true"),
    "fp16 on cpu": (lambda d: ["--fp16"], "fp16 needs a CUDA GPU"),
    "sp without deepspeed": (lambda d: ["--sp_size", "2"], "sp_size=2 needs a DeepSpeed preset (cpu_sp on CPU"),
    "cp without fsdp2": (lambda d: ["--cp_size", "2"], "cp_size=2 needs an FSDP2 preset (fsdp2_cp)"),
    "packing image chats": (lambda d: ["--config", str(REPO / "recipes" / "tiny-vlm.yaml"), "--packing", "true"],
                            "packing: true with the image-text model 'llava': rows with images are not packed"),
    "both warmups": (lambda d: ["--warmup_steps", "3", "--warmup_ratio", "0.1"], "both set"),
    "bad choice": (lambda d: ["--lr_scheduler_type", "exp"], "lr_scheduler_type='exp' is not one of"),
    "bad tracker": (lambda d: ["--report_to", "comet"], "unknown tracker(s) ['comet']"),
    "no epochs or steps": (lambda d: ["--num_train_epochs", "0"], "set max_steps > 0 or num_train_epochs > 0"),
    "zero batch": (lambda d: ["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be >= 1"),
    "eval split 100": (lambda d: ["--validation_split_percentage", "100"], "validation_split_percentage must be"),
    "missing model folder": (lambda d: ["--model_name_or_path", "./models/nope"], "is not a folder"),
    "hub id offline": (lambda d: ["--model_name_or_path", "nobody-xyz/not-a-model"],
                       "cannot load model 'nobody-xyz/not-a-model'"),
    "max_length above positions": (lambda d: ["--max_length", "100000"], "above the model's max_position_embeddings"),
    "missing dataset": (lambda d: ["--dataset_name", str(d / "nope.jsonl")], "does not exist"),
    "wrong columns": (lambda d: ["--dataset_name", str(write(d / "d.jsonl", '{"question": "q", "answer": "a"}\n'))],
                      "which do not match any known format"),
    "empty dataset": (lambda d: ["--dataset_name", str(write(d / "d.csv", "text\n"))], "is empty"),
    "wrong role": (lambda d: ["--dataset_name", str(write(d / "d.jsonl", 20 * (json.dumps(
        {"messages": [{"role": "bot", "content": "x"}]}) + "\n")))], "role 'bot'"),
    "non-string content": (lambda d: ["--dataset_name", str(write(d / "d.jsonl", 20 * (json.dumps(
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}) + "\n")))],
        "content of type int"),
    "explicit format mismatch": (lambda d: ["--dataset_format", "alpaca"], "do not match format 'alpaca'"),
    "all masked": (lambda d: ["--max_length", "4", "--validation_split_percentage", "0"], "no trained token"),
    "mixture and dataset_name": (lambda d: ["--dataset_name", "data/text.jsonl", "--dataset_mixture",
                                            "[{name: data/chat.jsonl}]"], "both set"),
    "pairs without rejected": (lambda d: ["--objective", "dpo", "--dataset_name", str(write(d / "p.jsonl", 20 * (
        json.dumps({"prompt": "Q?", "chosen": " A."}) + "\n")))], "preference: chosen, rejected"),
    "pair with an empty completion": (lambda d: ["--objective", "dpo", "--dataset_name", str(write(
        d / "p.jsonl", 20 * (json.dumps({"prompt": "Q?", "chosen": "", "rejected": " B."}) + "\n")))],
        "the chosen completion is empty"),
    "identical pairs": (lambda d: ["--objective", "dpo", "--validation_split_percentage", "0", "--dataset_name",
                                   str(write(d / "p.jsonl", 20 * (json.dumps({"prompt": "Q?", "chosen": " A.",
                                                                              "rejected": " A."}) + "\n")))],
                        "(20) was dropped: 20 with identical chosen and rejected tokens"),
    "prompts longer than max_length": (lambda d: ["--objective", "dpo", "--validation_split_percentage", "0",
                                                  "--max_length", "8", "--dataset_name", str(write(d / "p.jsonl", 20 * (
        json.dumps({"prompt": "Q " * 20, "chosen": " A.", "rejected": " B."}) + "\n")))],
        "0 with identical chosen and rejected tokens, 20 whose prompt fills max_length=8"),
    "resume without checkpoint": (lambda d: ["--resume_from_checkpoint", "latest"], "holds no complete"),
    "resume path missing": (lambda d: ["--resume_from_checkpoint", str(d / "nope")], "is not a checkpoint folder"),
    "precision conflict with preset": (lambda d: [], "precision comes from the recipe"),
}


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> tuple[Path, dict]:
    """A folder holding a previous run, and the modification time of everything in it."""
    out = tmp_path_factory.mktemp("existing") / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 5}\n')
    return out, {p: p.stat().st_mtime_ns for p in out.rglob("*")}


@pytest.fixture(scope="module")
def refused(tmp_path_factory, existing_run) -> dict[str, Run]:
    """Every BAD_INPUT case, plus a run into a folder that already holds one, through `hftrain.finetune.main(argv)`:
    all in one Python process (tests/e2e/main_cases.py) instead of one process each. Launches through
    `accelerate launch` refuse bad input in test_finetune.py; here is every message and the 'nothing written'."""
    root = tmp_path_factory.mktemp("refused")
    cases = {}
    for i, (name, (make_args, _)) in enumerate(sorted(BAD_INPUT.items())):
        folder = root / f"case{i}"
        folder.mkdir()
        env = {"ACCELERATE_MIXED_PRECISION": "bf16"} if name == "precision conflict with preset" else {}
        cases[name] = (["--output_dir", str(folder / "out"), *make_args(folder)], env)
    cases["existing run"] = (["--output_dir", str(existing_run[0]), "--max_steps", "2"], {})
    return run_main_cases(cases, root)


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_refused_before_any_write(refused, case):
    run, expected = refused[case], BAD_INPUT[case][1]
    assert run.returncode == 2, run.stderr[-2000:]
    message = run.stderr[run.stderr.index("hftrain: error:"):]
    assert expected in message.replace("\n", " ")
    assert "Traceback" not in run.stderr
    assert not run.output_dir.exists(), "nothing may be written for refused input"


def test_a_refused_run_leaves_an_existing_output_dir_untouched(refused, existing_run):
    out, before = existing_run
    run = refused["existing run"]
    assert run.returncode == 2 and "already holds a run" in run.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


# ----------------------------------------------------------------------------- collective timeouts
def test_a_rank_stuck_before_step_1_ends_the_run_after_ddp_timeout_naming_rank_and_phase(tmp_path):
    """Rank 0 stalls for 10 minutes before tokenizing: before the first step no hang watchdog is armed (start-up may
    take any time), so rank 1 gives up after ddp_timeout with one readable line instead of hanging or printing a gloo
    traceback."""
    started = time.time()
    run = launch(tmp_path / "out", *RECIPE, "--max_steps", "8", "--per_device_train_batch_size", "4",
                 "--ddp_timeout", "10", preset="cpu_ddp", script=FAULTY_RANK, check=False, timeout=400,
                 env={"HFTRAIN_TEST_FAULTS": "stuck_data", "HFTRAIN_TEST_STALL": "600"})
    assert run.returncode != 0
    message = "rank 1 of 2 timed out after 10s waiting for the other ranks during data preparation"
    assert message in run.stderr.replace("\n", " "), run.stderr[-3000:]
    assert "hftrain: error: rank" in run.stderr  # the rank's own one-paragraph report, not only the launcher's
    assert time.time() - started < 300, "the launch waited for the stalled rank"
    assert not (tmp_path / "out" / "final").exists()


# ------------------------------------------------------------------------------------------------ hangs
HANG_TIMEOUT = 5
HANG_RECIPE = [*RECIPE, "--max_steps", "30", "--save_steps", "2", "--hang_timeout", str(HANG_TIMEOUT)]


def hang_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "hang detected by rank" in line]


def kill_all(processes) -> None:
    """SIGKILL (which a stopped process receives too): nothing a test froze is left behind."""
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)


def newest_checkpoint(out: Path) -> Path:
    return max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def test_a_rank_stalled_in_a_step_is_named_by_itself_and_its_peer(tmp_path):
    """Rank 1 hangs for 10 minutes in its 3rd forward (its process alive, its heartbeat thread beating, its training
    thread stuck); rank 0 waits for it in the step's gradient all-reduce. After hang_timeout the rank that is behind,
    rank 1, is named by the watchdog of each rank that prints before the job ends, with the step it is stuck in."""
    started = time.time()
    run = launch(tmp_path / "out", *HANG_RECIPE, "--per_device_train_batch_size", "4", "--max_steps", "8",
                 preset="cpu_ddp", script=FAULTY_RANK, check=False, timeout=400,
                 env={"HFTRAIN_TEST_FAULTS": "stuck_step", "HFTRAIN_TEST_STALL": "600"})
    assert run.returncode != 0
    lines = hang_lines(run.stderr)
    assert lines, run.stderr[-3000:]
    for line in lines:  # each one line, naming the same culprit whichever rank wrote it
        assert re.search(r"hang detected by rank [01]: rank 1 \(node 0, host \S+\) made no progress for \d+s in "
                         r"training step 3 after token_sync while the other ranks wait for it", line), line
        assert "Last finished step heard from each rank: 0: 2, 1: 2;" in line
        assert f"last complete checkpoint {tmp_path / 'out' / 'checkpoint-2'} " in line
    assert time.time() - started < 120, "the launch waited for the stalled rank"
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a hung GPU kernel needs a CUDA GPU (torch.cuda._sleep)")
def test_a_hung_gpu_kernel_is_named_by_its_own_watchdog(tmp_path):
    """One process whose 3rd forward launches a kernel that spins for minutes: its training thread blocks at the
    step's first synchronisation, its watchdog thread names it after hang_timeout and the process exits 2 (the GPU is
    freed with it), leaving the checkpoint of step 2."""
    started = time.time()
    run = run_script(tmp_path / "out", *HANG_RECIPE, "--max_steps", "10", "--hang_timeout", "10", script=FAULTY_RANK,
                     env={"HFTRAIN_TEST_FAULTS": "hung_kernel", "RANK": "0"}, check=False, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    (line,) = hang_lines(run.stderr)
    assert re.search(r"hang detected by rank 0: rank 0 \(node 0, host \S+\) made no progress for 1\ds in training "
                     r"step 3 after \w+: a hung kernel", line), line
    assert f"last complete checkpoint {tmp_path / 'out' / 'checkpoint-2'} " in line
    assert time.time() - started < 240 and not (tmp_path / "out" / "final").exists()


def test_a_frozen_rank_is_named_within_hang_timeout_a_slow_start_up_and_step_are_not(tmp_path, reference_2proc):
    """One launch, three behaviours: rank 0 sleeps 8 s before preparing the data (start-up longer than hang_timeout)
    and rank 1 sleeps 3 s in step 3 (a slow step shorter than it): neither stops the run. Then rank 1 is frozen
    (SIGSTOP: a hung machine that keeps its sockets open): rank 0 stops within hang_timeout plus a few seconds,
    naming it, and the last complete checkpoint resumes exactly."""
    out = tmp_path / "out"
    args = [*HANG_RECIPE, "--per_device_train_batch_size", "4"]
    env = launch_env({"HFTRAIN_TEST_FAULTS": "stuck_data,slow_step", "HFTRAIN_TEST_STALL": "8",
                      "HFTRAIN_TEST_SLOW": "3"})
    launcher = subprocess.Popen(launch_command(out, *args, preset="cpu_ddp", script=FAULTY_RANK, fresh=True), cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        wait_for_step(out, 6, launcher)
        workers = trainers(launcher, 2, script="faulty_rank.py")
        rank0, rank1 = sorted(workers, key=lambda p: int(p.environ()["RANK"]))
        rank1.suspend()
        frozen_at = time.monotonic()
        rank0.wait(timeout=HANG_TIMEOUT + 60)
        took = time.monotonic() - frozen_at
    finally:
        kill_all(workers or psutil.Process(launcher.pid).children(recursive=True))
    launcher.wait(timeout=60)
    stderr = launcher.stderr.read()
    (line,) = hang_lines(stderr)
    print(line)
    assert took < HANG_TIMEOUT + 10, (took, stderr[-3000:])
    assert re.search(r"exitcode\s*:\s*2", stderr), stderr[-3000:]  # torchrun reports rank 0's exit status
    assert re.search(r"hang detected by rank 0: rank 1 \(node 0, host \S+\) sent no heartbeat for \d+s", line), line
    saved = newest_checkpoint(out)
    assert f"last complete checkpoint {saved} " in line
    rows = Run(0, "", "", out).train_rows()
    assert [r["step"] for r in rows][:6] == [1, 2, 3, 4, 5, 6]  # through the slow start-up and step 3
    for row in rows[2:6]:  # heartbeats seen by rank 0 (from step 3, 3 s after the loop began): well under the limit
        assert row["hang_timeout"] == HANG_TIMEOUT and row["rank0/heartbeat_lag"] == 0
        assert 0 <= row["rank1/heartbeat_lag"] < HANG_TIMEOUT / 2, row

    resumed = launch(out, *args, "--resume_from_checkpoint", "latest", preset="cpu_ddp")
    assert f"at step {saved.name.split('-')[1]}" in resumed.stdout
    assert_same_run(resumed, reference_2proc)


def test_a_frozen_node_stops_the_other_naming_it_and_the_run_resumes_on_one_node(tmp_path, reference):
    """Two launches of multi_node_ddp on 127.0.0.1 (one process each). Node 1 is frozen whole (its launcher and its
    rank: SIGSTOP); node 0 stops within hang_timeout plus a few seconds naming rank 1 on node 1; the last complete
    checkpoint resumes on one node with one process and ends where an uninterrupted one-process run does."""
    out = tmp_path / "out"
    port = free_port()
    nodes, logs = [], []
    for rank in (0, 1):
        node = ("--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port))
        logs.append(open(tmp_path / f"node{rank}.log", "w+"))  # noqa: SIM115 - closed below
        nodes.append(subprocess.Popen(
            launch_command(out, *HANG_RECIPE, "--per_device_train_batch_size", "4", preset="multi_node_ddp",
                           processes=2, launch_args=node, fresh=True),
            stdout=logs[-1], stderr=subprocess.STDOUT, env=launch_env(), cwd=REPO, text=True))
    frozen = []
    try:
        wait_for_step(out, 6, nodes[0])
        launcher1 = psutil.Process(nodes[1].pid)
        frozen = [launcher1, *launcher1.children(recursive=True)]
        for p in frozen:
            p.suspend()
        frozen_at = time.monotonic()
        code = nodes[0].wait(timeout=HANG_TIMEOUT + 60)
        took = time.monotonic() - frozen_at
    finally:
        kill_all(frozen + [psutil.Process(n.pid) for n in nodes if n.poll() is None])
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    (line,) = hang_lines(texts[0])
    print(line)
    assert code != 0 and took < HANG_TIMEOUT + 10, (code, took, texts[0][-3000:])
    assert re.search(r"hang detected by rank 0: rank 1 \(node 1, host \S+\) sent no heartbeat", line), line
    saved = newest_checkpoint(out)
    assert f"last complete checkpoint {saved} " in line and not (out / "final").exists()

    resumed = launch(out, *HANG_RECIPE, "--resume_from_checkpoint", "latest")  # one node, one process x 8
    assert f"at step {saved.name.split('-')[1]}" in resumed.stdout
    expected = {r["step"]: r for r in reference.train_rows()}
    rows = resumed.train_rows()
    assert [r["step"] for r in rows] == sorted(expected)
    for row in rows:
        assert row["learning_rate"] == pytest.approx(expected[row["step"]]["learning_rate"], rel=1e-12)
        assert row["loss"] == pytest.approx(expected[row["step"]]["loss"], rel=1e-5), row["step"]
    weights = params(reference.output_dir / "final")
    for name, value in params(out / "final").items():
        torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-5)  # 2 ranks, then 1


# ----------------------------------------------------------------------------------- safe files
def test_checkpoints_load_weights_only_and_nothing_is_world_writable(tmp_path):
    """Launched with umask 000, the run still creates nothing that other users could write; every file a resume
    reads back is safetensors, JSON, or loads with torch.load(weights_only=True) (no arbitrary unpickling)."""
    from accelerate.utils.other import load  # accelerate's loader: weights_only=True + numpy RNG types

    before = os.umask(0)
    try:
        run = launch(tmp_path / "out", *RECIPE, "--max_steps", "4", "--save_steps", "2",
                     "--report_to", "tensorboard")
    finally:
        os.umask(before)
    created = [run.output_dir, *run.output_dir.rglob("*")]
    assert not [p for p in created if p.stat().st_mode & 0o002], "world-writable files"
    assert any(p.stat().st_mode & 0o020 for p in created), "group permissions follow the umask (not tightened)"

    folder = run.output_dir / "checkpoint-4"
    suffixes = {p.suffix for p in folder.iterdir()}
    assert suffixes <= {".safetensors", ".json", ".yaml", ".bin", ".pkl"}, suffixes
    for path in folder.iterdir():
        if path.suffix in (".bin", ".pkl"):
            load(path, map_location="cpu")  # raises UnpicklingError on anything but tensors and plain values
    assert not list(folder.glob("custom_checkpoint_*"))
    # the schedule's state is JSON: after step 2 it holds the learning rate that step 3 then used
    scheduler = run.state("checkpoint-2")["scheduler"]
    step_3 = next(r for r in run.train_rows() if r["step"] == 3)
    assert scheduler["last_epoch"] == 2  # one learning rate per parameter group (with and without weight decay)
    assert scheduler["_last_lr"] == [pytest.approx(step_3["learning_rate"])] * len(scheduler["base_lrs"])
