"""qat_scheme (torchao): the prepared model's forward against torchao's quantization primitives applied by hand to
the same weights, the converted model against the prepared one, the converted folder as transformers loads it, and
the recipes refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hftrain import qat
from hftrain.config import Recipe, validate
from hftrain.parallel.launch import Launch
from hftrain.preflight import missing_extra_problems
from tests.conftest import REPO

with qat.quiet_torchao():
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

SCHEMES = ("int4_weight_only", "int8_dynamic_activation_int4_weight")
GROUP = 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def int4_groups(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 in groups of GROUP input features, through torchao's public primitives."""
    block = (1, GROUP)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, quant_min=-8, quant_max=7,
                                        eps=torch.finfo(w.dtype).smallest_normal, scale_dtype=torch.float32,
                                        zero_point_dtype=torch.float32)
    q = quantize_affine(w, block, scale, zero, torch.int8, quant_min=-8, quant_max=7)
    assert q.min() >= -8 and q.max() <= 7
    return dequantize_affine(q, block, scale, zero, torch.int8, quant_min=-8, quant_max=7, output_dtype=w.dtype)


def int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int8 per token (the last dimension), through torchao's public primitives."""
    block = (*[1] * (x.dim() - 1), x.shape[-1])
    scale, zero = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, quant_min=-128, quant_max=127,
                                        scale_dtype=torch.float32, zero_point_dtype=torch.int32)
    q = quantize_affine(x, block, scale, zero, torch.int8, quant_min=-128, quant_max=127)
    return dequantize_affine(q, block, scale, zero, torch.int8, quant_min=-128, quant_max=127, output_dtype=x.dtype)


class ReferenceLinear(nn.Module):
    def __init__(self, linear: nn.Linear, activations: bool) -> None:
        super().__init__()
        self.linear, self.activations = linear, activations

    def forward(self, x):
        return F.linear(int8_tokens(x) if self.activations else x, int4_groups(self.linear.weight), self.linear.bias)


def by_hand(model: LlamaForCausalLM, scheme: str) -> LlamaForCausalLM:
    """`model` with every decoder linear layer (not the head) computing from torchao's primitives directly."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, ReferenceLinear(child, scheme != "int4_weight_only"))
    return model


def recipe(scheme: str) -> Recipe:
    return Recipe(qat_scheme=scheme, qat_group_size=GROUP)


IDS = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepared_forward_equals_torchaos_primitives_on_the_same_weights(scheme):
    model = tiny_llama()
    prepared = copy.deepcopy(model)
    note = qat.prepare(prepared, recipe(scheme))
    assert note.startswith(f"qat {scheme} (torchao, int4 weight groups of 16): 14 linear layers fake-quantized")
    assert type(prepared.lm_head) is nn.Linear  # the head stays in full precision
    expected = by_hand(model, scheme)(IDS).logits
    got = prepared(IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (got - model(IDS).logits).abs().max() > 1e-3  # the quantization is visible: the comparison can fail
    # gradients flow to the full-precision weights through the rounding (straight-through)
    prepared(input_ids=IDS, labels=IDS).loss.backward()
    assert prepared.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_torchaos_fake_quantizers_keep_no_state_between_steps(scheme):
    """What a resume must restore: torchao keeps the last scales it computed on each FakeQuantizer (plain attributes,
    not in the state dict), and reuses them unless its config is dynamic. Here every one is dynamic without range
    learning, the prepared model's state dict is the plain model's, and after the weights move (a step) the prepared
    model computes what a model prepared afresh from the moved weights computes (torchao's primitives by hand), not
    the scales of its earlier forward: the checkpoint's weights are the whole state."""
    prepared = tiny_llama()
    plain_keys = set(prepared.state_dict())
    qat.prepare(prepared, recipe(scheme))
    quantizers = [m for m in prepared.modules() if type(m).__name__ == "IntxFakeQuantizer"]
    assert len(quantizers) == 14 * (1 if scheme == "int4_weight_only" else 2)
    assert all(q.config.is_dynamic and not q.config.range_learning for q in quantizers)
    assert set(prepared.state_dict()) == plain_keys
    prepared(IDS)  # the quantizers now hold this forward's scales
    with torch.no_grad():
        for p in prepared.parameters():
            p.mul_(1.5).add_(torch.randn_like(p) * 0.01)
    torch.testing.assert_close(prepared(IDS).logits, by_hand(prepared, scheme)(IDS).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_converted_model_computes_what_the_fake_quantized_one_did(scheme):
    prepared = tiny_llama()
    qat.prepare(prepared, recipe(scheme))
    with torch.no_grad():  # a trained-looking model: weights away from their initial values
        for p in prepared.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    converted = qat.convert(copy.deepcopy(prepared), recipe(scheme))
    weight = converted.model.layers[1].self_attn.o_proj.weight
    assert isinstance(weight, IntxUnpackedToInt8Tensor) and weight.qdata.min() >= -8 and weight.qdata.max() <= 7
    torch.testing.assert_close(converted(IDS).logits, prepared(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_quantized_folder_loads_with_transformers_as_torchaos_convert_step(tmp_path, scheme):
    """final/ (the prepared model saved as hftrain saves it) -> final-quantized/: AutoModelForCausalLM loads it with
    nothing but its config.json (TorchAoConfig inside), quantized, and computes what torchao's convert step does."""
    from transformers import AutoTokenizer

    prepared = tiny_llama()
    qat.prepare(prepared, recipe(scheme))
    prepared.save_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    folder = qat.save_quantized(recipe(scheme), tmp_path / "final", tmp_path / "final-quantized", tokenizer)
    assert not (tmp_path / ".tmp-final-quantized").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "torchao" and saved["quant_type"]["default"]["_type"] == (
        "IntxWeightOnlyConfig" if scheme == "int4_weight_only" else "Int8DynamicActivationIntxWeightConfig")
    assert isinstance(loaded.model.layers[0].mlp.down_proj.weight, IntxUnpackedToInt8Tensor)
    assert not isinstance(loaded.lm_head.weight, IntxUnpackedToInt8Tensor)
    converted = qat.convert(copy.deepcopy(prepared), recipe(scheme))
    torch.testing.assert_close(loaded(IDS).logits, converted(IDS).logits, rtol=0, atol=0)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # unconverted: a plain model, the same weights
    assert type(plain.model.layers[0].mlp.down_proj) is nn.Linear
    down = prepared.model.layers[0].mlp.down_proj
    torch.testing.assert_close(plain.model.layers[0].mlp.down_proj.weight, down.weight)


def problems(**values) -> list[str]:
    return validate(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), qat_scheme="int4_weight_only",
                           **values))


def test_recipes_qat_cannot_run_are_refused():
    assert problems() == []
    assert problems(use_peft=True) == []  # LoRA: tests/unit/test_qat_lora.py
    assert problems(qat_group_size=24) == ["qat_group_size must be a power of two >= 1, got 24"]
    (tp,) = problems(tp_size=2)
    assert tp.startswith("qat_scheme=int4_weight_only with tp_size=2 is refused")
    # final-quantized/ is final/ loaded as a causal LM: these objectives' final/ is not one (a run with embedding
    # gave a converted folder with a freshly drawn lm_head: transformers' load reported it MISSING)
    for objective, folder in (("embedding", "a sentence-transformers folder"), ("reranker", "a sentence-transformers "
                              "CrossEncoder folder"), ("reward", "a sequence classifier")):
        (refused,) = problems(objective=objective)
        assert refused.startswith(f"qat_scheme=int4_weight_only with objective {objective} is refused: "
                                  "final-quantized/ is final/ loaded as a causal LM"), objective
        assert f"this objective's final/ is {folder}" in refused, objective


def test_the_preflight_refuses_uneven_groups():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")  # hidden 64, intermediate 128, 4 x 16 heads
    r = Recipe(qat_scheme="int8_dynamic_activation_int4_weight", qat_group_size=128)
    (uneven,) = qat.preflight_problems(r, config)
    assert uneven.startswith("qat_group_size=128 does not divide the input size of this model's linear layers "
                             "(hidden_size 64, num_attention_heads x head_dim 64)")
    assert qat.preflight_problems(Recipe(qat_scheme="int4_weight_only", qat_group_size=32), config) == []
    assert qat.preflight_problems(Recipe(), config) == []


def test_a_missing_torchao_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert missing_extra_problems(Recipe(qat_scheme="int4_weight_only"), Launch("single", 1, 1)) == [
        "qat_scheme=int4_weight_only needs the torchao package, which is not installed: pip install 'hftrain[qat]' "
        "(or pip install torchao)"]


def label_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-prob of its own next tokens, in plain PyTorch."""
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].sum(-1)


def test_dpos_reference_computes_through_the_same_fake_quantization_as_the_policy():
    """objective dpo with qat_scheme: the frozen reference is a copy of the prepared starting model, so the policy and
    the reference start equal (step 1's loss ln 2, as without QAT), not the unquantized model against a quantized
    policy."""
    from hftrain.objectives.reference import build_reference

    model = tiny_llama()
    plain = copy.deepcopy(model)
    qat.prepare(model, recipe("int8_dynamic_activation_int4_weight"))
    reference = build_reference(Recipe(objective="dpo"), model, torch.device("cpu"))
    got = reference.log_probs(IDS, IDS.clone())
    torch.testing.assert_close(got.float(), label_log_probs(model, IDS), rtol=1e-5, atol=1e-4)
    assert (got.float() - label_log_probs(plain, IDS)).abs().max() > 1e-3
