"""Preference losses against a plain-PyTorch computation written from the papers' formulas."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.objectives import (
    OBJECTIVES,
    PAIR_STATS,
    AdapterReference,
    FrozenReference,
    PreferenceLoss,
    build_loss,
    objective_for,
)
from hftrain.objectives.preference import Preference
from hftrain.objectives.reference import ReferenceLogProbs, summed_log_probs
from tests.conftest import REPO

VOCAB = 61


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def pair_batch(pairs: int, filler: bool = False) -> dict[str, torch.Tensor]:
    """2 x pairs rows (chosen, then rejected): a shared prompt per pair, completions of different lengths, right
    padding; with `filler`, one more pair with no trained token (an empty micro-batch's padding)."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for side in (0, 1):
        for p in range(pairs):
            prompt = 3 + p
            completion = 2 + (p + side) % 3
            ids = torch.randint(0, VOCAB, (prompt + completion,), generator=torch.Generator().manual_seed(10 * p))
            ids[prompt:] = torch.randint(0, VOCAB, (completion,), generator=gen)
            rows.append((ids, prompt))
    if filler:
        rows.insert(pairs, (torch.zeros(1, dtype=torch.long), 1))
        rows.append((torch.zeros(1, dtype=torch.long), 1))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for r, (ids, prompt) in enumerate(rows):
        input_ids[r, :len(ids)] = ids
        labels[r, prompt:len(ids)] = ids[prompt:]
    return {"input_ids": input_ids, "labels": labels}


def plain_log_probs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the completion tokens per row, from the full logits."""
    logits = model(input_ids=batch["input_ids"]).logits.float()[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    token = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * mask).sum(1), mask.sum(1)


def plain_loss(recipe: Recipe, policy, reference, batch):
    """(summed loss over real pairs, per-pair stats sums) written out pair by pair."""
    logps, lengths = plain_log_probs(policy, batch)
    with torch.no_grad():
        ref = plain_log_probs(reference, batch)[0] if reference is not None else None
    half, beta = len(logps) // 2, recipe.beta
    total, stats = 0.0, dict.fromkeys(PAIR_STATS, 0.0)
    for i in range(half):
        if lengths[i] == 0:
            continue
        c, r, lc, lr = logps[i], logps[half + i], lengths[i], lengths[half + i]
        if recipe.objective == "simpo":
            z = beta * (c / lc - r / lr) - recipe.simpo_gamma
            eps = recipe.label_smoothing
            loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
            rc, rr = beta * c / lc, beta * r / lr
        else:
            cr, rr_ = c - ref[i], r - ref[half + i]
            if recipe.loss_type == "sigmoid":
                z = beta * (cr - rr_)
                eps = recipe.label_smoothing
                loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
            elif recipe.loss_type == "hinge":
                loss = torch.clamp(1 - beta * (cr - rr_), min=0)
            else:
                loss = (cr / lc - rr_ / lr - 1 / (2 * beta)) ** 2
            rc, rr = beta * cr, beta * rr_
        total = total + loss
        for name, value in zip(PAIR_STATS, (rc, rr, float(rc > rr), rc - rr, c, r)):
            stats[name] += float(torch.as_tensor(value).detach())
    return total, stats


CASES = [dict(objective="dpo", loss_type="sigmoid"), dict(objective="dpo", loss_type="sigmoid", label_smoothing=0.2),
         dict(objective="dpo", loss_type="ipo", beta=0.5), dict(objective="dpo", loss_type="hinge", beta=2.0),
         dict(objective="simpo", beta=2.0, simpo_gamma=0.8)]


@pytest.mark.parametrize("fields", CASES, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("head_only", [True, False], ids=["head-only", "full-logits"])
def test_loss_stats_and_gradients_equal_the_formulas(fields, head_only):
    recipe = Recipe(**fields)
    policy, reference = tiny_llama(0), tiny_llama(1)
    batch = pair_batch(3, filler=True)
    ref = None if recipe.objective == "simpo" else \
        FrozenReference(ReferenceLogProbs(reference, head_only), torch.device("cpu"))
    module = PreferenceLoss(policy, recipe, ref)
    module.head_only = head_only
    got = module(**batch)
    got.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    expected, stats = plain_loss(recipe, policy, None if ref is None else reference, batch)
    expected.backward()
    assert float(got) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    for g, p in zip(grads, policy.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    assert module.loss_units(batch) == 3  # the filler pair counts neither in the loss nor in the units
    popped = {k: float(v) for k, v in module.pop_stats().items()}
    assert popped == pytest.approx(stats, rel=1e-5, abs=1e-6) and module.pop_stats() == {}


def test_a_fresh_policy_has_zero_rewards_and_the_log2_loss():
    """Policy = reference at the start of dpo: every reward 0, accuracy 0 (strict >, as TRL), loss log 2 per pair."""
    policy = tiny_llama(0)
    module = build_loss(Recipe(objective="dpo"), policy, torch.device("cpu"))
    assert isinstance(module.reference, FrozenReference) and module.reference.module.lm is not policy
    assert not any(p.requires_grad for p in module.reference.module.parameters())
    assert not any(name.startswith("reference") for name, _ in module.named_parameters())  # off the module tree
    loss = module(**pair_batch(4))
    assert float(loss) == pytest.approx(4 * math.log(2), rel=1e-6)
    stats = module.pop_stats()
    assert all(float(stats[k]) == 0 for k in PAIR_STATS[:4])


def test_lora_reference_by_disabling_adapters_equals_a_frozen_copy_of_the_base():
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(0)
    frozen_base = copy.deepcopy(base)
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = pair_batch(3)
    inputs = batch["input_ids"], batch["labels"]
    by_disabling = AdapterReference(policy, summed_log_probs(head_only=True)).log_probs(*inputs)
    by_copy = FrozenReference(ReferenceLogProbs(frozen_base, True), torch.device("cpu")).log_probs(*inputs)
    torch.testing.assert_close(by_disabling, by_copy, rtol=0, atol=1e-6)
    with_adapters = plain_log_probs(policy, batch)[0]
    assert (with_adapters - by_copy).abs().max() > 1e-3  # the adapters do change the policy: the test can fail
    module = build_loss(Recipe(objective="dpo", use_peft=True), policy, torch.device("cpu"))
    assert isinstance(module.reference, AdapterReference)
    assert build_loss(Recipe(objective="simpo"), tiny_llama(0), torch.device("cpu")).reference is None


def test_accumulated_micro_batches_give_the_gradient_of_one_batch():
    """Sum of pair losses over micro-batches / all pairs == the mean over one batch of all pairs (the loop's rule),
    with micro-batches of unequal real pair counts (TRL's mean of micro-batch means differs here)."""
    recipe = Recipe(objective="dpo")
    policy = tiny_llama(0)
    reference = FrozenReference(ReferenceLogProbs(tiny_llama(1), True), torch.device("cpu"))
    module = PreferenceLoss(policy, recipe, reference)
    whole = pair_batch(3)
    first = {k: torch.cat([v[:1], v[3:4]]) for k, v in whole.items()}
    second = {k: torch.cat([v[1:3], v[4:6]]) for k, v in whole.items()}
    pairs = sum(int(module.loss_units(b)) for b in (first, second))
    for b in (first, second):
        (module(**b) / pairs).backward()
    accumulated = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    (module(**whole) / 3).backward()
    for a, p in zip(accumulated, policy.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def test_the_frozen_reference_of_a_tied_model_keeps_its_tie_and_its_own_tensor():
    """SmolLM2 / Qwen2.5-0.5B tie the head to the embedding: dpo's frozen copy holds one tensor for both, apart from
    the policy's (which training changes)."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, tie_word_embeddings=True)).eval()
    reference = build_loss(Recipe(objective="dpo"), policy, torch.device("cpu")).reference.module.lm
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    assert reference.lm_head.weight is not policy.lm_head.weight
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in policy.parameters())


def test_every_objective_the_recipe_accepts_is_registered():
    """The loop asks the registry for `recipe.objective`: a name the recipe accepts without an entry would fail only
    at run time, an entry the recipe refuses could never run."""
    field = next(f for f in dataclasses.fields(Recipe) if f.name == "objective")
    assert set(OBJECTIVES) == set(field.metadata["choices"])
    assert all(objective.name == name for name, objective in OBJECTIVES.items())
    assert isinstance(objective_for(Recipe(objective="simpo")), Preference)
    assert not objective_for(Recipe(objective="simpo")).needs_reference and OBJECTIVES["dpo"].needs_reference


def test_the_loop_does_not_branch_on_the_objective():
    """finetune.py asks hftrain.objectives for the loss, its preparation and notes; no objective name or
    objective-only setting appears in it (docs/architecture.md, the house rules)."""
    source = (REPO / "hftrain" / "finetune.py").read_text(encoding="utf-8")
    code = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments may name objectives
    for word in ('"sft"', '"dpo"', '"simpo"', "recipe.objective", "precompute_ref_log_probs", ".reference"):
        assert word not in code, word


def plain_orpo(lm, batch: dict[str, torch.Tensor], beta: float, lengths: list[int]) -> dict[str, torch.Tensor]:
    """ORPO from the paper's formula with TRL's NLL (the chosen rows' token mean over every real token after the
    first, prompt included), row by row on the unpadded rows (`lengths`) with full logits."""
    half = len(batch["input_ids"]) // 2
    means, nll_sum, nll_tokens = [], 0.0, 0
    for r, (ids, labels) in enumerate(zip(batch["input_ids"], batch["labels"])):
        ids, labels = ids[:lengths[r]], labels[:lengths[r]]
        logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0].float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]
        trained = labels[1:] != IGNORE_INDEX
        means.append(logp[trained].mean())
        if r < half:
            nll_sum, nll_tokens = nll_sum - logp.sum(), nll_tokens + len(logp)
    chosen, rejected = torch.stack(means[:half]), torch.stack(means[half:])
    odds = lambda p: p - torch.log(1 - torch.exp(p))  # noqa: E731 - log(p / (1 - p)) of a mean log-prob
    log_odds = odds(chosen) - odds(rejected)
    ratio = torch.nn.functional.logsigmoid(log_odds)
    return {"loss": nll_sum / nll_tokens - beta * ratio.mean(), "nll_loss": nll_sum / nll_tokens,
            "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean(), "logps/chosen": chosen.mean(),
            "rewards/margins": beta * (chosen - rejected).mean()}


def test_orpo_loss_gradient_and_statistics_equal_the_formula_over_two_micro_batches():
    """ORPOLoss over micro-batches of 1 and 2 pairs (the step's counts from `prepare_step`) gives the loss, gradient
    and TRL-named statistics of the formula applied to all 3 pairs at once; evaluation gives the same eval_loss."""
    from hftrain.objectives.orpo import ORPOLoss

    beta = 0.25
    policy = tiny_llama(0)
    whole = pair_batch(3)
    lengths = [int((row != IGNORE_INDEX).nonzero().max()) + 1 for row in whole["labels"]]
    expected = plain_orpo(policy, whole, beta, lengths)
    expected["loss"].backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    module = ORPOLoss(policy, Recipe(objective="orpo", beta=beta))
    first = {k: torch.cat([v[:1], v[3:4]]) for k, v in whole.items()}
    second = {k: torch.cat([v[1:3], v[4:6]]) for k, v in whole.items()}
    module.train()
    module.prepare_step(module, [first, second], lambda t: t)
    loss = sum(module(**b) for b in (first, second)) / 3
    loss.backward()
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-5, atol=1e-6)
    for a, p in zip(grads, policy.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-6)
    stats = module.pop_stats()
    for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen", "logps/chosen", "rewards/margins"):
        torch.testing.assert_close(stats[name].float() / 3, expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    module.eval()
    with torch.no_grad():
        loss_sum = module(**whole)
    metrics = module.eval_metrics(float(loss_sum), 3, {k: float(v) for k, v in module.pop_stats().items()})
    assert metrics["eval_loss"] == pytest.approx(float(expected["loss"]), rel=1e-5)
    assert metrics["eval_nll_loss"] == pytest.approx(float(expected["nll_loss"]), rel=1e-5)
    assert metrics["eval_log_odds_chosen"] == pytest.approx(float(expected["log_odds_chosen"]), rel=1e-4, abs=1e-7)


def test_orpo_step_with_an_empty_micro_batch_equals_the_step_without_it():
    """A rank whose data ran out collates an empty micro-batch to one filler pair one token wide (data.Collator):
    ORPO must add nothing for it, not fail on a row with no position to score."""
    from hftrain.objectives.orpo import ORPOLoss

    policy = tiny_llama(0)
    module = ORPOLoss(policy, Recipe(objective="orpo", beta=0.25))
    module.train()
    whole = pair_batch(3)
    empty = {k: v[:, :1] for k, v in pair_batch(0, filler=True).items()}
    assert empty["input_ids"].shape == (2, 1) and (empty["labels"] == IGNORE_INDEX).all()
    module.prepare_step(module, [whole], lambda t: t)
    expected = module(**whole)
    module.pop_stats()
    module.prepare_step(module, [whole, empty], lambda t: t)
    got = module(**whole) + module(**empty)
    torch.testing.assert_close(got, expected)
    assert all(torch.isfinite(value) for value in module.pop_stats().values())  # the filler adds 0, not NaN
