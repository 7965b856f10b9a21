"""dpo on an image-text model through the real entry script: recipes/tiny-vlm-dpo.yaml learns the shipped image
preference pairs; per-step losses, rewards, log-probs and the updated weights equal TRL 1.16's DPOTrainer on the same
rows (scripts/compare_trl_vlm_dpo.py); one step is the same as 1 micro-batch of 4 pairs, 2 accumulated micro-batches
of 2, 2 processes of 2 (gloo) under DDP, ZeRO-3 and FSDP2, and the pairs streamed, and a ZeRO-3 run resumed
continues exactly; orpo accumulates like one batch."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from hftrain import vision
from tests.conftest import FSDP_LAUNCHER, REPO, launch, launch_env, run_script

pytestmark = pytest.mark.launch
RECIPE = ["--config", str(REPO / "recipes" / "tiny-vlm-dpo.yaml")]
# 3 steps of 4 pairs in file order, no evaluation, the projector trained too (the vision tower stays frozen, its
# default); SGD with momentum (as tests/e2e/test_preference.py: AdamW's first steps turn
# last-bit differences of a reduction into 1e-4 weights)
EXACT = [*RECIPE, "--max_steps", "3", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--sgd_momentum", "0.9", "--learning_rate", "0.5",
         "--max_grad_norm", "0.05", "--warmup_steps", "0", "--freeze_projector", "false"]
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected")


def test_the_recipe_learns_the_image_preferences(tmp_path):
    """Starts at policy = reference (loss log 2, margins 0) and ends preferring the chosen answers of the held-out
    pairs; the frozen vision tower and projector are the base's."""
    run = run_script(tmp_path / "out", *RECIPE, "--max_steps", "16", "--eval_steps", "16", "--logging_steps", "1")
    out = " ".join((run.stdout + run.stderr).split())
    assert "objective dpo (sigmoid), beta 0.1; reference: a frozen copy of the starting model" in out
    rows, evals = run.train_rows(), run.eval_rows()
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["rewards/margins"] == 0
    assert evals[-1]["eval_pairs"] == 8 and evals[-1]["eval_loss"] < math.log(2) - 0.1
    assert evals[-1]["eval_rewards/margins"] > 0
    assert run.state()["data"]["sources"][0]["format"] == "image_preference"
    base = load_file(REPO / "models" / "tiny-vlm" / "model.safetensors")
    for name, value in load_file(run.output_dir / "final" / "model.safetensors").items():
        frozen = ".vision_tower." in f".{name}" or ".multi_modal_projector." in f".{name}"
        assert torch.equal(base[name], value) == frozen, name


def test_equal_to_trl_dpo_trainer_on_images(tmp_path):
    """scripts/compare_trl_vlm_dpo.py: TRL 1.16's DPOTrainer and hftrain on the same image pairs, order and
    hyperparameters, sigmoid with every part trained and with QLoRA (adapters on the language model's and the vision
    tower's attention over the base loaded in 4 bits by bitsandbytes on the CPU; the reference: the adapters
    disabled, on the same pixels; ipo's formula is compared with TRL on text pairs by tests/e2e/test_preference.py,
    and the script's ipo and plain LoRA runs on images gave the same agreement when measured): per-step loss, rewards
    and log-probs, and the final weights (hftrain's saved folder loaded by transformers, or its adapter by peft,
    against TRL's trained model)."""
    assert_equal_to_trl_dpo(tmp_path, REPO / "models" / "tiny-vlm", ["sigmoid full", "sigmoid qlora"])


def assert_equal_to_trl_dpo(tmp_path, model, variants: list[str]) -> None:
    """compare_trl_vlm_dpo.py's `variants` on `model` (any family): the per-step values within 1e-4 relative, the
    final weights (the adapter's, for LoRA) within 1e-6, the vision tower and the language model moved."""
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_trl_vlm_dpo.py"), "--out", str(tmp_path),
                           "--json", str(results), "--model", str(model), "--variants", *variants],
                          capture_output=True, text=True, cwd=REPO, env=launch_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    compared = json.loads(results.read_text())
    assert sorted(compared) == sorted(variants)
    for name, runs in compared.items():
        assert len(runs["trl"]) == len(runs["hftrain"]) == 3, name
        assert runs["trl"][-1]["rewards/margins"] != 0  # both moved away from the reference
        for step, (theirs, ours) in enumerate(zip(runs["trl"], runs["hftrain"]), 1):
            for key, value in ours.items():
                assert value == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), (name, step, key)
        trl = torch.load(f"{runs['trl_final']}/weights.pt")
        base = AutoModelForImageTextToText.from_pretrained(model)
        before = {key: value.clone() for key, value in base.state_dict().items()}
        if name.endswith("lora"):  # the adapter on its base, as TRL's PeftModel names its tensors
            mine = PeftModel.from_pretrained(base, runs["hftrain_final"]).state_dict()
            if name.endswith("qlora"):  # TRL's base holds packed 4-bit weights: its adapters compare
                mine = {key: value for key, value in mine.items() if "lora_" in key}
            moved = [key for key in mine if "lora_B" in key and mine[key].abs().max() > 0]
        else:
            mine = AutoModelForImageTextToText.from_pretrained(runs["hftrain_final"]).state_dict()
            moved = [key for key in mine if not torch.equal(mine[key], before[key])]
        extra = {key for key in set(trl) - set(mine) if "lora_" in key or not name.endswith("qlora")}
        # TRL keeps the starting adapter as a second one, "ref", for its reference
        assert set(mine) <= set(trl) and all(".ref." in key for key in extra), sorted(extra)[:3]
        for key, value in mine.items():
            torch.testing.assert_close(value, trl[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert {vision.part_of(key) for key in moved} >= {"vision", "language"}


def test_accumulation_two_processes_and_streaming_equal_one_batch_and_a_zero3_resume_continues_exactly(tmp_path):
    """4 pairs per step as 1 x 4, 2 accumulated micro-batches x 2, and 2 processes x 2 (gloo) under DDP, DeepSpeed
    ZeRO-3 (its frozen reference rebuilt partitioned) and FSDP2 (the CPU test launcher; the reference sharded like
    the policy), and 1 x 4 streamed (`streaming: true`: each pair encoded when read, its image opened again when
    collated): the same losses, rewards, clipped gradient norms and final weights (the loss is the mean over the
    step's pairs). The ZeRO-3 run, resumed from its checkpoint-2 (DeepSpeed's partitioned model and optimizer
    states, the frozen reference rebuilt partitioned), trains step 3 and its final weights as the uninterrupted run
    did; the streamed run, resumed from its checkpoint-2 (the stream's position), trains step 3 of the 1 x 4 run."""
    one = run_script(tmp_path / "one", *EXACT, "--per_device_train_batch_size", "4")
    accum = run_script(tmp_path / "accum", *EXACT, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2")
    ddp = launch(tmp_path / "ddp", *EXACT, "--per_device_train_batch_size", "2", preset="cpu_ddp")
    saving = [*EXACT, "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2"]
    zero3 = launch(tmp_path / "zero3", *saving, preset="zero3", processes=2)
    fsdp2 = launch(tmp_path / "fsdp2", *EXACT, "--per_device_train_batch_size", "2", preset="fsdp2", processes=2,
                   script=FSDP_LAUNCHER)
    streaming = [*EXACT, "--per_device_train_batch_size", "4", "--streaming", "true"]
    stream = run_script(tmp_path / "stream", *streaming, "--save_strategy", "steps", "--save_steps", "2")
    assert "image-pairs.jsonl' (preference): one rank reads 1 shard(s)" in " ".join(stream.stdout.split())
    for run, wrapper in ((ddp, "DistributedDataParallel"), (zero3, "DeepSpeedEngine"), (fsdp2, "FSDPPreferenceLoss")):
        assert (run.state()["launch"]["num_processes"], run.state()["launch"]["model_wrapper"]) == (2, wrapper)
    assert zero3.state()["parallelism"]["zero_stage"] == 3
    expected = load_file(one.output_dir / "final" / "model.safetensors")
    for run in (accum, ddp, zero3, fsdp2, stream):
        for key in COMPARED:
            torch.testing.assert_close(torch.tensor([r[key] for r in run.train_rows()]),
                                       torch.tensor([r[key] for r in one.train_rows()]), rtol=1e-4, atol=1e-6,
                                       msg=key)
        for name, value in load_file(run.output_dir / "final" / "model.safetensors").items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert one.train_rows()[-1]["rewards/margins"] != 0
    base = load_file(REPO / "models" / "tiny-vlm" / "model.safetensors")
    assert any(not torch.equal(value, expected[name]) for name, value in base.items()
               if "multi_modal_projector" in name)

    shutil.rmtree(stream.output_dir / "final")
    (stream.output_dir / "metrics.jsonl").write_text("")
    again = run_script(stream.output_dir, *streaming, "--resume_from_checkpoint",
                       str(stream.output_dir / "checkpoint-2"))
    assert "the stream resumes by seeking to the saved line" in " ".join(again.stdout.split())
    assert [r["step"] for r in again.train_rows()] == [3]
    for key in COMPARED:
        assert again.train_rows()[0][key] == pytest.approx(one.train_rows()[-1][key], rel=1e-5, abs=1e-7), key
    for name, value in load_file(again.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)

    uninterrupted = zero3.train_rows()[-1]
    expected = load_file(zero3.output_dir / "final" / "model.safetensors")
    shutil.rmtree(zero3.output_dir / "final")
    shutil.rmtree(zero3.output_dir / "checkpoint-3", ignore_errors=True)
    resumed = launch(zero3.output_dir, *saving, "--resume_from_checkpoint", "latest", preset="zero3", processes=2)
    assert "resuming from" in resumed.stdout + resumed.stderr and "checkpoint-2 at step 2" in " ".join(
        (resumed.stdout + resumed.stderr).split())
    row = resumed.train_rows()[-1]
    assert row["step"] == 3 and [r["step"] for r in resumed.train_rows()].count(3) == 1
    for key in COMPARED:
        assert row[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    for name, value in load_file(zero3.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_orpo_on_image_pairs_accumulates_and_splits_over_processes_like_one_batch(tmp_path):
    """orpo through the entry script on the image pairs: 2 accumulated micro-batches of 2 pairs, and 2 DDP processes
    of 2 (gloo), equal one of 4 (the NLL's token mean over the step's chosen rows, image tokens left out, counted
    across micro-batches and ranks before the step: the loss, its NLL part and the final weights)."""
    args = [*EXACT, "--objective", "orpo", "--max_steps", "2"]
    one = run_script(tmp_path / "one", *args, "--per_device_train_batch_size", "4")
    accum = run_script(tmp_path / "accum", *args, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2")
    ddp = launch(tmp_path / "ddp", *args, "--per_device_train_batch_size", "2", preset="cpu_ddp")
    assert (ddp.state()["launch"]["num_processes"], ddp.state()["launch"]["model_wrapper"]) == (
        2, "DistributedDataParallel")
    expected = load_file(one.output_dir / "final" / "model.safetensors")
    for run in (accum, ddp):
        for key in ("loss", "nll_loss", "log_odds_ratio", "grad_norm"):
            torch.testing.assert_close(torch.tensor([r[key] for r in run.train_rows()]),
                                       torch.tensor([r[key] for r in one.train_rows()]), rtol=1e-5, atol=1e-6,
                                       msg=key)
        for name, value in load_file(run.output_dir / "final" / "model.safetensors").items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert "objective orpo" in one.stdout + one.stderr


def test_lora_under_zero3_equals_one_process(tmp_path):
    """LoRA dpo on the image pairs under ZeRO-3 on 2 processes x 2 equals one process x 4: the adapters start from
    the same draws (the partitioned load of the image-text model leaves the random state alone) and train alike
    (losses, rewards, clipped norms, the saved adapter). No dropout: its masks are drawn per process."""
    args = [*EXACT, "--use_peft", "true", "--lora_dropout", "0", "--max_steps", "2"]
    one = run_script(tmp_path / "one", *args, "--per_device_train_batch_size", "4")
    zero3 = launch(tmp_path / "zero3", *args, "--per_device_train_batch_size", "2", preset="zero3", processes=2)
    state = zero3.state()
    assert (state["launch"]["num_processes"], state["launch"]["model_wrapper"], state["parallelism"]["zero_stage"]) == \
        (2, "DeepSpeedEngine", 3)
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([r[key] for r in zero3.train_rows()]),
                                   torch.tensor([r[key] for r in one.train_rows()]), rtol=1e-4, atol=1e-6, msg=key)
    expected = load_file(one.output_dir / "final" / "adapter_model.safetensors")
    saved = load_file(zero3.output_dir / "final" / "adapter_model.safetensors")
    assert saved.keys() == expected.keys()
    for name, value in saved.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
