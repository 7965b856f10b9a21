"""attn_implementation varlen through the real entry point, on CPU: tests/launchers/varlen_on_cpu.py stands the
per-document sdpa reference in for torch's CUDA-only kernel; the rest is the product path. One tiny run proves the
wiring the unit tests (tests/unit/test_attention.py) take apart: chosen without being named for packed rows in bf16,
the collator's boundaries reaching every attention call, and one step equal to plain PyTorch's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, build_tiny_model, run_script, write_jsonl

pytestmark = pytest.mark.launch
LAUNCHER = REPO / "tests" / "launchers" / "varlen_on_cpu.py"
N_EXAMPLES = 8
BOUND = 2e-2  # bf16: scripts/gpu_proof.py's; the naive per-micro-batch accumulation lands at ~8e-2


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """The tiny Llama with grouped key/value heads (4 query heads share 2)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gqa"), "--num_kv_heads", "2")


def texts() -> list[str]:
    lines = (REPO / "data" / "text.jsonl").read_text().splitlines()[:N_EXAMPLES]
    return [json.loads(line)["text"] for line in lines]


def plain_step(model_dir, bf16: bool = True) -> tuple[dict, dict]:
    """(weights, gradient) of the HF model's own mean token loss over the 8 examples in one right-padded batch with an
    attention mask, sdpa, under bf16 autocast (or in fp32): what one SGD step at lr 1 subtracts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts()]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad for n, p in model.named_parameters()})


def one_sgd_step(data, *extra: str) -> list[str]:
    """The recipe of one SGD step (lr 1, no clipping) over the 8 examples packed into 4 rows of 96 tokens, 2
    micro-batches of 2 rows."""
    return ["--dataset_name", str(data), "--validation_split_percentage", "0", "--packing", "true", "--max_length",
            "96", "--max_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
            "--max_grad_norm", "0", "--weight_decay", "0", "--train_sampling_strategy", "random",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--logging_steps", "1", *extra]


def test_named_varlen_on_cpu_runs_hftrains_own_kernel_and_one_fp32_step_equals_plain_pytorch(tmp_path, gqa_model):
    """No stand-in: on this CPU machine a named varlen runs hftrain's per-document sdpa (the start-up line says so), in
    fp32, and the step equals plain PyTorch's over the 8 examples one right-padded batch with a mask."""
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts()])
    run = run_script(tmp_path / "out", "--model_name_or_path", str(gqa_model),
                     *one_sgd_step(data, "--attn_implementation", "varlen"))
    assert "hftrain: attention varlen (per-document sdpa, packed rows); compile off" in run.stdout
    assert run.state()["model"]["attention"] == "varlen"
    before, grads = plain_step(gqa_model, bf16=False)
    after = load_file(run.output_dir / "final" / "model.safetensors")
    worst = max(float(((before[n] - after[n]) - g).abs().max() / g.abs().max()) for n, g in grads.items())
    assert worst <= 1e-4, worst  # fp32 rounding of w - g on the norms' weights of ~1: sdpa's packed run lands there too


def test_packed_bf16_rows_choose_varlen_and_one_step_equals_plain_pytorch(tmp_path, gqa_model):
    """Packing and bf16 name no attention: the run chooses varlen, says so at start-up, records it, and every attention
    call goes through the kernel with the key/value heads uncopied. The 8 examples pack into 4 rows of 96 tokens
    (BFD); 2 micro-batches of 2 rows (each flattened into one sequence) make the step. One SGD step (lr 1, no
    clipping) moves each weight by the gradient of plain PyTorch's mean loss over the 8 examples, within bf16's
    bound."""
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts()])
    run = run_script(tmp_path / "out", "--model_name_or_path", str(gqa_model), "--dataset_name", str(data),
                     "--validation_split_percentage", "0", "--packing", "true", "--max_length", "96", "--bf16", "true",
                     "--max_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
                     "--max_grad_norm", "0", "--weight_decay", "0", "--train_sampling_strategy", "random",
                     "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--logging_steps",
                     "1", script=LAUNCHER)
    assert "hftrain: attention varlen (reference, packed rows); compile off; loss logits at trained positions" in \
        run.stdout
    assert run.state()["model"]["attention"] == "varlen"
    assert "8 training examples in 4 rows" in run.stdout
    # one call per layer and micro-batch (2 layers x 2), 4 query heads on 2 key/value heads
    assert "varlen reference kernel: 4 calls, (heads, kv heads) [(4, 2)]" in run.stderr
    before, grads = plain_step(gqa_model)
    after = load_file(run.output_dir / "final" / "model.safetensors")
    worst = max(float(((before[n] - after[n]) - g).abs().max() / g.abs().max()) for n, g in grads.items())
    assert worst <= BOUND, worst
