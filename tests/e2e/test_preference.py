"""dpo through the real entry script: the shipped recipe learns, one step is the same whatever its split into
micro-batches and processes, and a resumed LoRA run continues exactly."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ENTRY, FSDP_LAUNCHER, REPO, Run, launch, launch_env, run_script, write_jsonl
from tests.model_cards import check_card
from tests.wandb_records import summary

pytestmark = pytest.mark.launch
TINY_DPO = ["--config", str(REPO / "recipes" / "tiny-dpo.yaml")]
# 3 steps of 4 pairs in file order, clipping active, no evaluation: only the optimizer steps are compared. SGD with
# momentum: AdamW's first steps divide gradients by their own magnitude, which turns the last-bit differences of a
# DDP all-reduce into 1e-4 weight differences wherever a gradient is ~0 (the loss rows above still match to 1e-6).
EXACT = [*TINY_DPO, "--max_steps", "3", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--sgd_momentum", "0.9", "--learning_rate", "0.5",
         "--max_grad_norm", "0.05", "--warmup_steps", "0", "--save_steps", "100"]
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected")


def test_tiny_dpo_recipe_learns_the_preferences(tmp_path):
    """The Done-when command: starts at policy = reference (loss log 2, rewards 0) and ends preferring the chosen
    answers of the held-out pairs."""
    run = launch(tmp_path / "out", *TINY_DPO, "--logging_steps", "1")
    out = " ".join((run.stdout + run.stderr).split())
    assert "objective dpo (sigmoid), beta 0.1; reference: a frozen copy of the starting model" in out
    rows, evals = run.train_rows(), run.eval_rows()
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["rewards/margins"] == 0 and rows[0]["rewards/accuracies"] == 0
    assert sum(r["loss"] for r in rows[-5:]) / 5 < math.log(2) - 0.05
    assert evals[-1]["eval_pairs"] == 40 and evals[-1]["eval_loss"] < math.log(2)
    assert evals[-1]["eval_rewards/accuracies"] > 0.6 and evals[-1]["eval_rewards/margins"] > 0
    assert rows[-1]["pairs_per_second"] == rows[-1]["samples_per_second"] > 0
    assert run.state()["data"]["sources"][0]["format"] == "preference"
    assert (run.output_dir / "final" / "model.safetensors").exists()
    card = check_card(run.output_dir / "final", library="transformers", base_model=REPO / "models" / "tiny-llama",
                      tags={"dpo", "full"}, rows=run.metrics())
    assert f"| eval reward accuracy | {evals[-1]['eval_rewards/accuracies']:.4g} |" in card.text  # words (issue 49)


def test_dpo_step_is_the_same_over_micro_batches_and_processes(tmp_path, full_one_process):
    """4 pairs per step as 1 x 4, 2 micro-batches x 2 and 2 DDP processes x 2: the same losses, rewards, gradient
    norms (clipping active) and final weights. The loss is the mean over the step's pairs, not of micro-batch means.
    The 1 x 4 run is the module's `full_one_process` (the same arguments; it also reports to W&B)."""
    one = full_one_process
    accum = run_script(tmp_path / "accum", *EXACT, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2")
    ddp = launch(tmp_path / "ddp", *EXACT, "--per_device_train_batch_size", "2", preset="cpu_ddp")
    assert ddp.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    reference = one.train_rows()
    assert reference[-1]["grad_norm"] > 0.05  # clipping was active
    for other in (accum, ddp):
        for key in COMPARED:
            torch.testing.assert_close(torch.tensor([r[key] for r in other.train_rows()]),
                                       torch.tensor([r[key] for r in reference]), rtol=1e-4, atol=1e-6, msg=key)
        weights, expected = (load_file(r.output_dir / "final" / "model.safetensors") for r in (other, one))
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_dpo_resumes_exactly(tmp_path):
    """LoRA dpo (reference: the base with adapters disabled, rebuilt on resume): steps 3-4 after a resume from
    checkpoint-2 equal the uninterrupted run's."""
    args = [*EXACT[:-2], "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "2", "--use_peft", "true",
            "--per_device_train_batch_size", "4", "--max_grad_norm", "1.0"]
    out = tmp_path / "out"
    first = run_script(out, *args)
    assert "reference: the base model with the adapters disabled" in " ".join(first.stdout.split())
    uninterrupted = {r["step"]: r for r in first.train_rows()}
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-4")
    resumed = run_script(out, *args, "--resume_from_checkpoint", "latest")
    rows = {r["step"]: r for r in resumed.train_rows() if r["step"] > 2}
    assert sorted(rows) == [3, 4]
    for step, row in rows.items():
        for key in COMPARED:
            assert row[key] == pytest.approx(uninterrupted[step][key], rel=1e-5, abs=1e-7), (step, key)
    for name, value in load_file(out / "final" / "adapter_model.safetensors").items():
        torch.testing.assert_close(value, adapter[name], rtol=1e-5, atol=1e-7)
    # the dpo adapter merges into a standard model folder like any other adapter
    merged = subprocess.run([sys.executable, "-m", "hftrain.merge", str(out / "final"), str(tmp_path / "merged")],
                            capture_output=True, text=True, cwd=REPO, env=launch_env())
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").exists()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()


def test_equal_to_trl_dpo_trainer(tmp_path):
    """scripts/compare_trl_dpo.py: TRL 1.16's DPOTrainer and hftrain on the same pairs, order and hyperparameters,
    sigmoid and ipo, full and LoRA: per-step loss, rewards and log-probs within 1e-4 relative."""
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_trl_dpo.py"), "--out", str(tmp_path),
                           "--json", str(results)], capture_output=True, text=True, cwd=REPO, env=launch_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    compared = json.loads(results.read_text())
    assert sorted(compared) == ["ipo full", "ipo lora", "sigmoid full", "sigmoid lora"]
    for name, runs in compared.items():
        assert len(runs["trl"]) == len(runs["hftrain"]) == 3, name
        assert runs["trl"][-1]["rewards/margins"] != 0  # both moved away from the reference
        for step, (theirs, ours) in enumerate(zip(runs["trl"], runs["hftrain"]), 1):
            for key, value in ours.items():
                assert value == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (name, step, key)


def assert_equals_one_process(run: Run, one_process: Run) -> None:
    """Per-step losses, rewards and clipped norms (COMPARED) and the final weights of the one-process run."""
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([r[key] for r in run.train_rows()]),
                                   torch.tensor([r[key] for r in one_process.train_rows()]), rtol=1e-4,
                                   atol=1e-6, msg=key)
    expected = load_file(one_process.output_dir / "final" / "model.safetensors")
    for name, value in load_file(run.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("lora-one") / "out", *LORA_DPO, "--per_device_train_batch_size", "4")


LORA_DPO = [*EXACT, "--use_peft", "true", "--lora_dropout", "0"]


@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_lora_dpo_under_sharded_presets_equals_one_process(tmp_path, lora_one_process, preset):
    """LoRA dpo with the reference computed by disabling the adapters of the sharded model (ZeRO-3 partitions,
    FSDP2 shards): 2 processes x 2 pairs = 1 process x 4 pairs, losses, rewards and the saved adapter."""
    script = FSDP_LAUNCHER if preset == "fsdp2" else ENTRY
    run = launch(tmp_path / "out", *LORA_DPO, "--per_device_train_batch_size", "2", preset=preset, processes=2,
                 script=script)
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([r[key] for r in run.train_rows()]),
                                   torch.tensor([r[key] for r in lora_one_process.train_rows()]), rtol=1e-4,
                                   atol=1e-6, msg=key)
    assert lora_one_process.train_rows()[-1]["rewards/margins"] > 0
    adapter = load_file(lora_one_process.output_dir / "final" / "adapter_model.safetensors")
    for name, value in load_file(run.output_dir / "final" / "adapter_model.safetensors").items():
        torch.testing.assert_close(value, adapter[name], rtol=1e-4, atol=1e-5, msg=name)


def test_precomputed_reference_equals_the_live_one_survives_a_resume_and_is_cached(tmp_path):
    """precompute_ref_log_probs: the same train and eval rows as the frozen copy; resumed at step 2 it reads the
    values saved in the checkpoint (a recomputation with the trained model would change steps 3-4); another run on
    the same data and model reads them from the cross-run cache; a checkpoint without them is refused."""
    args = [*EXACT[:-2], "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "3",
            "--validation_split_percentage", "10", "--eval_steps", "2", "--per_device_train_batch_size", "4"]
    cache_home = {"HF_HOME": str(tmp_path / "hf")}  # a cache of this test's own
    live = run_script(tmp_path / "live", *args)
    out = tmp_path / "pre"
    pre = run_script(out, *args, "--precompute_ref_log_probs", "true", env=cache_home)
    said = " ".join(pre.stdout.split())
    assert "reference: precomputed log-probs of 400 pairs (one pass of the starting model" in said
    assert list((tmp_path / "hf" / "hftrain" / "reference_log_probs").glob("*.safetensors"))

    def compared(run):
        return [{k: v for k, v in r.items() if k in COMPARED or k.startswith("eval_")} for r in run.metrics()]

    assert compared(pre) == [{k: pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in r.items()} for r in compared(live)]
    assert (out / "checkpoint-2" / "reference_log_probs.safetensors").exists()
    expected = {r["step"]: r for r in pre.train_rows()}
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-4")
    resumed = run_script(out, *args, "--precompute_ref_log_probs", "true", "--resume_from_checkpoint", "latest",
                         env=cache_home)
    assert f"saved in {out / 'checkpoint-2'}" in " ".join(resumed.stdout.split())
    for row in (r for r in resumed.train_rows() if r["step"] > 2):
        for key in COMPARED:
            assert row[key] == pytest.approx(expected[row["step"]][key], rel=1e-5, abs=1e-7), (row["step"], key)
    again = run_script(tmp_path / "again", *args, "--precompute_ref_log_probs", "true", env=cache_home)
    assert "read from the cache" in " ".join(again.stdout.split())
    assert compared(again) == compared(pre)
    refused = run_script(tmp_path / "live", *args, "--precompute_ref_log_probs", "true", "--resume_from_checkpoint",
                         str(tmp_path / "live" / "checkpoint-2"), check=False, env=cache_home)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "has no reference log-probs for the current train and eval pairs" in " ".join(refused.stderr.split())


@pytest.fixture(scope="module")
def full_one_process(tmp_path_factory):
    """The one-process run the sharded ones are compared with; it also reports to W&B (offline, in its folder)."""
    folder = tmp_path_factory.mktemp("full-one")
    (folder / "wandb").mkdir()
    return run_script(folder / "out", *EXACT, "--per_device_train_batch_size", "4", "--report_to", "wandb",
                      env={"WANDB_DIR": str(folder / "wandb")})


def test_wandb_receives_the_rewards_under_trls_names(full_one_process):
    """Every dpo statistic of metrics.jsonl (TRL's names) is in the W&B history at the same step."""
    (run_file,) = full_one_process.output_dir.parent.glob("wandb/wandb/offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    for row in summary(run_file)["history"]:
        history.setdefault(row["_step"], {}).update(row)
    rows = full_one_process.train_rows()
    assert len(rows) == 3 and rows[-1]["rewards/margins"] != 0
    for row in rows:
        for key in (*COMPARED, "rewards/accuracies", "pairs_per_second"):
            assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-12), (row["step"], key)


@pytest.mark.parametrize("preset, precompute", [("zero2", False), ("zero3", False), ("fsdp2", False), ("zero3", True)],
                         ids=["zero2-copy", "zero3-copy", "fsdp2-copy", "zero3-precomputed"])
def test_full_dpo_under_sharded_presets_equals_one_process(tmp_path, full_one_process, preset, precompute):
    """Full-fine-tuning dpo, the reference prepared like the policy (replicated in the engine's dtype under ZeRO-2,
    partitioned under ZeRO-3, sharded under FSDP2) or precomputed by one pass of the sharded starting model: 2
    processes x 2 pairs = 1 process x 4 pairs (with its own frozen copy), weights included."""
    script = FSDP_LAUNCHER if preset == "fsdp2" else ENTRY
    run = launch(tmp_path / "out", *EXACT, "--precompute_ref_log_probs", str(precompute).lower(),
                 "--per_device_train_batch_size", "2", preset=preset, processes=2, script=script,
                 env={"HF_HOME": str(tmp_path / "hf")})  # an empty cache: the pass runs on the sharded model
    how = {"zero2": "replicated on every process in the engine's dtype", "zero3": "partitioned over the processes "
           "(ZeRO-3)", "fsdp2": "sharded over the processes (FSDP2)"}[preset]
    said = " ".join((run.stdout + run.stderr).split())
    expected_reference = "precomputed log-probs of 400 pairs (one pass" if precompute else \
        f"a frozen copy of the starting model, {how}"
    assert f"reference: {expected_reference}" in said
    assert_equals_one_process(run, full_one_process)


@pytest.mark.parametrize("precompute", [False, True], ids=["copy", "precomputed"])
def test_full_dpo_under_tensor_parallelism_equals_one_process(tmp_path, full_one_process, precompute):
    """tp_size=2 (one copy of the model split over 2 processes, 4 pairs per step like the one process): the frozen
    reference is loaded again and filled with each process's own shards (a tensor-parallel model cannot be deep-
    copied), or precomputed by one pass of the sharded model; losses, rewards, clipped norms and weights equal."""
    run = launch(tmp_path / "out", *EXACT, "--per_device_train_batch_size", "4", "--tp_size", "2",
                 "--precompute_ref_log_probs", str(precompute).lower(), preset="tp",
                 env={"HF_HOME": str(tmp_path / "hf")})  # an empty cache: the pass runs on the sharded model
    said = " ".join((run.stdout + run.stderr).split())
    assert "tensor parallel (tp_size=2)" in said
    copy = "a frozen copy of the starting model, sharded over the tensor-parallel group (tp_size=2)"
    assert f"reference: {'precomputed log-probs of 400 pairs (one pass' if precompute else copy}" in said
    assert_equals_one_process(run, full_one_process)


def test_simpo_step_one_equals_its_formula(tmp_path):
    """simpo through the entry script (no reference model): the step-1 loss and rewards equal SimPO's formula in
    plain PyTorch, -log sigmoid(beta (log pi_c / |c| - log pi_r / |r|) - gamma) averaged over the step's 4 pairs, on
    string pairs tokenized here as prompt (with BOS) + completion + EOS."""
    pairs = [{"prompt": f"What is {i} + 1?", "chosen": f" {i} + 1 = {i + 1}.", "rejected": f" It is {i + 7}, I think."}
             for i in range(8)]
    beta, gamma = 2.0, 0.5
    model_dir = REPO / "models" / "tiny-llama"
    tok, lm = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).float()

    def average_log_prob(prompt: str, completion: str) -> float:
        prompt_ids = tok(prompt)["input_ids"]
        ids = prompt_ids + tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        targets = range(len(prompt_ids), len(ids))
        return sum(logp[t - 1, ids[t]].item() for t in targets) / len(targets)

    losses, chosen, rejected = [], [], []
    for p in pairs[:4]:
        c, r = average_log_prob(p["prompt"], p["chosen"]), average_log_prob(p["prompt"], p["rejected"])
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(beta * (c - r) - gamma)).item())
        chosen.append(beta * c)
        rejected.append(beta * r)
    run = run_script(tmp_path / "out", "--model_name_or_path", str(model_dir), "--dataset_name",
                     str(write_jsonl(tmp_path / "pairs.jsonl", pairs)), "--objective", "simpo", "--beta", str(beta),
                     "--simpo_gamma", str(gamma), "--max_steps", "1", "--per_device_train_batch_size", "4",
                     "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0",
                     "--dtype", "float32", "--logging_steps", "1")
    assert "objective simpo, beta 2; reference: none (reference-free)" in " ".join(run.stdout.split())
    (row,) = run.train_rows()
    assert row["loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    assert row["rewards/chosen"] == pytest.approx(sum(chosen) / 4, rel=1e-5)
    assert row["rewards/rejected"] == pytest.approx(sum(rejected) / 4, rel=1e-5)
