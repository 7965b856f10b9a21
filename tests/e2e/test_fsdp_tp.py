"""FSDP2 x tensor parallel (the 2D layout) on 4 CPU processes (gloo): tp_size=2 x fsdp_size=2 equals 1 process, and
its checkpoint continues under tp x cp (tensor parallel x ring attention context parallel) exactly.

An FSDP2 preset with `--tp_size 2` and 4 processes: transformers splits every linear layer over the 2 ranks of a TP
group and FSDP2-shards each half over the 2 ranks that hold it (`DistributedConfig(tp_size=2, fsdp_size=2)`), so
every rank holds a quarter of each weight. The run is compared with one process on the same global batch of 16
(gradient accumulation 2 in both): losses, gradient norms (above max_grad_norm 1.0: clipping is active), learning
rates, token counts, the final evaluation and the final weights. Then its checkpoint-2 resumes under tp_size=2 x
cp_size=2 on the same 4 processes, and steps 3-4 equal the uninterrupted run's and the 1-process run's: the ring
splits each row of the one data-parallel rank's micro-batches over the 2 context ranks of every tp rank (its own
heads' keys and values around the ring), the 2D checkpoint is re-sliced onto the (dp, cp, tp) layout, and FSDP2
shards over the context ranks. Two launches serve every assertion (CI time: the cheapest runs that show each
property: 4 steps, a checkpoint at 2).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FSDP_LAUNCHER, REPO, TINY_CHAT, Run, launch, run_script

pytestmark = pytest.mark.launch

COMMON = [*TINY_CHAT, "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "4"]
ONE_PROCESS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
# 4 processes, 2 data-parallel ranks (the fsdp dimension): 4 examples x 2 ranks x 2 accumulation = 16
FSDP_TP = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--tp_size", "2"]
# 4 processes, 1 data-parallel rank: its 8 rows x 2 accumulation = 16, each row split over the 2 context ranks
TP_CP = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--tp_size", "2", "--cp_size", "2"]
CP_LAUNCHER = REPO / "tests" / "launchers" / "context_parallel_on_cpu.py"  # registers torch's ring for the CPU kernel


def fsdp_tp(output_dir, *args: str) -> Run:
    return launch(output_dir, *COMMON, *FSDP_TP, *args, preset="fsdp2", processes=4, script=FSDP_LAUNCHER,
                  timeout=900)


def close(a: list[float], b: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=0)


def weights_close(run: Run, ref: Run, tol: float) -> None:
    params, expected = (load_file(r.output_dir / "final" / "model.safetensors") for r in (run, ref))
    assert params.keys() == expected.keys()
    for name, value in expected.items():  # full shapes: the final folder holds gathered weights, not shards
        torch.testing.assert_close(params[name], value, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    return run_script(tmp_path_factory.mktemp("one") / "one", *COMMON, *ONE_PROCESS)


@pytest.fixture(scope="module")
def fsdp_tp_run(tmp_path_factory) -> Run:
    return fsdp_tp(tmp_path_factory.mktemp("fsdp-tp") / "fsdp-tp")


def test_fsdp2_x_tensor_parallel_equals_one_process(fsdp_tp_run, reference):
    run, ref = fsdp_tp_run, reference
    # what ran: the 2D layout, not a fallback (plain TP copies, FSDP2 alone, DDP)
    layout = "FSDP2 FULL_SHARD (fsdp_size=2) x tensor parallel (tp_size=2) over 4 processes (gloo)"
    assert f"hftrain: {layout} on cpu:0, model wrapped as FSDPCausalLMTokenLoss" in run.stdout
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["tp_size"]) == ("FSDP", 4, 2)
    # every weight a DTensor: the TP-split ones on the 2-dim (fsdp, tp) mesh, the norms (whole over TP) on fsdp
    assert info["dtensor_parameters"] == 21
    assert info["dtensor_meshes"] == ["fsdp=2", "fsdp=2 x tp=2"]
    assert run.state()["parallelism"]["dp_world"] == 2  # token counts summed over 2 data-parallel ranks, not 4
    assert "effective batch 16 = 4 per device x 2 accumulation x 2 data-parallel groups" in run.stdout

    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
    assert min(r["grad_norm"] for r in ref_rows) > 1.0  # the recipe's max_grad_norm: every step is clipped
    for key in ("loss", "grad_norm"):
        close([r[key] for r in rows], [r[key] for r in ref_rows], 1e-4)
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()], 1e-4)
    weights_close(run, ref, 1e-4)


def test_its_checkpoint_continues_under_tp_x_cp_like_one_process(fsdp_tp_run, reference, tmp_path):
    run, ref = fsdp_tp_run, reference
    folder = tmp_path / "tp-cp"
    shutil.copytree(run.output_dir, folder)
    for later in ("final", "checkpoint-4"):
        shutil.rmtree(folder / later)
    resumed = launch(folder, *COMMON, *TP_CP, "--resume_from_checkpoint", "latest", preset="fsdp2_cp", processes=4,
                     script=CP_LAUNCHER, timeout=900)
    assert "resuming from" in resumed.stdout and "at step 2" in resumed.stdout
    # what ran: tp x cp on hftrain's own (dp, cp, tp) mesh, one data-parallel rank whose rows the ring splits
    layout = ("FSDP2 FULL_SHARD (fsdp_size=2) x tensor parallel (tp_size=2) + ring attention context parallel "
              "(cp_size=2) over 4 processes (gloo)")
    assert f"hftrain: {layout} on cpu:0" in resumed.stdout
    assert "effective batch 16 = 8 per device x 2 accumulation x 1 data-parallel group" in resumed.stdout
    assert "1/2 of each sequence" in resumed.stdout
    state = resumed.state()
    assert (state["launch"]["tp_size"], state["launch"]["cp_size"], state["parallelism"]["dp_world"]) == (2, 2, 1)
    assert state["launch"]["dtensor_meshes"] == ["fsdp=2", "fsdp=2 x tp=2"]  # fsdp: the 2 context ranks

    again, rows, ref_rows = resumed.train_rows(), run.train_rows(), ref.train_rows()
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in again[2:]] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[2:]]
    assert min(r["grad_norm"] for r in ref_rows[2:]) > 1.0  # clipping active in the steps compared
    for key in ("loss", "grad_norm"):
        close([r[key] for r in again[2:]], [r[key] for r in rows[2:]], 1e-5)
        close([r[key] for r in again[2:]], [r[key] for r in ref_rows[2:]], 1e-4)
    close([r["eval_loss"] for r in resumed.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()], 1e-4)
    weights_close(resumed, run, 1e-5)
    weights_close(resumed, ref, 1e-4)


def test_one_process_checkpoint_continues_under_fsdp2_x_tp(reference, tmp_path):
    """The 1-process run's checkpoint-2 (accelerate's whole files) resumed on the 2D mesh: each rank cuts its block of
    every trained weight and AdamW moment (`FullTrainingState.load_whole`), and steps 3-4 equal the run's own."""
    folder = tmp_path / "one-to-fsdp-tp"
    shutil.copytree(reference.output_dir, folder)
    for later in ("final", "checkpoint-4"):
        shutil.rmtree(folder / later)
    resumed = fsdp_tp(folder, "--resume_from_checkpoint", "latest")
    assert "resuming from" in resumed.stdout and "at step 2" in resumed.stdout
    assert resumed.state()["launch"]["dtensor_meshes"] == ["fsdp=2", "fsdp=2 x tp=2"]
    again, ref_rows = resumed.train_rows(), reference.train_rows()
    assert [(r["learning_rate"], r["trained_tokens"]) for r in again[2:]] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[2:]]
    for key in ("loss", "grad_norm"):
        close([r[key] for r in again[2:]], [r[key] for r in ref_rows[2:]], 1e-4)
    weights_close(resumed, reference, 1e-4)
