"""kto on an image-text model against TRL 1.16's KTOTrainer (scripts/compare_trl_vlm_kto.py): TRL with one micro-batch
of 4 rows per step, hftrain's entry script with 2 accumulated micro-batches of 2 (its KL reference point over the
step's whole batch, each KL row on its own row's pixels). The loss of a collated micro-batch against a plain PyTorch
computation, the KL rows' tokens and pixels, and two micro-batches against one: tests/unit/test_data_image_unpaired.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText

from hftrain import vision
from tests.conftest import REPO, launch_env

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
