"""qat_scheme with LoRA (peft): the frozen base's linear layers are fake-quantized as torchao's prepare step does it,
inside peft's adapted layers, and the adapters are not: the forward against torchao's quantization primitives and
the LoRA formula written out by hand on the same weights, and which parameters train."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn import functional as F

from hftrain import qat
from hftrain.config import Recipe, validate
from tests.conftest import REPO
from tests.unit.test_qat import GROUP, IDS, SCHEMES, int4_groups, int8_tokens, tiny_llama

with qat.quiet_torchao():
    from torchao.quantization.qat import FakeQuantizedLinear

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]  # k_proj, o_proj and gate_proj get no adapter


def lora_llama():
    """The tiny Llama with LoRA adapters whose B is drawn, not zero (init_lora_weights=False): the adapters' path
    contributes to the output from the start."""
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(tiny_llama(), config)


class HandLayer(nn.Module):
    """A decoder linear layer computed by hand: the base from torchao's primitives (int4 weight groups, int8 tokens),
    plus, where peft adapted it, scaling x B A x on the unquantized input."""

    def __init__(self, layer: nn.Module, activations: bool) -> None:
        super().__init__()
        base = layer.base_layer if hasattr(layer, "base_layer") else layer
        self.weight, self.bias, self.activations = base.weight, base.bias, activations
        self.adapter = (layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]) \
            if hasattr(layer, "lora_A") else None

    def forward(self, x):
        out = F.linear(int8_tokens(x) if self.activations else x, int4_groups(self.weight), self.bias)
        if self.adapter is not None:
            a, b, scaling = self.adapter
            out = out + scaling * F.linear(F.linear(x, a), b)
        return out


def by_hand(peft_model, scheme: str) -> nn.Module:
    """A copy of the causal LM inside `peft_model` whose every decoder linear layer is a HandLayer."""
    model = copy.deepcopy(peft_model).base_model.model
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) or hasattr(child, "base_layer"):
                    setattr(parent, name, HandLayer(child, scheme != "int4_weight_only"))
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_frozen_base_is_fake_quantized_under_full_precision_adapters(scheme):
    model = lora_llama()
    expected = by_hand(model, scheme)(input_ids=IDS).logits
    unquantized = model(input_ids=IDS).logits.detach()
    note = qat.prepare(model, Recipe(qat_scheme=scheme, qat_group_size=GROUP, use_peft=True))
    assert note.startswith(f"qat {scheme} (torchao, int4 weight groups of 16): 14 frozen base linear layers "
                           "fake-quantized (the LoRA adapters in full precision), the head and embeddings in full "
                           "precision; final/ the adapter, final-quantized/ the base with the adapter merged")
    layer = model.base_model.model.model.layers[0]
    assert type(layer.self_attn.q_proj.base_layer) is FakeQuantizedLinear  # adapted: its base inside peft's layer
    assert type(layer.self_attn.q_proj.lora_A["default"]) is nn.Linear  # the adapters stay plain
    assert type(layer.self_attn.k_proj) is FakeQuantizedLinear  # no adapter: fake-quantized all the same
    assert type(model.base_model.model.lm_head) is nn.Linear
    got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (got - unquantized).abs().max() > 1e-3  # the quantization is visible: the comparison can fail
    model(input_ids=IDS, labels=IDS).loss.backward()  # straight through the rounding to the adapters only
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad == {n for n, _ in model.named_parameters() if ".lora_" in n} and len(with_grad) == 16


def problems(**values) -> list[str]:
    return validate(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), qat_scheme="int4_weight_only",
                           use_peft=True, **values))


def test_lora_is_accepted_and_what_it_cannot_run_with_is_refused():
    assert problems() == []
    assert any(p.startswith("qat_scheme=int4_weight_only with use_dora is refused") for p in problems(use_dora=True))
    assert any(p.startswith("qat_scheme=int4_weight_only with load_in_4bit/load_in_8bit (QLoRA) is refused")
               for p in problems(load_in_4bit=True))
    (kept,) = problems(modules_to_save=["embed_tokens"])
    assert kept.startswith("qat_scheme=int4_weight_only with modules_to_save ['embed_tokens'] is refused")
