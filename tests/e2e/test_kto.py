"""kto through the real entry script: TRL's KTOTrainer gives the same steps, one step is the same whatever its split
into micro-batches and processes (the KL reference point is the step's, not a micro-batch's), precomputed reference
log-probs equal the live reference, a resumed run continues exactly (live or precomputed), the shipped recipe
learns, and data without a label column or with one class is refused before the model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ENTRY, FSDP_LAUNCHER, REPO, launch, launch_env, run_script, write_jsonl
from tests.e2e import objective_checks as checks

pytestmark = pytest.mark.launch
TINY_KTO = ["--config", str(REPO / "recipes" / "tiny-kto.yaml")]
# 3 steps of 8 rows in file order, clipping active, no evaluation; SGD with momentum as tests/e2e/test_orpo.py
EXACT = [*TINY_KTO, "--max_steps", "3", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--sgd_momentum", "0.9", "--learning_rate", "2.0",
         "--max_grad_norm", "0.2", "--warmup_steps", "0", "--save_steps", "2"]
COMPARED = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process x 8 rows per step, a checkpoint at step 2: what the other layouts and the resume are compared with."""
    return run_script(tmp_path_factory.mktemp("kto-one") / "out", *EXACT, "--per_device_train_batch_size", "8")


@pytest.fixture(scope="module")
def ddp_precomputed(tmp_path_factory):
    """2 DDP processes x 2 micro-batches x 2 rows with precompute_ref_log_probs (an empty cross-run cache: the pass
    runs on both processes), a checkpoint at step 2."""
    folder = tmp_path_factory.mktemp("kto-ddp")
    return launch(folder / "out", *EXACT, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                  "--precompute_ref_log_probs", "true", preset="cpu_ddp", env={"HF_HOME": str(folder / "hf")})


def test_equal_to_trl_kto_trainer(tmp_path):
    """scripts/compare_trl_kto.py: TRL 1.16's KTOTrainer and hftrain on the same rows, order and hyperparameters,
    loss_type kto with full fine-tuning (a reference copy) and apo_zero_unpaired with LoRA (adapters disabled):
    per-step loss, kl, rewards and log-probs within 1e-4 (the script's other two variants agree as well)."""
    compared = checks.compare_with_trl(tmp_path, "compare_trl_kto.py", "--variants", "kto full",
                                       "apo_zero_unpaired lora")
    assert sorted(compared) == ["apo_zero_unpaired lora", "kto full"]
    assert any(row["kl"] > 0 for row in compared["kto full"]["trl"])  # the reference point was active
    for name, runs in compared.items():
        assert runs["trl"][-1]["rewards/margins"] != runs["trl"][0]["rewards/margins"]  # both trained
        # every key TRL logs (kl for loss_type kto only)
        checks.assert_steps_match_trl(name, runs["trl"], runs["hftrain"], keys=runs["trl"][0])


def test_kto_step_is_the_same_over_micro_batches_and_processes(tmp_path, one_process, ddp_precomputed):
    """8 rows per step as 1 x 8, 4 micro-batches x 2 and 2 DDP processes x 2 micro-batches x 2: the same KL
    reference point (each row's mismatched completion is its predecessor's in the step, across micro-batches and
    processes), losses, statistics, clipped norms and weights. The DDP run precomputes its reference log-probs (every
    row and the 24 mismatched rows its 3 steps draw) where the others run the frozen copy: the same numbers."""
    rows = one_process.train_rows()
    assert rows[-1]["kl"] > 0 and rows[0]["grad_norm"] > 0.2  # the reference point and clipping were active
    accum = run_script(tmp_path / "accum", *EXACT, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "4")
    assert ddp_precomputed.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    said = " ".join(ddp_precomputed.stdout.split())
    assert "reference: precomputed log-probs of 400 rows and 24 mismatched (KL) rows (one pass" in said
    for run in (accum, ddp_precomputed):
        checks.assert_same_steps(run, one_process, COMPARED)


def test_kto_resumes_exactly(tmp_path, one_process):
    """Resumed from checkpoint-2, step 3 and the final weights equal the uninterrupted run's."""
    checks.assert_resumes_exactly(tmp_path, one_process, [*EXACT, "--per_device_train_batch_size", "8"], COMPARED)


def test_kto_with_precomputed_reference_resumes_exactly(tmp_path, ddp_precomputed):
    """The DDP run's checkpoint-2 resumed by one process x 8 rows (the same global batch, so the same pairs): the
    reference log-probs are read from the checkpoint, not recomputed with the trained model, and step 3 and the final
    weights equal the uninterrupted run's (a resume drawing other pairs is refused: unit/test_kto_objective.py)."""
    resumed = checks.assert_resumes_exactly(tmp_path, ddp_precomputed, [*EXACT, "--precompute_ref_log_probs", "true",
                                                                        "--per_device_train_batch_size", "8"],
                                            COMPARED, weights_atol=1e-6)
    assert f"saved in {tmp_path / 'out' / 'checkpoint-2'}" in " ".join(resumed.stdout.split())


@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_kto_under_sharded_presets_equals_one_process(tmp_path, one_process, preset):
    """2 sharded processes x 4 rows = 1 process x 8 rows, full fine-tuning, the step's KL pass through the strategy's
    wrapper: under ZeRO-3 with the frozen copy partitioned like the policy, under FSDP2 with the reference log-probs
    precomputed by the sharded starting model (its weights resharded after that pass, before the checkpoint
    preflight changes them in place)."""
    precompute = ["--precompute_ref_log_probs", "true"] if preset == "fsdp2" else []
    run = launch(tmp_path / "out", *EXACT, *precompute, "--per_device_train_batch_size", "4", preset=preset,
                 processes=2, script=FSDP_LAUNCHER if preset == "fsdp2" else ENTRY,
                 env={"HF_HOME": str(tmp_path / "hf")})  # an empty cache: the pass runs on the sharded model
    assert ("reference: precomputed log-probs of 400 rows" in run.stdout) == bool(precompute)
    checks.assert_same_steps(run, one_process, COMPARED)


def test_tiny_kto_recipe_learns_the_feedback(tmp_path):
    """The shipped recipe: desirable completions gain reward over undesirable ones, on the held-out rows too; the
    report plots kto's terms and the model card names the objective."""
    run = run_script(tmp_path / "out", *TINY_KTO, "--max_steps", "20")  # half the recipe's steps: enough here
    said = " ".join((run.stdout + run.stderr).split())
    assert "objective kto (kto), beta 0.1" in said and "reference: a frozen copy of the starting model" in said
    assert "desirable," in said and "undesirable)" in said
    rows, evals = run.train_rows(), run.eval_rows()
    assert rows[0]["loss"] == pytest.approx(0.5) and rows[-1]["loss"] < 0.5  # step 1: policy = reference
    assert rows[-1]["rewards/margins"] > 0.1
    assert evals[-1]["step"] == 20 and evals[-1]["eval_examples"] == 40 and evals[-1]["eval_rewards/margins"] > 0.1
    card = (run.output_dir / "final" / "README.md").read_text()
    assert "KTO (Kahneman-Tversky optimization" in card and "| reward margin |" in card  # rewards/margins, in words
    subprocess.run([sys.executable, "-m", "hftrain.report", str(run.output_dir)], check=True, cwd=REPO,
                   env=launch_env(), capture_output=True)
    report = (run.output_dir / "report" / "report.md").read_text()
    assert "kto reference point" in report and (run.output_dir / "report" / "kto.png").exists()


@pytest.mark.parametrize("rows, said", [
    ([{"prompt": f"What is {i} + 1?", "completion": f" {i + 1}."} for i in range(8)],
     "cannot train objective=kto: kto learns from unpaired feedback, rows of prompt, completion and label (true for "
     "a desirable completion, false for an undesirable one), and it has format prompt_completion and no label column"),
    ([{"prompt": f"What is {i} + 1?", "completion": f" {i + 1}.", "label": True} for i in range(8)],
     "objective kto needs both desirable and undesirable examples, but every one of the 8 training examples is "
     "desirable"),
], ids=["no-label", "one-class"])
def test_kto_data_without_both_classes_is_refused_before_the_model_loads(tmp_path, rows, said):
    run = run_script(tmp_path / "out", "--model_name_or_path", str(REPO / "models" / "tiny-llama"), "--dataset_name",
                     str(write_jsonl(tmp_path / "rows.jsonl", rows)), "--objective", "kto",
                     "--validation_split_percentage", "0", check=False)
    assert run.returncode != 0 and "Traceback" not in run.stderr and "Loading weights" not in run.stderr
    assert said in " ".join(run.stderr.split())
    assert run.stderr.count("hftrain: error") == 1
