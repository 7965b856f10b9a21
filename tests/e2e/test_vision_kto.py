"""kto on an image-text model against TRL 1.16's KTOTrainer (scripts/compare_trl_vlm_kto.py): TRL with one micro-batch
of 4 rows per step, hftrain's entry script with 2 accumulated micro-batches of 2 (its KL reference point over the
step's whole batch, each KL row on its own row's pixels). The loss of a collated micro-batch against a plain PyTorch
computation, the KL rows' tokens and pixels, and two micro-batches against one: tests/unit/test_data_image_unpaired.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from hftrain import vision
from tests.conftest import FSDP_LAUNCHER, REPO, launch, launch_env, run_script

pytestmark = pytest.mark.launch


def test_equal_to_trl_kto_trainer_on_images_with_accumulation(tmp_path):
    """The same 12 rows (one with two images), order and hyperparameters, every part trained: per-step loss, KL
    reference point, rewards and log-probs, and the final weights (hftrain's saved folder against TRL's trained
    model)."""
    assert_equal_to_trl_kto(tmp_path, REPO / "models" / "tiny-vlm")


def assert_equal_to_trl_kto(tmp_path, model) -> None:
    """compare_trl_vlm_kto.py --accumulate 2 on `model` (any family): the per-step values within 1e-4 relative, the
    final weights within 1e-6, the vision tower moved."""
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_trl_vlm_kto.py"), "--out", str(tmp_path),
                           "--json", str(results), "--accumulate", "2", "--model", str(model)], capture_output=True,
                          text=True, cwd=REPO, env=launch_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(results.read_text())["kto full"]
    assert len(runs["trl"]) == len(runs["hftrain"]) == 3
    assert runs["trl"][1]["kl"] > 0.05 and runs["trl"][-1]["rewards/margins"] != 0  # moved from the reference
    for step, (theirs, ours) in enumerate(zip(runs["trl"], runs["hftrain"]), 1):
        for key, value in ours.items():
            assert value == pytest.approx(theirs[key], rel=1e-4, abs=2e-5), (step, key)
    trl = torch.load(f"{runs['trl_final']}/weights.pt")
    mine = AutoModelForImageTextToText.from_pretrained(runs["hftrain_final"]).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(model).state_dict()
    assert any(vision.part_of(key) == "vision" and not torch.equal(value, base[key]) for key, value in mine.items())
    for key, value in mine.items():
        torch.testing.assert_close(value, trl[key], rtol=1e-5, atol=1e-6, msg=key)


# 3 steps of 4 rows in file order (desirable and undesirable both in every step), no evaluation, the projector
# trained too; SGD with momentum, as the dpo layouts test (tests/e2e/test_vision_dpo.py)
EXACT = ["--config", str(REPO / "recipes" / "tiny-vlm-kto.yaml"), "--max_steps", "3", "--logging_steps", "1",
         "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--optim", "sgd",
         "--sgd_momentum", "0.9", "--learning_rate", "0.5", "--max_grad_norm", "0.05", "--warmup_steps", "0",
         "--lr_scheduler_type", "constant", "--freeze_projector", "false"]
COMPARED = ("loss", "grad_norm", "kl")


def test_two_processes_under_ddp_zero3_and_fsdp2_equal_one_batch_and_a_zero3_resume_continues_exactly(tmp_path):
    """kto with images, 4 rows per step as 1 x 4 and as 2 processes x 2 (gloo) under DDP, DeepSpeed ZeRO-3 (the
    frozen reference rebuilt partitioned) and FSDP2 (the CPU test launcher): the same losses, KL reference points
    (taken over the whole step's rows, every rank's KL rows on their own rows' pixels), clipped gradient norms and
    final weights. The ZeRO-3 run, resumed from its checkpoint-2, trains step 3 and its final weights as the
    uninterrupted run did."""
    one = run_script(tmp_path / "one", *EXACT, "--per_device_train_batch_size", "4")
    ddp = launch(tmp_path / "ddp", *EXACT, "--per_device_train_batch_size", "2", preset="cpu_ddp")
    saving = [*EXACT, "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2"]
    zero3 = launch(tmp_path / "zero3", *saving, preset="zero3", processes=2)
    fsdp2 = launch(tmp_path / "fsdp2", *EXACT, "--per_device_train_batch_size", "2", preset="fsdp2", processes=2,
                   script=FSDP_LAUNCHER)
    for run, wrapper in ((ddp, "DistributedDataParallel"), (zero3, "DeepSpeedEngine"), (fsdp2, "FSDPKTOLoss")):
        assert (run.state()["launch"]["num_processes"], run.state()["launch"]["model_wrapper"]) == (2, wrapper)
    assert zero3.state()["parallelism"]["zero_stage"] == 3
    assert any(r["kl"] > 0 for r in one.train_rows())  # a reference point above its clamp at 0 is compared
    expected = load_file(one.output_dir / "final" / "model.safetensors")
    for run in (ddp, zero3, fsdp2):
        for key in COMPARED:
            torch.testing.assert_close(torch.tensor([r[key] for r in run.train_rows()]),
                                       torch.tensor([r[key] for r in one.train_rows()]), rtol=1e-4, atol=1e-6,
                                       msg=key)
        for name, value in load_file(run.output_dir / "final" / "model.safetensors").items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    base = load_file(REPO / "models" / "tiny-vlm" / "model.safetensors")
    assert any(not torch.equal(value, expected[name]) for name, value in base.items()
               if "multi_modal_projector" in name)

    uninterrupted = zero3.train_rows()[-1]
    expected = load_file(zero3.output_dir / "final" / "model.safetensors")
    shutil.rmtree(zero3.output_dir / "final")
    shutil.rmtree(zero3.output_dir / "checkpoint-3", ignore_errors=True)
    resumed = launch(zero3.output_dir, *saving, "--resume_from_checkpoint", "latest", preset="zero3", processes=2)
    row = resumed.train_rows()[-1]
    assert row["step"] == 3 and [r["step"] for r in resumed.train_rows()].count(3) == 1
    for key in COMPARED:
        assert row[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    for name, value in load_file(zero3.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)
