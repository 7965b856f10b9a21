"""Parallelism presets run for real on CPU (2 processes, gloo) through `accelerate launch` of hftrain/finetune.py.

Every run is compared with a 1-process reference with the same global batch (16 examples per optimizer
step): the same losses, gradient norms, learning rates, evaluation and final weights within tolerance.
The gradient norms stay above max_grad_norm, so clipping is active: a strategy that clipped at another
value (DeepSpeed's default is 1.0) or scaled gradients differently would drift. Each test asserts what
actually ran (distributed type, process count, model wrapper), because several CPU set-ups silently
fall back to something else (../shared/cpu-feasibility.md), and checks save + resume and the final model.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    FSDP_LAUNCHER,
    REPO,
    TINY_CHAT,
    Run,
    free_port,
    launch,
    launch_command,
    launch_env,
    run_script,
)

pytestmark = pytest.mark.launch

COMMON = [*TINY_CHAT, "--max_steps", "6", "--logging_steps", "1",
          "--save_steps", "3", "--eval_steps", "3", "--lr_scheduler_type", "cosine", "--warmup_steps", "2"]
# SGD makes the update proportional to the clipped gradient: clipping at 0.5 (norms are ~2-3) is visible, and so
# is weight decay on the matrices (lr x weight_decay = 5e-3 of each weight per step, where AdamW's is 3e-5).
SGD = ["--optim", "sgd", "--learning_rate", "0.5", "--sgd_momentum", "0.9", "--max_grad_norm", "0.5",
       "--weight_decay", "0.01"]
# Three layouts of the same global batch of 16 examples
ONE_PROCESS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
TWO_PROCESSES = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
TWO_PROCESSES_ACCUM = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
TP_BATCH = ["--per_device_train_batch_size", "16"]  # tensor parallel: 2 processes, one data-parallel group
def _parameter_count(folder) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


TINY_PARAMS = _parameter_count(REPO / "models" / "tiny-llama")  # counted from the file, not from the recipe


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """1 process, AdamW (the recipe's optimizer), global batch 16. Without the launcher (its weights are bitwise
    those of a launch with the cpu preset, which test_finetune.py launches); the runs compared with it are launched."""
    return run_script(tmp_path_factory.mktemp("ref") / "adamw", *COMMON, *ONE_PROCESS)


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory) -> Run:
    return run_script(tmp_path_factory.mktemp("ref") / "sgd", *COMMON, *SGD, *ONE_PROCESS)


def assert_launch(run: Run, distributed_type: str, processes: int, wrapper: str, **expected) -> dict:
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["model_wrapper"]) == \
        (distributed_type, processes, wrapper)
    if processes > 1:
        assert info["backend"] == "gloo"
    for key, value in expected.items():
        assert info[key] == value, key
    return info


def final_params(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def params_close(params: dict, expected: dict, rtol: float, atol: float) -> None:
    assert params.keys() == expected.keys()
    for name, value in expected.items():  # also checks every shape: no partitioned (empty) tensors saved
        torch.testing.assert_close(params[name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def close(a: list[float], b: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=0)


def assert_same_training(run: Run, ref: Run, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """Same schedule, token counts, losses, gradient norms, evaluations and final weights as `ref`."""
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4, 5, 6]
    assert [r["learning_rate"] for r in rows] == [r["learning_rate"] for r in ref_rows]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in ref_rows]
    for key in ("loss", "grad_norm"):
        close([r[key] for r in rows], [r[key] for r in ref_rows], rtol)
    evals, ref_evals = run.eval_rows(), ref.eval_rows()
    assert [(r["step"], r["eval_tokens"]) for r in evals] == [(r["step"], r["eval_tokens"]) for r in ref_evals]
    close([r["eval_loss"] for r in evals], [r["eval_loss"] for r in ref_evals], rtol)
    params_close(final_params(run), final_params(ref), rtol, atol)
    assert rows[-1]["loss"] < rows[0]["loss"]


def resume_from_step_3(run: Run, name: str, *args: str, runner=launch, **launch_kwargs) -> Run:
    """Continue `run` from its checkpoint-3 in a copy of its folder, as a preempted job would."""
    folder = run.output_dir.parent / name
    shutil.copytree(run.output_dir, folder)
    for later in ("final", "checkpoint-6"):
        shutil.rmtree(folder / later)
    resumed = runner(folder, *COMMON, *args, "--resume_from_checkpoint", "latest", **launch_kwargs)
    assert "resuming from" in resumed.stdout and "at step 3" in resumed.stdout
    return resumed


def assert_continues(resumed: Run, run: Run, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Steps 4-6 after resuming equal the uninterrupted run's (optimizer state, schedule and data position)."""
    rows, ref_rows = resumed.train_rows(), run.train_rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows[3:]] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[3:]]
    close([r["loss"] for r in rows[3:]], [r["loss"] for r in ref_rows[3:]], rtol)
    params_close(final_params(resumed), final_params(run), rtol, atol)


def assert_memory_estimate(run: Run, strategy: str, on_device: float, offloaded: float = 0) -> None:
    """Model-state estimate in units of the parameter count (fp32 weights, AdamW: 16 bytes per parameter)."""
    estimate = run.state()["memory_estimate"]
    assert estimate["strategy"] == strategy
    assert (estimate["per_device_bytes"], estimate["offloaded_bytes"]) == \
        (int(on_device * TINY_PARAMS), int(offloaded * TINY_PARAMS))
    assert f"parallelism {strategy} over 2 processes (gloo): model state" in run.stdout


def ds_config(run: Run, folder: str) -> dict:
    return json.loads((run.output_dir / folder / "ds_config.json").read_text())


# ------------------------------------------------------------------------------------------- DDP
def test_ddp_checkpoint_resumes_on_another_number_of_processes(reference, tmp_path):
    """2 ranks x 8 examples equals 1 rank x 8 x 2 accumulation: same losses, schedule and weights."""
    ddp = launch(tmp_path / "ddp", *COMMON, *TWO_PROCESSES, preset="cpu_ddp")
    assert_launch(ddp, "MULTI_CPU", 2, "DistributedDataParallel", num_machines=1, optimizer="AdamW")
    assert ddp.state()["effective_batch_size"] == reference.state()["effective_batch_size"] == 16
    assert_memory_estimate(ddp, "DDP", 16)  # 4 weights + 4 gradients + 8 Adam moments, all replicated
    assert_same_training(ddp, reference)
    # DDP is tighter than the other strategies: losses within 1e-5, weights within 1e-6 absolute
    close([r["loss"] for r in ddp.train_rows()], [r["loss"] for r in reference.train_rows()], rtol=1e-5)
    params_close(final_params(ddp), final_params(reference), rtol=1e-4, atol=1e-6)
    # a 2-process checkpoint is complete (one RNG state per rank)
    assert sorted(p.name for p in (ddp.output_dir / "checkpoint-3").glob("random_states_*")) == \
        ["random_states_0.pkl", "random_states_1.pkl"]

    # 2 -> 1: rank 0's RNG state is restored; the data position is the same step of the same epoch order
    two_to_one = resume_from_step_3(ddp, "two-to-one", *ONE_PROCESS, runner=run_script)
    assert_launch(two_to_one, "NO", 1, "CausalLMTokenLoss")
    assert two_to_one.state()["progress"]["world_size"] == 1
    assert_continues(two_to_one, ddp, rtol=1e-5, atol=1e-5)  # other reduction order than the 2-process run
    # 1 -> 2: rank 1 finds no saved RNG state and keeps the one from `seed` (data order never uses it)
    assert sorted(p.name for p in (reference.output_dir / "checkpoint-3").glob("random_states_*")) == \
        ["random_states_0.pkl"]
    one_to_two = resume_from_step_3(reference, "one-to-two", *TWO_PROCESSES, preset="cpu_ddp")
    assert_launch(one_to_two, "MULTI_CPU", 2, "DistributedDataParallel")
    assert_continues(one_to_two, reference, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- DeepSpeed
def test_zero2_with_accumulation_matches_one_process_with_the_recipes_clipping(reference_sgd, tmp_path):
    run = launch(tmp_path / "zero2", *COMMON, *SGD, *TWO_PROCESSES_ACCUM, "--async_checkpointing", "true",
                 preset="zero2")
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine", optimizer="SGD")
    # DeepSpeed 0.19.8's background checkpoint engines need libaio: the engine saves in the loop, and says so
    assert run.state()["async_checkpointing"] is False
    assert "checkpoints are saved synchronously: DeepSpeed" in " ".join(run.stdout.split())
    for folder in ("checkpoint-3", "final"):  # the DeepSpeed config used, filled from the recipe
        used = ds_config(run, folder)
        assert (used["train_micro_batch_size_per_gpu"], used["gradient_accumulation_steps"],
                used["train_batch_size"], used["gradient_clipping"]) == (4, 2, 16, 0.5)
        assert used["zero_optimization"]["stage"] == 2 and used["bf16"]["enabled"] is False
    assert all(r["grad_norm"] > 0.5 for r in run.train_rows()), "clipping must be active for this test to bite"
    assert_memory_estimate(run, "DeepSpeed ZeRO-2", 4 + 4 / 2 + 4 / 2)  # SGD momentum: 4 bytes, sharded
    assert_same_training(run, reference_sgd)
    shards = sorted(p.name for p in (run.output_dir / "checkpoint-3" / "pytorch_model").glob("*optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    resumed = resume_from_step_3(run, "zero2-resumed", *SGD, *TWO_PROCESSES_ACCUM, preset="zero2")
    assert_continues(resumed, run)
    # On another process count ZeRO checkpoints go through DeepSpeed's universal format, which holds Adam's state
    # only: SGD's momentum cannot be re-partitioned, refused in one paragraph
    refused = launch(run.output_dir, *COMMON, *SGD, *ONE_PROCESS, "--resume_from_checkpoint", "latest",
                     preset="zero2", processes=1, check=False)
    assert refused.returncode != 0
    message = refused.stderr.replace("\n", " ")
    assert "written by 2 processes and this run has 1" in message and "with optim=sgd, resume with 2" in message


def test_zero2_checkpoint_resumes_on_another_number_of_processes(reference, tmp_path):
    """ZeRO keeps one optimizer partition per rank; on another process count hftrain converts the checkpoint to a
    DeepSpeed universal checkpoint (per-parameter fp32 weights and Adam moments) and loads that. Steps 4-6 then
    equal the uninterrupted run: weights, moments, schedule and data position all came through."""
    run = launch(tmp_path / "zero2", *COMMON, *TWO_PROCESSES, preset="zero2")
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine", optimizer="AdamW")
    assert_same_training(run, reference)

    two_to_one = resume_from_step_3(run, "two-to-one", *ONE_PROCESS, preset="zero2", processes=1)
    assert_launch(two_to_one, "DEEPSPEED", 1, "DeepSpeedEngine")
    assert "checkpoint-3 was written by 2 DeepSpeed processes; converting it to a universal checkpoint" in \
        two_to_one.stdout
    assert_continues(two_to_one, run, rtol=1e-5, atol=1e-5)  # other reduction order than the 2-process run
    assert not list(two_to_one.output_dir.glob(".universal-*"))  # the converted copy is removed after loading

    one = launch(tmp_path / "zero2-one", *COMMON, *ONE_PROCESS, preset="zero2", processes=1)
    assert sorted(p.name for p in (one.output_dir / "checkpoint-3" / "pytorch_model").glob("*optim_states.pt")) == \
        ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    one_to_two = resume_from_step_3(one, "one-to-two", *TWO_PROCESSES, preset="zero2")
    assert_launch(one_to_two, "DEEPSPEED", 2, "DeepSpeedEngine")
    assert "written by 1 DeepSpeed processes; converting it to a universal checkpoint" in one_to_two.stdout
    assert_continues(one_to_two, one, rtol=1e-5, atol=1e-5)
    shards = sorted(p.name for p in (one_to_two.output_dir / "checkpoint-6" / "pytorch_model").glob("*optim*"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def assert_quiet_deepspeed_console(run: Run) -> None:
    """Issue 49: a ZeRO-3 run on CPU printed 5,372 lines for the tiny recipe's 60 steps, 2,680 of them torch's
    FutureWarning (two lines each) at every all_gather_into_tensor / reduce_scatter_tensor DeepSpeed calls, and each
    process's "DeepSpeed ... shm_comm_op built successfully". Now about as short as a DDP run's console, hftrain's
    start-up lines and progress all there (what `hftrain launch` adds for the launcher itself, the OMP_NUM_THREADS
    banner and DeepSpeed's accelerator warning: tests/unit/test_cli.py)."""
    console = run.stdout + run.stderr
    assert "FutureWarning" not in console and "is deprecated" not in console, console[-3000:]
    assert "built successfully" not in console, console[-3000:]
    assert len(console.splitlines()) < 40, console
    assert "hftrain: DeepSpeed ZeRO-3 over 2 processes (gloo) on cpu, model wrapped as DeepSpeedEngine" in run.stdout
    assert [line.split(":")[1] for line in run.stderr.splitlines() if line.startswith("training: step ")] == \
        [f" step {step}/6" for step in range(1, 7)], run.stderr


def test_zero3_trains_like_one_process_and_gathers_a_full_final_model(reference, tmp_path):
    run = launch(tmp_path / "zero3", *COMMON, *TWO_PROCESSES, preset="zero3")
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine", optimizer="AdamW")
    assert_quiet_deepspeed_console(run)
    used = ds_config(run, "final")
    assert used["zero_optimization"]["stage"] == 3 and used["gradient_clipping"] == 1.0
    assert used["zero_optimization"]["stage3_param_persistence_threshold"] == 640  # 10 x hidden size 64
    # counted at full size although each rank holds half of every parameter
    assert f"{TINY_PARAMS:,} of {TINY_PARAMS:,} parameters trained" in run.stdout
    assert_memory_estimate(run, "DeepSpeed ZeRO-3", 16 / 2)
    assert_same_training(run, reference)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")  # standard tools, full size
    assert sum(p.numel() for p in model.parameters()) == TINY_PARAMS
    resumed = resume_from_step_3(run, "zero3-resumed", *TWO_PROCESSES, preset="zero3")
    assert_continues(resumed, run)
    # 2 -> 1: the partitioned weights and Adam state go through a universal checkpoint, as under ZeRO-2
    two_to_one = resume_from_step_3(run, "zero3-two-to-one", *ONE_PROCESS, preset="zero3", processes=1)
    assert_launch(two_to_one, "DEEPSPEED", 1, "DeepSpeedEngine")
    assert "written by 2 DeepSpeed processes; converting it to a universal checkpoint" in two_to_one.stdout
    assert_continues(two_to_one, run, rtol=1e-5, atol=1e-5)


def test_zero3_with_sgd_decays_the_matrices_as_one_process(reference_sgd, tmp_path):
    """ZeRO-3 builds the model partitioned (each parameter's .data empty): the matrices must still be found for
    weight decay. They were not, and the run ended 3e-4 from one process; SGD's decay (5e-3 of each weight per step)
    shows it where AdamW's (3e-5) stays under the tolerance. With accumulation, and with the recipe's clipping."""
    run = launch(tmp_path / "zero3-sgd", *COMMON, *SGD, *TWO_PROCESSES_ACCUM, "--save_strategy", "no", preset="zero3")
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine", optimizer="SGD")
    assert_same_training(run, reference_sgd)


def test_zero2_with_cpu_optimizer_offload(reference, tmp_path):
    # The first run compiles DeepSpeed's cpu_adam (~80 s, cached in TORCH_EXTENSIONS_DIR)
    run = launch(tmp_path / "zero2-offload", *COMMON, *TWO_PROCESSES, preset="zero2_offload", timeout=1200)
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine", optimizer="DeepSpeedCPUAdam")
    assert ds_config(run, "final")["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # fp32 weights on each process; its fp32 gradient partition and AdamW's moments of it in CPU memory
    assert_memory_estimate(run, "DeepSpeed ZeRO-2 + offload", 4, offloaded=(4 + 8) / 2)
    assert_same_training(run, reference)  # DeepSpeedCPUAdam with the recipe's betas/eps/decay = torch AdamW
    # loading gives DeepSpeedCPUAdam new param groups: the schedule follows them (it once stayed at the resumed
    # step's learning rate, found by the checkpoint preflight)
    resumed = resume_from_step_3(run, "zero2-offload-resumed", *TWO_PROCESSES, preset="zero2_offload", timeout=1200)
    assert_continues(resumed, run)


# ------------------------------------------------------------------------------------------ FSDP2
@pytest.fixture(scope="module")
def fsdp2_two(tmp_path_factory) -> Run:
    """FSDP2 FULL_SHARD on 2 processes: compared with one process and resumed on 2 processes (below), then on 1."""
    return launch(tmp_path_factory.mktemp("fsdp2") / "fsdp2", *COMMON, *TWO_PROCESSES, preset="fsdp2", processes=2,
                  script=FSDP_LAUNCHER)


@pytest.mark.parametrize("preset", ["fsdp2", "fsdp2_shard_grad_op"])
def test_fsdp2_through_the_test_launcher(reference, request, tmp_path, preset):
    run = request.getfixturevalue("fsdp2_two") if preset == "fsdp2" else \
        launch(tmp_path / preset, *COMMON, *TWO_PROCESSES, preset=preset, processes=2, script=FSDP_LAUNCHER)
    info = assert_launch(run, "FSDP", 2, "FSDPCausalLMTokenLoss", optimizer="AdamW")
    assert info["sharded_modules"] == ["FSDPCausalLMTokenLoss", "FSDPLlamaDecoderLayer"]  # transformer-layer wrap
    if preset == "fsdp2":
        assert_memory_estimate(run, "FSDP2 FULL_SHARD", 16 / 2)
    else:
        assert_memory_estimate(run, "FSDP2 SHARD_GRAD_OP", 4 + 12 / 2)
    checkpoint = run.output_dir / "checkpoint-3"
    assert run.state()["async_checkpointing"] is True  # the sharded folders were written by the background thread
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # sharded: one piece per rank
        assert sorted(p.name for p in (checkpoint / folder).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_training(run, reference)
    if preset == "fsdp2":
        resumed = resume_from_step_3(run, "fsdp2-resumed", *TWO_PROCESSES, preset=preset, processes=2,
                                     script=FSDP_LAUNCHER)
        assert_continues(resumed, run)


def test_fsdp2_checkpoint_resumes_on_another_number_of_processes(reference, fsdp2_two, tmp_path):
    """FSDP2's sharded checkpoints are torch.distributed.checkpoint folders, which reshard on load: a 2-process
    checkpoint (the run above's) resumes on 1 process and a 1-process one on 2, and steps 4-6 equal the uninterrupted
    run."""
    two = fsdp2_two
    two_to_one = resume_from_step_3(two, "two-to-one", *ONE_PROCESS, preset="fsdp2", processes=1,
                                    script=FSDP_LAUNCHER)
    assert two_to_one.state()["progress"]["world_size"] == 1
    assert_continues(two_to_one, two, rtol=1e-5, atol=1e-5)
    one = launch(tmp_path / "one", *COMMON, *ONE_PROCESS, preset="fsdp2", processes=1, script=FSDP_LAUNCHER)
    assert sorted(p.name for p in (one.output_dir / "checkpoint-3" / "pytorch_model_fsdp_0").glob("*.distcp")) == \
        ["__0_0.distcp"]
    one_to_two = resume_from_step_3(one, "one-to-two", *TWO_PROCESSES, preset="fsdp2", processes=2,
                                    script=FSDP_LAUNCHER)
    assert one_to_two.state()["progress"]["world_size"] == 2
    assert_continues(one_to_two, one, rtol=1e-5, atol=1e-5)
    assert_same_training(one, reference)


@pytest.mark.parametrize("preset, env, expected", [
    ("fsdp2", {}, "asks for FSDP but accelerate selected MULTI_CPU"),  # accelerate: FSDP only on GPU-like devices
    ("zero2", {"ACCELERATE_USE_CPU": "1"}, "asks for DEEPSPEED but accelerate selected MULTI_CPU"),
])
def test_a_strategy_accelerate_would_silently_swap_is_refused(tmp_path, preset, env, expected):
    """Through `accelerate launch` (`hftrain launch` refuses before starting the processes: test_finetune.py), and
    printed once: the same refusal in every process is reported by the first only."""
    run = launch(tmp_path / "out", *COMMON, preset=preset, processes=2, env=env, check=False)
    assert run.returncode != 0
    message = run.stderr[run.stderr.index("hftrain: error:"):].replace("\n", " ")
    assert expected in message and run.stderr.count("hftrain: error:") == 1
    assert not (tmp_path / "out").exists()


def test_deepspeed_config_contradicting_the_recipe_is_refused_before_loading(tmp_path):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config.update({"gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    run = launch(tmp_path / "out", *COMMON, preset="zero2", processes=1, check=False,  # one is enough to refuse
                 launch_args=("--main_process_port", "0", "--deepspeed_config_file", str(path)),
                 env={"TRANSFORMERS_VERBOSITY": "info"})  # from_pretrained then logs "loading weights file"
    assert run.returncode != 0
    message = run.stderr[run.stderr.index("hftrain: error:"):].replace("\n", " ")
    assert "2 problems" in message
    assert "gradient_accumulation_steps=4 but the recipe gives 1" in message and "'optimizer' block" in message
    assert "loading weights file" not in run.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- multi-node
def launch_two_nodes(output_dir, *args, preset: str, timeout: int = 600) -> Run:
    """Two launches on 127.0.0.1, machine ranks 0 and 1, one process each: a 2-node job in miniature."""
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        node = ("--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port))
        log = open(output_dir.parent / f"node{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(launch_command(output_dir, *args, preset=preset, processes=2, launch_args=node),
                                      stdout=log, stderr=subprocess.STDOUT, env=launch_env(), cwd=REPO, text=True))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):  # one node failed: the other would wait for it
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert all(p.returncode == 0 for p in procs), "\n\n".join(t[-3000:] for t in texts)
    return Run(0, texts[0], texts[1], output_dir)


@pytest.mark.parametrize("preset, distributed_type, wrapper", [
    ("multi_node_ddp", "MULTI_CPU", "DistributedDataParallel"),
    ("multi_node_zero3", "DEEPSPEED", "DeepSpeedEngine"),
])
def test_two_nodes_simulated_on_localhost(reference, tmp_path, preset, distributed_type, wrapper):
    run = launch_two_nodes(tmp_path / "out", *COMMON, *TWO_PROCESSES, preset=preset)
    assert_launch(run, distributed_type, 2, wrapper, num_machines=2)
    assert_same_training(run, reference)
    for row in run.train_rows():  # per-node throughput; one process per node, so a node's share is its rank's
        nodes = [row[f"node{n}/tokens_per_second"] for n in (0, 1)]
        assert nodes == pytest.approx([row["rank0/tokens_per_second"], row["rank1/tokens_per_second"]])
        assert sum(nodes) == pytest.approx(row["tokens_per_second"])
        assert row["node0/samples_per_second"] + row["node1/samples_per_second"] == \
            pytest.approx(row["samples_per_second"])
    assert sorted(p.name for p in (run.output_dir / "checkpoint-3").glob("random_states_*")) == \
        ["random_states_0.pkl", "random_states_1.pkl"]


# ------------------------------------------------------------------------------- tensor parallel
def test_tensor_parallel_tp_plan_under_two_ranks(reference, tmp_path):
    """Both ranks hold half of every linear layer (DTensor shards) and train on the same batches; its checkpoints
    resume under tp and without it, and one process's under tp."""
    run = launch(tmp_path / "tp", *COMMON, *TP_BATCH, "--tp_size", "2", preset="tp")
    info = assert_launch(run, "MULTI_CPU", 2, "CausalLMTokenLoss", tp_size=2)  # not DDP-wrapped
    assert info["dtensor_parameters"] == 16  # embeddings, lm_head and the 7 linear layers of each of 2 blocks
    assert_memory_estimate(run, "tensor parallel (tp_size=2)", 16 / 2)
    # one data-parallel group: the global batch is 16 examples, and token counts are not doubled
    assert run.state()["effective_batch_size"] == 16
    assert "effective batch 16 = 16 per device x 1 accumulation x 1 data-parallel group" in run.stdout
    assert_same_training(run, reference)
    # checkpoints hold full (gathered) model and optimizer state, not one rank's shards
    full = torch.load(run.output_dir / "checkpoint-3" / "full_training_state.pt", weights_only=True)
    assert full["model"]["lm.model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)

    resumed = resume_from_step_3(run, "tp-resumed", *TP_BATCH, "--tp_size", "2", preset="tp")
    assert_continues(resumed, run)
    # the full state resumes without tp (converted to one process's files), and one process's checkpoint under tp
    # (each rank cuts its blocks of the whole tensors): both continue as the run that wrote the checkpoint
    without_tp = resume_from_step_3(run, "tp-to-one", *ONE_PROCESS, runner=run_script)
    assert_continues(without_tp, run, rtol=1e-5, atol=1e-5)
    into_tp = resume_from_step_3(reference, "one-to-tp", *TP_BATCH, "--tp_size", "2", preset="tp")
    assert_continues(into_tp, reference, rtol=1e-5, atol=1e-5)
    refused = launch(tmp_path / "refused", *COMMON, "--tp_size", "2", preset="cpu", check=False)
    assert refused.returncode != 0
    assert "tp_size=2 needs tp_size (or a multiple of it) processes on a DDP-type preset" in \
        refused.stderr.replace("\n", " ")


def test_tensor_parallel_with_data_parallel_under_four_ranks(reference, tmp_path):
    """tp_size=2 on 4 processes: two data-parallel copies of a model split in two. Ranks {0,1} and {2,3} each shard
    one copy and train on their own half of the global batch; hftrain averages the gradients of ranks {0,2} and
    {1,3}, which hold the same shards. The result equals one process with the same global batch of 16."""
    run = launch(tmp_path / "tp-dp", *COMMON, *TWO_PROCESSES, "--tp_size", "2", preset="cpu_ddp", processes=4,
                 timeout=900)
    assert_launch(run, "MULTI_CPU", 4, "CausalLMTokenLoss", tp_size=2, dtensor_parameters=16)
    assert run.state()["effective_batch_size"] == 16
    assert "effective batch 16 = 8 per device x 1 accumulation x 2 data-parallel groups" in run.stdout
    estimate = run.state()["memory_estimate"]
    assert estimate["strategy"] == "tensor parallel (tp_size=2) x 2 data-parallel copies"
    assert estimate["per_device_bytes"] == 16 * TINY_PARAMS // 2  # split over the 2 ranks of a TP group only
    assert_same_training(run, reference)  # token counts summed over the 2 data-parallel ranks, not the 4 processes
    full = torch.load(run.output_dir / "checkpoint-3" / "full_training_state.pt", weights_only=True)
    assert full["model"]["lm.model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)

    resumed = resume_from_step_3(run, "tp-dp-resumed", *TWO_PROCESSES, "--tp_size", "2", preset="cpu_ddp",
                                 processes=4, timeout=900)
    assert_continues(resumed, run)
    # the checkpoint holds full state: it resumes as well on one TP group of 2 with the same global batch
    one_copy = resume_from_step_3(run, "tp-dp-to-tp", *TP_BATCH, "--tp_size", "2", preset="tp")
    assert_launch(one_copy, "MULTI_CPU", 2, "CausalLMTokenLoss", tp_size=2)
    assert_continues(one_copy, run, rtol=1e-5, atol=1e-5)
    # (tp with a DeepSpeed preset is refused in the preflight: tests/unit/test_preflight.py; a launched refusal of tp
    # is checked above, with the cpu preset)
