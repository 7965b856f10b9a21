"""Mixture-of-experts (issue 14 item 3): LoRA with the default recipe, the router load-balancing loss with HF's
own value as the reference, and compute counted with active parameters."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.config import Recipe, validate
from hftrain.data import IGNORE_INDEX, Collator
from hftrain.errors import HftrainError
from hftrain.estimate import model_shape
from hftrain.metrics import FlopCounter
from hftrain.model import build_peft_model
from hftrain.objectives.sft import CausalLMTokenLoss
from hftrain.preflight import model_problems
from hftrain.router_loss import router_loss
from tests.conftest import REPO

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=1027, max_position_embeddings=512, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                  **SHAPE),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                     intermediate_size=32, decoder_sparse_step=1, **SHAPE),
}


def tiny(kind: str, **overrides):
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    tiny(request.param).save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama").save_pretrained(folder)
    return folder


def batch(packed: bool = False) -> dict:
    """Rows of different lengths (right padding), prompt tokens untrained; optionally packed two per row."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (9, 5, 7, 3):
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    collator = Collator(datasets.Dataset.from_list(rows), 1026, [[0, 1], [2, 3]] if packed else None, packed)
    collator.mark_real_tokens = True
    out = collator([0, 1] if packed else [0, 1, 2, 3])
    out.pop("num_examples")
    return out


def token_loss(lm, coef: float | None = None, scope: str = "micro_batch") -> CausalLMTokenLoss:
    """sft's loss module with the model's router loss composed onto it, as `objectives.sft.SFT.build_loss` builds it
    (`coef` None: the model config's coefficient)."""
    return CausalLMTokenLoss(lm, router=router_loss(lm, coef, scope))


def pop_aux(wrapped: CausalLMTokenLoss) -> torch.Tensor:
    """The router loss's summed aux x trained tokens since the last call, in the model's dtype."""
    return wrapped.pop_token_stats()["aux_loss"].float()


def hf_loss(lm, b: dict) -> torch.Tensor:
    """The model's own loss: mean token cross-entropy + router_aux_loss_coef x aux over the attended tokens."""
    return lm(input_ids=b["input_ids"], attention_mask=b["real_tokens"].long(), labels=b["labels"],
              output_router_logits=True).loss


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_step_loss_with_router_loss_equals_the_models_own(kind):
    lm = tiny(kind, router_aux_loss_coef=0.5)  # a coefficient that makes the aux term count in the comparison
    b = batch()
    assert not b["real_tokens"].all(), "the batch must hold padding, which the router statistics exclude"
    tokens = (b["labels"][:, 1:] != IGNORE_INDEX).sum()
    wrapped = token_loss(lm).train()
    assert wrapped.router.coef == 0.5
    mine = wrapped(**b) / tokens
    torch.testing.assert_close(mine, hf_loss(lm, b), rtol=1e-5, atol=1e-6)
    aux = pop_aux(wrapped) / tokens
    without = token_loss(lm, 0.0).train()(**b) / tokens
    assert without.item() == pytest.approx(mine.item() - 0.5 * aux.item(), rel=1e-5) and aux > 0
    assert token_loss(lm).eval()(**b).item() == pytest.approx(without.item() * tokens.item(), rel=1e-5)


def test_accumulated_micro_batches_weight_each_aux_by_its_trained_tokens():
    """2 x b accumulation: the cross-entropy equals one batch of 2b exactly; the router loss of the step is the
    token-weighted mean of the micro-batches' own aux losses (HF's, each over its own tokens): the aux is a product
    of two per-batch means, so no split of a batch reproduces the whole batch's value."""
    lm = tiny("mixtral", router_aux_loss_coef=0.5)
    whole = batch()
    halves = [{k: v[i:i + 2] for k, v in whole.items()} for i in (0, 2)]
    wrapped = token_loss(lm).train()
    total = sum((wrapped(**h) for h in halves), torch.zeros(()))
    tokens = [(h["labels"][:, 1:] != IGNORE_INDEX).sum() for h in halves]
    plain = token_loss(lm, 0.0).train()(**whole)
    aux = [lm(input_ids=h["input_ids"], attention_mask=h["real_tokens"].long(), output_router_logits=True).aux_loss
           for h in halves]
    expected = (plain + 0.5 * sum(a * n for a, n in zip(aux, tokens))) / sum(tokens)
    torch.testing.assert_close(total / sum(tokens), expected, rtol=1e-5, atol=1e-6)


def grads_of(lm, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    lm.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_step_scope_makes_accumulation_equal_one_batch_and_the_models_own_aux(kind):
    """router_aux_loss_scope step: 2 x b accumulation has the value and the gradients of one batch of 2b, whose loss
    and aux are the model's own outputs.loss and outputs.aux_loss (HF computes them on the whole batch)."""
    lm = tiny(kind, router_aux_loss_coef=0.5)
    whole = batch()
    halves = [{k: v[i:i + 2] for k, v in whole.items()} for i in (0, 2)]
    tokens = (whole["labels"][:, 1:] != IGNORE_INDEX).sum()
    wrapped = token_loss(lm, scope="step").train()
    one_process = lambda t: t  # noqa: E731 - the all-reduce of a single rank

    wrapped.prepare_step(wrapped, [whole], one_process)
    one = wrapped(**whole) / tokens
    one_aux = pop_aux(wrapped) / tokens
    one_grads = grads_of(lm, one)
    wrapped.prepare_step(wrapped, halves, one_process)
    accumulated = sum((wrapped(**h) for h in halves), torch.zeros(())) / tokens
    accumulated_aux = pop_aux(wrapped) / tokens
    accumulated_grads = grads_of(lm, accumulated)

    hf = lm(input_ids=whole["input_ids"], attention_mask=whole["real_tokens"].long(), labels=whole["labels"],
            output_router_logits=True)
    torch.testing.assert_close(one, hf.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one_aux, hf.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(accumulated, hf.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(accumulated_aux, hf.aux_loss, rtol=1e-5, atol=1e-6)
    assert one_grads.keys() == accumulated_grads.keys() and any("gate" in n for n in one_grads)
    for name, grad in one_grads.items():
        torch.testing.assert_close(accumulated_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    micro = token_loss(lm).train()  # the default scope: each half's own aux, not the whole batch's
    per_half = sum((micro(**h) for h in halves), torch.zeros(())) / tokens
    assert abs(per_half.item() - hf.loss.item()) > 1e-6


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_step_scope_routing_pass_routes_like_the_training_forward_under_dropout(kind):
    """With dropout the routing depends on the random draws: the routing pass restores the random state, so the
    training forward routes as it would have without the pass (its aux is HF's own from the same seed; another seed
    routes differently)."""
    lm = tiny(kind, router_aux_loss_coef=0.5, attention_dropout=0.3)
    b = batch()
    tokens = (b["labels"][:, 1:] != IGNORE_INDEX).sum()
    wrapped = token_loss(lm, scope="step").train()
    torch.manual_seed(5)
    wrapped.prepare_step(wrapped, [b], lambda t: t)
    wrapped(**b)
    hf = {}
    for seed in (5, 6):
        torch.manual_seed(seed)
        hf[seed] = lm(input_ids=b["input_ids"], attention_mask=b["real_tokens"].long(), output_router_logits=True)
    assert (pop_aux(wrapped) / tokens).item() == pytest.approx(hf[5].aux_loss.item(), rel=1e-6)
    assert hf[6].aux_loss.item() != pytest.approx(hf[5].aux_loss.item(), rel=1e-6)


def test_step_scope_needs_the_routing_pass_and_a_router_loss():
    lm = tiny("mixtral", router_aux_loss_coef=0.5)
    with pytest.raises(HftrainError, match="prepare_step"):
        token_loss(lm, scope="step").train()(**batch())
    with pytest.raises(HftrainError, match="remove router_aux_loss_scope"):
        token_loss(lm, 0.0, "step")
    llama = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    with pytest.raises(HftrainError, match="remove router_aux_loss_scope"):
        token_loss(llama, scope="step")


def test_step_scope_is_refused_before_the_run_where_there_is_no_router_loss(saved):
    """config.validate: a coefficient of 0 or a preference objective; preflight (the model's config): a dense model,
    or a mixture-of-experts model whose own coefficient is 0. Each message names router_aux_loss_scope."""
    problems = validate(Recipe(router_aux_loss_scope="step", router_aux_loss_coef=0.0))
    assert any("router_aux_loss_coef=0.0" in p and "remove router_aux_loss_scope" in p for p in problems)
    assert any("objective=dpo" in p for p in validate(Recipe(router_aux_loss_scope="step", objective="dpo")))
    assert not [p for p in validate(Recipe(router_aux_loss_scope="step")) if "router_aux_loss_scope" in p]
    dense = model_problems(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), max_length=32,
                                  router_aux_loss_scope="step"))[1]
    assert any("remove router_aux_loss_scope" in p for p in dense)
    assert model_problems(Recipe(model_name_or_path=str(saved), max_length=32, router_aux_loss_scope="step"))[1] == []
    off = Recipe(model_name_or_path=str(saved), max_length=32, router_aux_loss_scope="step", router_aux_loss_coef=0.0)
    assert any("remove router_aux_loss_scope" in p for p in model_problems(off)[1])


def test_packed_rows_count_router_statistics_per_real_token():
    """A packed row (two examples, then padding) routes the same real tokens as those examples unpacked."""
    lm = tiny("mixtral", router_aux_loss_coef=0.5)
    packed, flat = batch(packed=True), batch()
    assert packed["real_tokens"].sum() == flat["real_tokens"].sum()
    wrapped = token_loss(lm).train()
    wrapped(**packed)
    pop_aux(wrapped)
    logits = lm(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                output_router_logits=True).router_logits
    mask = packed["real_tokens"].reshape(-1)
    reference = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
        tuple(layer[mask] for layer in logits), 4, 2)  # only the real tokens' routing, no mask needed
    assert wrapped.router.aux_fn(logits, packed["real_tokens"]).item() == pytest.approx(reference.item(), rel=1e-5)


def test_router_loss_on_a_dense_model_is_refused():
    llama = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    assert router_loss(llama, None) is None
    with pytest.raises(HftrainError, match="not a mixture-of-experts model"):
        token_loss(llama, 0.01)


def test_default_lora_recipe_adapts_experts_with_dropout_chosen_and_said(saved):
    recipe = Recipe(model_name_or_path=str(saved), use_peft=True)  # all-linear, lora_dropout 0.05
    model = build_peft_model(recipe)
    assert model.peft_config["default"].lora_dropout == 0.0
    (note,) = model.hftrain_notes
    assert "lora_dropout 0.05 -> 0" in note and "ParamWrapper" in note
    adapted = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in adapted) and any("q_proj" in n for n in adapted)
    loss = token_loss(model).train()(**batch())
    loss.backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if p.requires_grad and "experts" in name)
    named = build_peft_model(Recipe(model_name_or_path=str(saved), use_peft=True,
                                    lora_target_modules=["q_proj", "v_proj"]))
    assert named.peft_config["default"].lora_dropout == 0.05 and not named.hftrain_notes


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_flops_and_estimate_use_active_parameters(kind, tmp_path):
    """Counted from the config by hand: attention, router, norms and head in full; k of the experts per token."""
    lm = tiny(kind)
    c = lm.config
    h, kv, layers = c.hidden_size, c.num_key_value_heads * c.head_dim, c.num_hidden_layers
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    expert_width = c.intermediate_size if kind == "mixtral" else c.moe_intermediate_size
    attention = 2 * h * (c.num_attention_heads * c.head_dim) + 2 * h * kv + (2 * c.head_dim if kind == "qwen3_moe"
                                                                             else 0)
    per_layer = attention + experts * h + 2 * h  # + router + two norms
    active = layers * (per_layer + c.num_experts_per_tok * 3 * h * expert_width) + h + c.vocab_size * h
    total = layers * (per_layer + experts * 3 * h * expert_width) + h + c.vocab_size * h
    assert lm.num_parameters(exclude_embeddings=True) == total
    counter = FlopCounter(lm)
    assert counter.matmul_params == counter.trainable_matmul_params == active
    assert counter.per_token == 6 * active
    lm.save_pretrained(tmp_path)
    assert model_shape(str(tmp_path)).active_params == active + c.vocab_size * h  # embeddings: parameters too
