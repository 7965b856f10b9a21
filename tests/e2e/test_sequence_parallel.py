"""Sequence parallelism (sp_size, DeepSpeed Ulysses) run for real on CPU: gloo processes through the cpu_sp preset.

Every sequence-parallel run is compared with an independent 1-process run (no launcher, no DeepSpeed, no Ulysses)
with the same micro-batches: per-step losses, gradient norms (above max_grad_norm 1.0: clipping active), learning
rates, token counts, evaluations and final weights within 1e-4. Each launch also asserts what ran (DeepSpeed, the
process count, the engine, sp_size and the data-parallel world) from hftrain_state.json.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.conftest import ENTRY, REPO, TINY_CHAT, Run, launch, run_script
from tests.e2e.test_parallelism import close, params_close

pytestmark = pytest.mark.launch

STEPS = ["--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "2"]
CHAT = [*TINY_CHAT, *STEPS]  # assistant-only chat rows, right-padded
PACKED = ["--config", str(REPO / "recipes" / "tiny-chat-packed.yaml"), *STEPS, "--max_grad_norm", "1.0",
          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
LORA = ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.05"]
# one sequence group (2 processes, sp_size 2) and 1 process: the same 2 micro-batches of 8 rows per step
ONE_GROUP = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
# 4 processes = 2 data-parallel copies of a 2-way sequence group, one micro-batch of 8 each: the same 16 rows per step
TWO_GROUPS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
SP2 = ["--sp_size", "2"]


def assert_sequence_parallel(run: Run, processes: int, dp_world: int) -> None:
    state = run.state()
    launch_info, layout = state["launch"], state["parallelism"]
    assert (launch_info["distributed_type"], launch_info["num_processes"], launch_info["model_wrapper"],
            launch_info["backend"], launch_info["sp_size"]) == ("DEEPSPEED", processes, "DeepSpeedEngine", "gloo", 2)
    assert (layout["kind"], layout["sp_size"], layout["dp_world"]) == ("deepspeed", 2, dp_world)
    assert "Ulysses sequence parallel (sp_size=2)" in launch_info["parallelism"]


def assert_same_steps(run: Run, ref: Run, weights: str = "model.safetensors", rtol: float = 1e-4) -> None:
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
    assert all(r["grad_norm"] > 1.0 for r in ref_rows), "clipping (max_grad_norm 1.0) must be active to bite"
    for key in ("loss", "grad_norm"):
        close([r[key] for r in rows], [r[key] for r in ref_rows], rtol)
    assert [r["eval_tokens"] for r in run.eval_rows()] == [r["eval_tokens"] for r in ref.eval_rows()]
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()], rtol)
    params_close(load_file(run.output_dir / "final" / weights), load_file(ref.output_dir / "final" / weights),
                 rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def chat_reference(tmp_path_factory) -> Run:
    return run_script(tmp_path_factory.mktemp("ref") / "chat", *CHAT, *ONE_GROUP)


@pytest.fixture(scope="module")
def chat_sp(tmp_path_factory) -> Run:
    return launch(tmp_path_factory.mktemp("sp") / "chat", *CHAT, *ONE_GROUP, *SP2, preset="cpu_sp")


def test_sp2_equals_one_process_on_assistant_only_chat(chat_sp, chat_reference):
    assert_sequence_parallel(chat_sp, processes=2, dp_world=1)
    assert chat_sp.state()["effective_batch_size"] == chat_reference.state()["effective_batch_size"] == 16
    assert "Ulysses sequence parallel (sp_size=2) over 2 processes (gloo)" in chat_sp.stdout
    assert_same_steps(chat_sp, chat_reference)


def test_sp2_with_lora_and_packed_rows_equals_one_process(tmp_path):
    """Several examples of unequal length per row, kept apart across the slices and the all-to-all; LoRA adapters
    (without dropout: each rank would draw the masks of its own slice) trained on them. One launch for both
    properties: each would break the comparison on its own."""
    ref = run_script(tmp_path / "ref", *PACKED, *LORA)
    run = launch(tmp_path / "sp", *PACKED, *LORA, *SP2, preset="cpu_sp")
    assert_sequence_parallel(run, processes=2, dp_world=1)
    examples, rows = map(int, re.search(r"(\d+) training examples in (\d+) rows", run.stdout).groups())
    assert rows < examples / 3, "packing must put several examples in a row"
    assert_same_steps(run, ref, weights="adapter_model.safetensors")


def test_two_data_parallel_copies_of_a_sequence_group_equal_one_process(chat_reference, tmp_path):
    run = launch(tmp_path / "sp-dp", *CHAT, *TWO_GROUPS, *SP2, preset="cpu_sp", processes=4)
    assert_sequence_parallel(run, processes=4, dp_world=2)
    assert "x 2 data-parallel copies over 4 processes" in run.stdout
    assert run.state()["effective_batch_size"] == 16
    assert_same_steps(run, chat_reference)


def resume_from_step_2(run: Run, folder, *args: str, **launch_kwargs) -> Run:
    shutil.copytree(run.output_dir, folder)
    for later in ("final", "checkpoint-4"):
        shutil.rmtree(folder / later)
    resumed = launch(folder, *CHAT, *args, "--resume_from_checkpoint", "latest", **launch_kwargs)
    assert "resuming from" in resumed.stdout and "at step 2" in resumed.stdout
    return resumed


def assert_continues(resumed: Run, run: Run) -> None:
    rows, ref_rows = resumed.train_rows(), run.train_rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows[2:]] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[2:]]
    close([r["loss"] for r in rows[2:]], [r["loss"] for r in ref_rows[2:]], 1e-5)
    params_close(load_file(resumed.output_dir / "final" / "model.safetensors"),
                 load_file(run.output_dir / "final" / "model.safetensors"), rtol=1e-5, atol=1e-5)


def test_sp2_checkpoint_resumes_with_sp2_and_without_sequence_parallelism(chat_sp, tmp_path):
    """Steps 3-4 after resuming at step 2 equal the uninterrupted run: with sp_size 2 again, and on plain ZeRO-2 over
    the same 2 processes (the checkpoint holds no trace of the sequence split: the same data position, one batch of
    16 rows per step split 8 + 8 over the two data-parallel ranks)."""
    again = resume_from_step_2(chat_sp, tmp_path / "sp2", *ONE_GROUP, *SP2, preset="cpu_sp")
    assert_sequence_parallel(again, processes=2, dp_world=1)
    assert_continues(again, chat_sp)
    plain = resume_from_step_2(chat_sp, tmp_path / "sp1", *TWO_GROUPS, preset="zero2")
    assert plain.state()["launch"]["sp_size"] == 1 and plain.state()["parallelism"]["dp_world"] == 2
    assert_continues(plain, chat_sp)


def signal_one_rank_then_resume(tmp_path, split: list[str], assert_split, **launch_kwargs) -> None:
    """SIGTERM to rank 1 only of a 2-process group that shares its sequences (`split`: the sp or cp flags): its stop
    vote reaches rank 0 through the group's max (the loop's one collective), both save at the same step and exit 75;
    the resumed run equals an uninterrupted 1-process run."""
    from tests.e2e.test_reliability import start, trainers, wait_for_step

    steps = 16  # the signal lands after step 3 and the stop at the next step's end: the rest is the resume's
    args = [*TINY_CHAT, "--max_steps", str(steps), "--logging_steps", "1", "--eval_steps", "none", "--save_steps",
            "none", *ONE_GROUP]
    ref = run_script(tmp_path / "ref", *args)
    out = tmp_path / "split"
    launcher = start(out, *args, *split, **launch_kwargs)
    workers = trainers(launcher, 2, script=Path(launch_kwargs.get("script", ENTRY)).name)
    wait_for_step(out, 3, launcher)
    workers[-1].send_signal(signal.SIGTERM)
    psutil.wait_procs(workers, timeout=120)
    launcher.wait(timeout=60)
    stderr = launcher.stderr.read()
    # the main process names the signal that reached rank 1; the other rank stops in silence
    assert stderr.count("stopped by SIGTERM after step") == 1 and stderr.count("hftrain: stopped by") == 1, \
        stderr[-3000:]
    (saved,) = out.glob("checkpoint-*")
    stopped_at = int(saved.name.split("-")[1])
    assert 3 <= stopped_at < steps and not (out / "final").exists()
    resumed = launch(out, *args, *split, "--resume_from_checkpoint", "latest", **launch_kwargs)
    assert f"at step {stopped_at}" in resumed.stdout
    assert_split(resumed, processes=2, dp_world=1)
    rows, ref_rows = resumed.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(1, steps + 1))
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows], 1e-4)
    params_close(load_file(resumed.output_dir / "final" / "model.safetensors"),
                 load_file(ref.output_dir / "final" / "model.safetensors"), rtol=1e-4, atol=1e-4)


def test_a_signal_to_one_rank_of_a_sequence_group_stops_both_and_the_resume_equals_one_process(tmp_path):
    signal_one_rank_then_resume(tmp_path, SP2, assert_sequence_parallel, preset="cpu_sp")
