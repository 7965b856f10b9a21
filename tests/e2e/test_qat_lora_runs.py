"""qat_scheme with LoRA through the real entry script: one SGD step of the adapters equals plain PyTorch on the same
rows (the frozen base's linear layers int4-rounded by torchao's primitives, the adapters' path in full precision), and
final-quantized/ holds the base with the adapter merged, then rounded to int4: within one rounding of what training
computed. 2 DDP processes and 2 ZeRO-3 processes equal one over 3 steps (adapters and converted model), and a run
resumed from checkpoint-2 equals the uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain import qat
from tests.conftest import REPO, Run, launch, run_script, write_jsonl
from tests.e2e import objective_checks as checks
from tests.e2e.test_qat_runs import assert_same_conversion

with qat.quiet_torchao():
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

pytestmark = pytest.mark.launch
# ---------------------------------------------------------------------------------------------- QAT with LoRA
# recipes/tiny-qat-lora.yaml (LoRA r 16, alpha 32, dropout 0, int4_weight_only in groups of 32) on 8 text rows
RECIPE = ["--config", str(REPO / "recipes" / "tiny-qat-lora.yaml"), "--assistant_only_loss", "false",
          "--warmup_steps", "0"]
SCALING = 32 / 16  # lora_alpha / lora_r
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int4 rounding of `w`, each element's rounding step): symmetric int4 per group of `group` input features,
    through torchao's public primitives."""
    block = (1, group)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, quant_min=-8, quant_max=7,
                                        eps=torch.finfo(w.dtype).smallest_normal, scale_dtype=torch.float32,
                                        zero_point_dtype=torch.float32)
    q = quantize_affine(w, block, scale, zero, torch.int8, quant_min=-8, quant_max=7)
    rounded = dequantize_affine(q, block, scale, zero, torch.int8, quant_min=-8, quant_max=7, output_dtype=w.dtype)
    return rounded, scale.reshape(w.shape[0], -1).repeat_interleave(group, dim=1)


class HandLoRA(nn.Module):
    def __init__(self, linear: nn.Linear, a: torch.Tensor, b: torch.Tensor, quantize: bool) -> None:
        super().__init__()
        self.weight = int4(linear.weight.detach())[0] if quantize else linear.weight.detach()
        self.a, self.b = a, b

    def forward(self, x):
        return F.linear(x, self.weight) + SCALING * F.linear(F.linear(x, self.a), self.b)


def adapter_key(layer: int, linear: str, part: str) -> str:
    return f"base_model.model.model.layers.{layer}.{linear}.{part}.weight"


def lora_b_after_one_sgd_step(model_dir, texts: list[str], adapter: dict, quantize: bool) -> dict:
    """lora_B after one SGD(lr=1) step from B = 0 on the mean token loss of the 8 rows, in plain PyTorch: the HF
    model's own loss, every decoder linear layer computing int4-rounded W (torchao's primitives, or W itself) plus
    scaling x B A x. From B = 0, A's gradient is 0: the saved A is the initial A."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bs = {}
    for i, layer in enumerate(model.model.layers):
        for linear in LINEARS:
            parent, name = layer.get_submodule(linear.split(".")[0]), linear.split(".")[1]
            a = adapter[adapter_key(i, linear, "lora_A")]
            b = torch.zeros(getattr(parent, name).out_features, a.shape[0], requires_grad=True)
            bs[adapter_key(i, linear, "lora_B")] = b
            setattr(parent, name, HandLoRA(getattr(parent, name), a, b, quantize))
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    return {name: -b.grad for name, b in bs.items()}


@pytest.fixture(scope="module")
def lora_step(tmp_path_factory, tiny_model):
    """One SGD(lr=1) step of QAT + LoRA through the entry script on 8 text rows in one batch."""
    texts = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()[:8]]
    tmp = tmp_path_factory.mktemp("qat-lora")
    data = write_jsonl(tmp / "text.jsonl", [{"text": t} for t in texts])
    run = run_script(tmp / "out", *RECIPE, "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
                     "--validation_split_percentage", "0", "--max_steps", "1", "--optim", "sgd", "--learning_rate",
                     "1.0", "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0",
                     "--train_sampling_strategy", "sequential", "--per_device_train_batch_size", "8")
    return run, texts, load_file(run.output_dir / "final" / "adapter_model.safetensors")


def test_qat_lora_step_equals_plain_pytorch(lora_step, tiny_model):
    run, texts, adapter = lora_step
    said = " ".join(run.stdout.split())
    assert ("qat int4_weight_only (torchao, int4 weight groups of 32): 14 frozen base linear layers fake-quantized "
            "(the LoRA adapters in full precision)") in said
    expected = lora_b_after_one_sgd_step(tiny_model, texts, adapter, quantize=True)
    for name, b in expected.items():
        torch.testing.assert_close(adapter[name], b, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # sharp enough: the same step without the fake quantization moves B visibly elsewhere
    plain = lora_b_after_one_sgd_step(tiny_model, texts, adapter, quantize=False)
    assert max((plain[n] - expected[n]).abs().max() for n in expected) > 1e-3


def test_qat_lora_converts_the_merged_weights_within_one_rounding_of_the_trained_function(lora_step, tiny_model):
    """final-quantized/ (from its config.json alone) holds int4(W + scaling B A): torchao's rounding of the merged
    weight, and so within half a rounding step of W's and half of the merged weight's from what training computed,
    int4(W) + scaling B A."""
    run, _, adapter = lora_step
    assert f"quantized model (int4_weight_only, torchao) saved to {run.output_dir / 'final-quantized'}" in \
        " ".join(run.stdout.split())
    loaded = AutoModelForCausalLM.from_pretrained(run.output_dir / "final-quantized")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert type(loaded.lm_head.weight) is nn.Parameter and torch.equal(loaded.lm_head.weight, base.lm_head.weight)
    moved = 0
    for i, layer in enumerate(base.model.layers):
        for linear in LINEARS:
            w = layer.get_submodule(linear).weight.detach()
            delta = SCALING * (adapter[adapter_key(i, linear, "lora_B")] @ adapter[adapter_key(i, linear, "lora_A")])
            served = loaded.model.layers[i].get_submodule(linear).weight
            assert type(served).__name__ == "IntxUnpackedToInt8Tensor"
            merged, merged_step = int4(w + delta)
            torch.testing.assert_close(served.dequantize(), merged, rtol=1e-5, atol=1e-7)
            trained, step = int4(w)
            assert ((served.dequantize() - (trained + delta)).abs() <= (step + merged_step) / 2 + 1e-6).all()
            moved += int((served.dequantize() != trained).sum())
    assert moved > 0  # the merged adapter changed the rounding somewhere: the bound is not the trivial one


# ---------------------------------------------------------------------------------------------- layouts and resume
# recipes/tiny-qat-lora.yaml, 3 AdamW steps of 8 chat rows in file order, a checkpoint at step 2. The base is frozen
# and int4_weight_only rounds no activation, so the fake-quantized base is the same in every layout and at every step:
# unlike full fine-tuning (tests/e2e/test_qat_runs.py), the runs stay equal past the first step.
EXACT = ["--config", str(REPO / "recipes" / "tiny-qat-lora.yaml"), "--max_steps", "3", "--logging_steps", "1",
         "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--save_steps", "2",
         "--warmup_steps", "1"]
COMPARED = ("loss", "grad_norm")
ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("qat-lora-3") / "out", *EXACT, "--per_device_train_batch_size", "8")


def merged_weights(run: Run) -> dict[str, torch.Tensor]:
    """What the run's final-quantized/ converted, computed here: each base weight W + scaling x B A of the adapter."""
    adapter = load_file(run.output_dir / "final" / ADAPTER)
    merged = {}
    for name, w in AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama").state_dict().items():
        a = adapter.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        b = adapter.get(f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight")
        merged[name] = w if a is None else w + SCALING * (b @ a)
    return merged


def test_qat_lora_two_ddp_processes_and_two_zero3_processes_equal_one(tmp_path, three_steps):
    """2 processes x 4 rows = 1 process x 8 rows for 3 steps: losses, gradient norms, the adapter (rtol 1e-4) and
    the converted model; under ZeRO-3 each decoder layer's base weights are gathered whole before its forward, so
    torchao's fake quantization sees what one process sees."""
    expected = merged_weights(three_steps)
    for preset, wrapper in (("cpu_ddp", "DistributedDataParallel"), ("zero3", "DeepSpeedEngine")):
        run = launch(tmp_path / preset, *EXACT, "--per_device_train_batch_size", "4", preset=preset, processes=2)
        info = run.state()["launch"]
        assert (info["num_processes"], info["model_wrapper"]) == (2, wrapper), preset
        checks.assert_same_steps(run, three_steps, COMPARED, weights=ADAPTER)
        assert_same_conversion(run, three_steps, expected)


def test_qat_lora_resumes_exactly_to_the_same_converted_model(tmp_path, three_steps):
    resumed = checks.assert_resumes_exactly(tmp_path, three_steps, [*EXACT, "--per_device_train_batch_size", "8"],
                                            COMPARED, weights=ADAPTER)
    assert assert_same_conversion(resumed, three_steps, merged_weights(three_steps), boundary=0) == 0
