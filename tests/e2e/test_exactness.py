"""Gradient accumulation and data parallelism are exact, checked against plain PyTorch.

One SGD step with lr 1 and no clipping moves every parameter by minus its gradient, so the final
weights of a 1-step run expose the gradient hftrain computed. The reference gradient is computed
here, independently of hftrain's data, collator and loss code: the HF model's own mean
cross-entropy over one padded batch holding all 8 examples of the step.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, launch, run_script, write_jsonl

pytestmark = pytest.mark.launch
N_EXAMPLES = 8
LAYOUTS = [  # (processes, per_device_train_batch_size, gradient_accumulation_steps): all 8 examples per step
    (1, 8, 1),
    (1, 2, 4),
    (2, 4, 1),
    (2, 1, 4),
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lines = (REPO / "data" / "text.jsonl").read_text().splitlines()[:N_EXAMPLES]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def reference(tiny_model, texts) -> dict[str, torch.Tensor]:
    """Parameters after one SGD(lr=1) step on the mean token loss of all examples, in plain PyTorch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    return {name: (p - p.grad).detach() for name, p in model.named_parameters()}


def one_sgd_step(tmp_path, tiny_model, texts, processes, batch, accum, *extra):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    # 2 processes through `accelerate launch` (cpu_ddp), 1 process without the launcher (nothing of it is tested here)
    runner = partial(launch, preset="cpu_ddp") if processes > 1 else run_script
    run = runner(
        tmp_path / f"out-{processes}x{batch}x{accum}", *extra,
        "--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--validation_split_percentage", "0",
        "--max_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
        "--max_grad_norm", "0", "--weight_decay", "0", "--train_sampling_strategy", "sequential",
        "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accum),
    )
    info = run.state()["launch"]
    assert info["num_processes"] == processes
    assert info["distributed_type"] == ("MULTI_CPU" if processes > 1 else "NO")
    assert info["model_wrapper"] == ("DistributedDataParallel" if processes > 1 else "CausalLMTokenLoss")
    compiled_layers = 2 if "--torch_compile" in extra else 0  # the tiny model has 2 decoder layers
    assert run.state()["model"]["compiled_blocks"] == compiled_layers
    if compiled_layers:  # the start-up lines say so, and how long the first step took, compiling
        assert "; compile on (2 blocks, mode default, dynamic shapes;" in run.stdout
        assert "hftrain: compile: step 1 took " in run.stdout and "compiling 2 blocks' forward and backward" in \
            run.stdout
    return load_file(run.output_dir / "final" / "model.safetensors")


@pytest.mark.parametrize("processes, batch, accum", LAYOUTS)
def test_one_step_equals_plain_pytorch(tmp_path, tiny_model, texts, reference, processes, batch, accum):
    params = one_sgd_step(tmp_path, tiny_model, texts, processes, batch, accum)
    assert params.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("processes, batch, accum", [(1, 2, 4), (2, 1, 4)])
def test_compiled_step_equals_plain_pytorch(tmp_path, tiny_model, texts, reference, processes, batch, accum):
    """torch_compile (inductor, each decoder layer in place, dynamic shapes) computes the same step over
    micro-batches of different lengths, and DDP's gradient hooks see the compiled layers' parameters."""
    params = one_sgd_step(tmp_path, tiny_model, texts, processes, batch, accum, "--torch_compile", "true")
    assert params.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=2e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_reference_is_sharp_enough_to_catch_per_micro_batch_averaging(tiny_model, texts, reference):
    """The naive loop (mean loss per micro-batch, averaged over micro-batches) gives a different step.

    Without this, the tolerance above could be loose enough to pass a wrong normalisation.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    for pair in (texts[i:i + 2] for i in range(0, N_EXAMPLES, 2)):
        enc = tokenizer([t + tokenizer.eos_token for t in pair], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        (model(**enc, labels=labels).loss / 4).backward()
    worst = max((reference[n] - (p - p.grad)).abs().max().item() for n, p in model.named_parameters())
    assert worst > 1e-4


def test_fsdp2_bf16_step_loss_is_the_fp32_sum_of_bf16_logits(tmp_path, tiny_model, texts):
    """FSDP2 with bf16 computes in bf16 parameters; the loop must still get the fp32 token-loss sum. accelerate casts
    every FSDP unit's outputs to bf16, the root (hftrain's loss module) included, which rounded the loss sum to 8
    significant bits: a logged loss 3e-3 off and the backward scaled by a rounded factor. Reference: the HF model cast
    to bf16, its own mean cross-entropy over one padded batch of the step's 8 examples (observed agreement ~2e-6)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import FSDP_LAUNCHER

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).to(torch.bfloat16)
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        expected = float(model(input_ids=input_ids, attention_mask=attention_mask,
                               labels=input_ids.masked_fill(attention_mask == 0, -100)).loss)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    run = launch(tmp_path / "out", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
                 "--validation_split_percentage", "0", "--max_steps", "1", "--logging_steps", "1", "--bf16",
                 "--train_sampling_strategy", "sequential", "--per_device_train_batch_size", "4",
                 preset="fsdp2", processes=2, script=FSDP_LAUNCHER)
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["model_wrapper"], info["mixed_precision"]) == \
        ("FSDP", 2, "FSDPCausalLMTokenLoss", "bf16")
    (row,) = run.train_rows()
    assert row["loss"] == pytest.approx(expected, rel=1e-4)
