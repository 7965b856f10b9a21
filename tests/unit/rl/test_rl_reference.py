"""The reference of beta > 0 (hftrain.objectives.grpo.build_token_reference) against plain transformers on the same
tokens: for LoRA the policy with its adapters disabled, for full fine-tuning a frozen copy of the starting model;
both give the starting model's log-probs of the next tokens from logits / temperature, whatever the policy
has become."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hftrain.objectives.grpo import build_token_reference
from hftrain.objectives.reference import AdapterReference, FrozenReference
from tests.conftest import REPO

TINY = REPO / "models" / "tiny-llama"
RECIPE = SimpleNamespace(beta=0.04, temperature=0.7)


def load():
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


@torch.no_grad()
def plain_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1] / RECIPE.temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_references_give_the_starting_models_log_probs():
    torch.manual_seed(0)
    ids = torch.randint(0, 700, (2, 12))
    start = plain_log_probs(load(), ids)

    # LoRA: random A and B (init_lora_weights False), so the adapters change what the policy predicts
    policy = get_peft_model(load(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    reference = build_token_reference(RECIPE, policy, torch.device("cpu"))
    assert isinstance(reference, AdapterReference)
    with_adapters = plain_log_probs(policy, ids)
    assert (with_adapters - start).abs().max() > 1e-3
    torch.testing.assert_close(reference.log_probs(ids), start, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain_log_probs(policy, ids), with_adapters)  # the adapters are on again

    # full fine-tuning: a frozen copy, unchanged when the policy's weights move
    policy = load()
    reference = build_token_reference(RECIPE, policy, torch.device("cpu"))
    assert isinstance(reference, FrozenReference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (plain_log_probs(policy, ids) - start).abs().max() > 1e-3
    torch.testing.assert_close(reference.log_probs(ids), start, rtol=1e-5, atol=1e-6)
    assert build_token_reference(SimpleNamespace(beta=0.0, temperature=1.0), policy, torch.device("cpu")) is None
