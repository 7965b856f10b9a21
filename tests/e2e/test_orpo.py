"""orpo through the real entry script: the shipped recipe learns, TRL's ORPOTrainer gives the same steps, one step
is the same whatever its split into micro-batches and processes (sharded strategies and LoRA included), a resumed
run continues exactly, and data without a rejected column is refused before the model loads."""

from __future__ import annotations

import pytest

from tests.conftest import ENTRY, FSDP_LAUNCHER, REPO, launch, run_script, write_jsonl
from tests.e2e import objective_checks as checks

pytestmark = pytest.mark.launch
TINY_ORPO = ["--config", str(REPO / "recipes" / "tiny-orpo.yaml")]
# 3 steps of 4 pairs in file order, clipping active, no evaluation; SGD with momentum as tests/e2e/test_preference.py
# (AdamW's first steps would magnify the last-bit differences of an all-reduce)
EXACT = [*TINY_ORPO, "--max_steps", "3", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--sgd_momentum", "0.9", "--learning_rate", "0.5",
         "--max_grad_norm", "0.5", "--warmup_steps", "0", "--save_steps", "2"]
COMPARED = ("loss", "grad_norm", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen",
            "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process x 4 pairs per step, a checkpoint at step 2: what the other layouts and the resume are compared with."""
    return run_script(tmp_path_factory.mktemp("orpo-one") / "out", *EXACT, "--per_device_train_batch_size", "4")


def test_tiny_orpo_recipe_learns_the_preferences(tmp_path):
    """The shipped recipe: the loss falls from the untrained model's NLL and the held-out pairs end preferred."""
    run = run_script(tmp_path / "out", *TINY_ORPO, "--max_steps", "20")  # half the recipe's steps: enough here
    said = " ".join((run.stdout + run.stderr).split())
    assert "objective orpo, beta 0.1; reference: none (reference-free)" in said
    rows, evals = run.train_rows(), run.eval_rows()
    assert rows[-1]["loss"] < rows[0]["loss"] - 2 and rows[-1]["nll_loss"] < rows[0]["nll_loss"] - 2
    assert rows[-1]["log_odds_ratio"] > rows[0]["log_odds_ratio"]
    assert evals[-1]["eval_pairs"] == 40 and evals[-1]["eval_rewards/margins"] > 0
    assert evals[-1]["eval_rewards/accuracies"] > 0.5 and evals[-1]["eval_log_odds_chosen"] > 0
    assert (run.output_dir / "final" / "model.safetensors").exists()


def test_equal_to_trl_orpo_trainer(tmp_path):
    """scripts/compare_trl_orpo.py: TRL 1.16's ORPOTrainer and hftrain on the same pairs, order and
    hyperparameters, full and LoRA: per-step loss, nll_loss, log-odds, rewards and log-probs within 1e-4."""
    compared = checks.compare_with_trl(tmp_path, "compare_trl_orpo.py")
    assert sorted(compared) == ["full", "lora"]
    for name, runs in compared.items():
        assert runs["trl"][-1]["rewards/margins"] != runs["trl"][0]["rewards/margins"]  # both trained
        checks.assert_steps_match_trl(name, runs["trl"], runs["hftrain"])


def test_orpo_step_is_the_same_over_micro_batches_and_processes(tmp_path, one_process):
    """4 pairs per step as 1 x 4, 2 micro-batches x 2 and 2 DDP processes x 2: the same losses (the NLL is the
    mean over the step's chosen tokens, not a mean of micro-batch means), statistics, clipped norms and weights."""
    assert one_process.train_rows()[-1]["grad_norm"] > 0.5  # clipping was active
    checks.assert_same_over_micro_batches_and_processes(tmp_path, one_process, EXACT, COMPARED, rows=4)


def test_orpo_resumes_exactly(tmp_path, one_process):
    """Resumed from checkpoint-2, step 3 and the final weights equal the uninterrupted run's."""
    checks.assert_resumes_exactly(tmp_path, one_process, [*EXACT, "--per_device_train_batch_size", "4"], COMPARED)


@pytest.mark.parametrize("preset, lora", [("zero3", False), ("fsdp2", True)], ids=["zero3-full", "fsdp2-lora"])
def test_orpo_under_sharded_presets_equals_one_process(tmp_path, one_process, preset, lora):
    """2 sharded processes x 2 pairs = 1 process x 4 pairs: full fine-tuning under ZeRO-3 against `one_process`,
    LoRA under FSDP2 against a one-process LoRA run."""
    args = [*EXACT, *(["--use_peft", "true", "--lora_dropout", "0"] if lora else [])]
    expected = run_script(tmp_path / "one", *args, "--per_device_train_batch_size", "4") if lora else one_process
    run = launch(tmp_path / "out", *args, "--per_device_train_batch_size", "2", preset=preset, processes=2,
                 script=FSDP_LAUNCHER if preset == "fsdp2" else ENTRY)
    checks.assert_same_steps(run, expected, COMPARED, "adapter_model.safetensors" if lora else "model.safetensors")


def test_orpo_data_without_rejected_is_refused_before_the_model_loads(tmp_path):
    pairs = [{"prompt": f"What is {i} + 1?", "chosen": f" {i + 1}."} for i in range(8)]
    run = run_script(tmp_path / "out", "--model_name_or_path", str(REPO / "models" / "tiny-llama"), "--dataset_name",
                     str(write_jsonl(tmp_path / "pairs.jsonl", pairs)), "--objective", "orpo", check=False)
    said = " ".join(run.stderr.split())
    assert run.returncode != 0 and "Traceback" not in run.stderr and "Loading weights" not in run.stderr
    assert "needs both a chosen and a rejected column, this one has only chosen" in said
