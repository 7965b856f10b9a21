"""kto on an image-text model through the real entry script (recipes/tiny-vlm-kto.yaml on the shipped unpaired image
feedback): one step of 4 rows as 1 micro-batch equals 2 accumulated micro-batches of 2 (the KL reference point over
the step's whole batch, each KL row on its own row's pixels), in losses, KL, rewards, gradient norms and weights.
The loss itself is compared with a plain PyTorch computation by tests/unit/test_data_image_unpaired.py."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_script

EXACT = ["--config", str(REPO / "recipes" / "tiny-vlm-kto.yaml"), "--max_steps", "2", "--logging_steps", "1",
         "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--optim", "sgd",
         "--sgd_momentum", "0.9", "--learning_rate", "0.5", "--max_grad_norm", "0.05", "--warmup_steps", "0",
         "--freeze_projector", "false"]
COMPARED = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def test_kto_on_images_accumulates_like_one_batch(tmp_path):
    one = run_script(tmp_path / "one", *EXACT, "--per_device_train_batch_size", "4")
    accum = run_script(tmp_path / "accum", *EXACT, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2")
    assert "objective kto (kto)" in one.stdout + one.stderr
    assert one.state()["data"]["sources"][0]["format"] == "image_unpaired"
    rows = one.train_rows()
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0  # step 2's reference point: the policy moved after step 1
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([r[key] for r in accum.train_rows()]),
                                   torch.tensor([r[key] for r in rows]), rtol=1e-5, atol=1e-6, msg=key)
    expected = load_file(one.output_dir / "final" / "model.safetensors")
    base = load_file(REPO / "models" / "tiny-vlm" / "model.safetensors")
    for name, value in load_file(accum.output_dir / "final" / "model.safetensors").items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)
        assert torch.equal(base[name], value) == (".vision_tower." in f".{name}"), name
