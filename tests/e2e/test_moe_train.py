"""Mixture-of-experts models train with the default recipe (issue 14 item 3): LoRA on a tiny Mixtral with
lora_target_modules all-linear, the dropout choice stated at start-up, the router loss logged as aux_loss."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.conftest import REPO, TINY_CHAT, run_script
from tests.unit.test_moe import tiny

pytestmark = pytest.mark.launch


def test_mixtral_lora_with_the_default_recipe(tmp_path):
    model = tmp_path / "tiny-mixtral"
    tiny("mixtral").save_pretrained(model)
    AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama").save_pretrained(model)
    run = run_script(tmp_path / "out", *TINY_CHAT, "--model_name_or_path", str(model), "--use_peft", "true",
                     "--max_steps", "4", "--logging_steps", "1")
    output = run.stdout + run.stderr
    assert "lora_dropout 0.05 -> 0" in output and "router load-balancing loss added with coefficient 0.001" in output
    rows = run.train_rows()
    assert len(rows) == 4 and all(r["aux_loss"] > 0 for r in rows)
    assert run.state()["model"]["method"] == "lora"
    assert (run.output_dir / "final" / "adapter_model.safetensors").exists()
