"""Every shipped tiny recipe trains through the real entry script; packing stays exact under DDP.

The recipes run without accelerate's launcher (their preset, cpu, is launched by test_finetune.py): what is
tested here is the recipe, its data format and its defaults.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.conftest import REPO, launch, run_script

pytestmark = pytest.mark.launch
# tiny-dpo.yaml, tiny-orpo.yaml and tiny-kto.yaml train preferences: tests/e2e/test_preference.py, test_orpo.py and
# test_kto.py run them with their own assertions (kto's loss lies in [0, w]: it cannot fall by 0.5), as
# tests/e2e/test_reward.py runs tiny-reward.yaml (a reward model: its held-out ranking); tiny-vlm.yaml
# (an image-text model) is run by tests/e2e/test_vision.py, tiny-vlm-dpo.yaml (dpo on image pairs) by
# tests/e2e/test_vision_dpo.py; tiny-vlm-kto.yaml's loss lies in [0, 1] as tiny-kto.yaml's, and its data and
# objective run in tests/e2e/test_vision_kto.py (against TRL); tiny-grpo.yaml (a policy-gradient loss, near 0 at
# every step by construction, so "the loss falls" says nothing) by tests/e2e/test_grpo.py, which asserts that its
# reward rises
# tiny-tools-sft.yaml and tiny-tools.yaml are one two-stage run (SFT teaching a tool-call format, then GRPO from its
# output, minutes on CPU): tests/e2e/test_grpo_tools.py checks the mechanics on a scripted policy and that the
# recipes and their shipped data agree; tiny-distill.yaml's loss is a divergence to its teacher
# (tests/e2e/test_distill.py asserts that it falls); tiny-grpo-async.yaml's reward rises in
# tests/e2e/test_grpo_async.py; tiny-embedding.yaml's contrastive batches differ step to step
# (tests/e2e/test_embedding.py asserts its held-out loss against chance), as it runs tiny-reranker.yaml;
# tiny-vlm-grpo.yaml (grpo on prompts with images) by tests/e2e/test_vision_grpo.py
# tiny-qat-lora.yaml (LoRA falls slower than 0.5 in 8 steps) runs one step against plain PyTorch in
# tests/e2e/test_qat_lora_runs.py
TINY_RECIPES = sorted(p.name for p in (REPO / "recipes").glob("tiny-*.yaml")
                      if p.name not in ("tiny-dpo.yaml", "tiny-orpo.yaml", "tiny-kto.yaml", "tiny-reward.yaml",
                                        "tiny-vlm.yaml", "tiny-vlm-dpo.yaml", "tiny-vlm-kto.yaml", "tiny-grpo.yaml",
                                        "tiny-tools-sft.yaml", "tiny-tools.yaml", "tiny-distill.yaml",
                                        "tiny-grpo-async.yaml", "tiny-embedding.yaml", "tiny-reranker.yaml",
                                        "tiny-vlm-grpo.yaml", "tiny-qat-lora.yaml"))


def test_every_tiny_recipe_is_covered():
    assert {"tiny-chat.yaml", "tiny-text.yaml", "tiny-prompt-completion.yaml", "tiny-alpaca.yaml",
            "tiny-sharegpt.yaml", "tiny-mixture.yaml", "tiny-chat-packed.yaml",
            "tiny-moe-lora.yaml"} <= set(TINY_RECIPES)


@pytest.mark.parametrize("recipe", TINY_RECIPES)
def test_tiny_recipe_trains(tmp_path, recipe):
    run = run_script(tmp_path / "out", "--config", str(REPO / "recipes" / recipe), "--max_steps", "8",
                 "--logging_steps", "1", "--learning_rate", "5e-3")
    rows = run.train_rows()
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert min(r["loss"] for r in rows[-3:]) < rows[0]["loss"] - 0.5, "loss did not fall"
    assert run.eval_rows()[-1]["eval_loss"] < rows[0]["loss"]
    values = yaml.safe_load((REPO / "recipes" / recipe).read_text())
    weights = "adapter_model.safetensors" if values.get("use_peft") else "model.safetensors"
    assert (run.output_dir / "final" / weights).exists()
    if "moe" in recipe:  # the mixture of experts: default LoRA targets with dropout 0 chosen, router loss logged
        assert "lora_dropout 0.05 -> 0" in run.stdout + run.stderr
        assert all(r["aux_loss"] > 0 for r in rows)


def test_packing_under_two_process_ddp_equals_one_process(tmp_path):
    common = ["--config", str(REPO / "recipes" / "tiny-chat-packed.yaml"), "--max_steps", "4", "--logging_steps", "1",
              "--validation_split_percentage", "0", "--per_device_train_batch_size", "2"]
    one = run_script(tmp_path / "one", *common, "--gradient_accumulation_steps", "2")
    two = launch(tmp_path / "two", *common, preset="cpu_ddp")
    assert two.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    assert two.state()["launch"]["num_processes"] == 2
    devices = two.state()["devices"]["processes"]  # each process's physical device, recorded (here: CPU processes)
    assert [(d["rank"], d["type"]) for d in devices] == [(0, "cpu"), (1, "cpu")]
    losses_one = torch.tensor([r["loss"] for r in one.train_rows()])
    losses_two = torch.tensor([r["loss"] for r in two.train_rows()])
    torch.testing.assert_close(losses_two, losses_one, rtol=1e-5, atol=1e-6)
    # packed rows hold several examples: samples/s counts examples, not rows
    rows = one.train_rows()
    assert rows[0]["samples_per_second"] > 0
    assert one.state()["data"]["train_examples"] > 2 * one.state()["total_steps"]


def test_dataset_smaller_than_a_global_batch_is_refused(tmp_path):
    data = tmp_path / "few.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n')
    run = run_script(tmp_path / "out", "--dataset_name", str(data), "--validation_split_percentage", "0",
                 "--per_device_train_batch_size", "4", check=False)
    assert run.returncode != 0
    assert "fewer than one global batch of 4" in run.stderr.replace("\n", " ")
