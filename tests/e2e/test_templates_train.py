"""Qwen3 (reasoning stripped from past turns), Phi-3 (EOS only at the end) and a Mixtral under Mistral's template
train with assistant-only loss under their own templates, and the step-1 loss equals plain PyTorch (issue 14).

The reference is computed here from the independent renderers of tests/unit/test_chat_templates.py: the
tokens of each expected example, its trained tokens, the HF model's logits and `torch.nn.functional.cross_entropy`
summed over every trained token of the step and divided by their number. Nothing of hftrain's data, collator or
loss code is used.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MixtralConfig, Phi3Config, Qwen3Config

from tests.conftest import run_script, write_jsonl
from tests.unit.test_chat_templates import FAMILIES, SYSTEM, THINKING, TURNS, expected_rows, family_tokenizer

pytestmark = pytest.mark.launch
CONVERSATIONS = {"qwen3": [THINKING, [SYSTEM, *THINKING]], "phi3": [[SYSTEM, *TURNS], TURNS[:4]],
                 "mistral-v3": [TURNS, TURNS[:4]]}


def tiny_model(name: str, tokenizer, folder):
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                 tie_word_embeddings=False)
    config = {"qwen3": lambda: Qwen3Config(head_dim=8, **shape), "phi3": lambda: Phi3Config(**shape),
              "mistral-v3": lambda: MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)}[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name, policy", [("qwen3", "all"), ("qwen3", "last"), ("phi3", "all"), ("phi3", "last"),
                                          ("mistral-v3", "all")])
def test_step_one_loss_equals_plain_pytorch(tmp_path, name, policy):
    family = FAMILIES[name]
    tokenizer = family_tokenizer(family)
    model = tiny_model(name, tokenizer, tmp_path / "model")
    rows = [row for messages in CONVERSATIONS[name] for row in expected_rows(family, tokenizer, messages, policy)]
    if name == "qwen3":  # the policies differ: `all` trains every turn in its own context, `last` the final one
        assert len(rows) == (4 if policy == "all" else 2)
    else:  # Phi-3 and Mistral render past turns unchanged: one example per conversation
        assert len(rows) == 2
    with torch.no_grad():
        total, count = 0.0, 0
        for ids, labels in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            target = torch.tensor(labels[1:])
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    loss = total / count
    if name == "mistral-v3":  # a Mixtral under its family's template: + router_aux_loss_coef x the model's own aux
        width = max(len(ids) for ids, _ in rows)
        padded = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        with torch.no_grad():
            aux = model(input_ids=padded, attention_mask=mask, output_router_logits=True).aux_loss.item()
        loss += model.config.router_aux_loss_coef * aux
        assert model.config.router_aux_loss_coef == 0.001 and aux > 0
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS[name]])
    run = run_script(
        tmp_path / "out", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(data),
        "--train_on_turns", policy, "--validation_split_percentage", "0", "--max_steps", "1",
        "--per_device_train_batch_size", str(len(rows)), "--train_sampling_strategy", "sequential",
        "--packing", "false", "--dtype", "float32",
    )
    (first,) = run.train_rows()
    assert first["trained_tokens"] == count
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
