"""Learning-rate schedule (per optimizer step, 1-based) and optimizer parameter groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hftrain.config import Recipe, recipe_from_dict
from hftrain.errors import ConfigError
from hftrain.optim import build_optimizer, build_scheduler, lr_factor, scaled_learning_rate, set_peak_learning_rate
from tests.conftest import REPO

KINDS = ("constant", "constant_with_warmup", "linear", "cosine")
GRID = [(total, warmup) for total in (1, 2, 5, 10, 37) for warmup in (0, 1, 3, total - 1, total)
        if 0 <= warmup <= total]


def expected_factor(kind: str, step: int, total: int, warmup: int) -> float:
    """Hand-written schedule: linear warmup to 1 at `warmup`, then decay over the D = total - warmup
    remaining steps; decay step i (1..D) uses (D - i + 1) / D (linear) or (1 + cos(pi (i-1) / D)) / 2."""
    if warmup and step <= warmup:
        return step / warmup
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    decay_steps, i = total - warmup, step - warmup
    if kind == "linear":
        return (decay_steps - i + 1) / decay_steps
    return (1 + math.cos(math.pi * (i - 1) / decay_steps)) / 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("total,warmup", GRID)
def test_lr_factor_matches_formula(kind, total, warmup):
    for step in range(1, total + 1):
        assert lr_factor(kind, step, total, warmup) == pytest.approx(expected_factor(kind, step, total, warmup),
                                                                      rel=1e-12, abs=1e-12), step


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("total,warmup", GRID)
def test_lr_factor_shape(kind, total, warmup):
    factors = [lr_factor(kind, step, total, warmup) for step in range(1, total + 1)]
    assert factors[0] > 0  # step 1 always trains
    assert all(0 < f <= 1 for f in factors)  # never 0, never above the peak, last step included
    if warmup:
        assert factors[warmup - 1] == 1.0  # exactly the peak at step == warmup
        assert factors[:warmup] == sorted(factors[:warmup])
    if total > warmup:
        assert factors[warmup] == 1.0  # first step after warmup
        after = factors[warmup:]
        assert after == sorted(after, reverse=True)  # never increases after warmup
        if kind in ("linear", "cosine") and total - warmup > 1:
            assert after[-1] < after[0]


def test_warmup_fractions():
    assert [lr_factor("linear", s, 100, 4) for s in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]


def test_linear_last_step_value():
    # 10 decay steps: the last one trains at 1/10 of the peak, not 0
    assert lr_factor("linear", 12, 12, 2) == pytest.approx(0.1)
    assert lr_factor("cosine", 12, 12, 2) == pytest.approx((1 + math.cos(math.pi * 0.9)) / 2)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3, bias=False))


@pytest.mark.parametrize("kind,warmup_steps,warmup_ratio", [
    ("linear", 3, 0.0), ("cosine", 3, 0.0), ("cosine", 0, 0.0), ("constant_with_warmup", 4, 0.0),
    ("constant", 0, 0.0), ("linear", 0, 0.2),
])
def test_scheduler_gives_peak_times_factor_at_each_step(kind, warmup_steps, warmup_ratio):
    total, peak = 12, 0.01
    recipe = Recipe(learning_rate=peak, lr_scheduler_type=kind, warmup_steps=warmup_steps, warmup_ratio=warmup_ratio)
    warmup = warmup_steps or math.ceil(warmup_ratio * total)  # as transformers: ceil
    model = small_model()
    optimizer = build_optimizer(recipe, model)
    scheduler = build_scheduler(recipe, optimizer, total)
    seen = []
    for _ in range(total):
        seen.append([g["lr"] for g in optimizer.param_groups])
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    for step, lrs in enumerate(seen, start=1):
        want = peak * expected_factor(kind, step, total, warmup)
        assert lrs == pytest.approx([want] * len(lrs), rel=1e-12), step
    assert seen[0][0] > 0


def test_adamw_groups_decay_only_matrices():
    model = small_model()
    recipe = Recipe(weight_decay=0.1, learning_rate=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    optimizer = build_optimizer(recipe, model)
    assert type(optimizer) is torch.optim.AdamW
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    linear1, norm = model[1], model[2]
    matrices = {id(model[0].weight), id(linear1.weight), id(model[3].weight)}
    vectors = {id(linear1.bias), id(norm.weight), id(norm.bias)}
    assert by_decay == {0.1: matrices, 0.0: vectors}
    for group in optimizer.param_groups:
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["lr"] == 1e-3


def test_adamw_groups_on_the_tiny_llama_layout():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are left out
    optimizer = build_optimizer(Recipe(weight_decay=0.05), model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.05 for p in g["params"]}
    plain = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert plain and all("norm" in n for n in plain)
    assert decayed == {n for n, p in model.named_parameters() if p.ndim == 2 and n != "model.embed_tokens.weight"}
    assert len(decayed) + len(plain) == sum(1 for p in model.parameters() if p.requires_grad)


def test_adamw_without_vectors_has_no_empty_group():
    model = nn.Linear(3, 3, bias=False)
    optimizer = build_optimizer(Recipe(weight_decay=0.1), model)
    assert [len(g["params"]) for g in optimizer.param_groups] == [1]


def test_sgd_with_momentum():
    model = small_model()
    recipe = Recipe(optim="sgd", sgd_momentum=0.9, learning_rate=0.05)
    optimizer = build_optimizer(recipe, model)
    assert type(optimizer) is torch.optim.SGD
    assert all(g["momentum"] == 0.9 and g["lr"] == 0.05 for g in optimizer.param_groups)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_sgd_step_is_plain_sgd():
    """One step of optim=sgd without momentum moves each weight by exactly -lr * grad."""
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(Recipe(optim="sgd", learning_rate=0.5), model)
    model(torch.tensor([[4, 5]])).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    for old, grad, new in zip(before, grads, model.parameters(), strict=True):
        torch.testing.assert_close(new.detach(), old - 0.5 * grad)


@pytest.mark.parametrize("optim, bits, paged", [("adamw_bnb_8bit", 8, False), ("paged_adamw_8bit", 8, True),
                                                ("paged_adamw_32bit", 32, True)])
def test_bitsandbytes_adamw_follows_torch_adamw(optim, bits, paged):
    """Same groups and hyperparameters as torch AdamW; 8-bit state for large tensors; steps close to AdamW's."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    big, small = nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(64))  # 8192 and 64 elements
    recipe = Recipe(optim=optim, learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.99)
    optimizer = build_optimizer(recipe, nn.ParameterList([big, small]))
    assert isinstance(optimizer, bnb.optim.AdamW) and optimizer.args.optim_bits == bits
    assert optimizer.is_paged is paged
    assert [(g["weight_decay"], len(g["params"])) for g in optimizer.param_groups] == [(0.1, 1), (0.0, 1)]
    ref_big, ref_small = nn.Parameter(big.detach().clone()), nn.Parameter(small.detach().clone())
    reference = build_optimizer(Recipe(learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.99),
                                nn.ParameterList([ref_big, ref_small]))
    start = big.detach().clone()
    for _ in range(5):
        grads = torch.randn(64, 128), torch.randn(64)
        for p, g in zip((big, small, ref_big, ref_small), grads * 2, strict=True):
            p.grad = g.clone()
        optimizer.step()
        reference.step()
    assert optimizer.state[big]["state1"].dtype == (torch.uint8 if bits == 8 else torch.float32)
    assert optimizer.state[small]["state1"].dtype == torch.float32  # below min_8bit_size: 32-bit state
    moved = (ref_big - start).abs().mean()
    assert moved > 1e-2  # five steps of ~lr each
    if bits == 8:  # quantized state: close to AdamW on average (measured ~1% of the move), not equal
        assert (big - ref_big).abs().mean() < 0.05 * moved
    else:
        torch.testing.assert_close(big.detach(), ref_big.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(small.detach(), ref_small.detach(), rtol=1e-5, atol=1e-6)


def test_fused_adamw_takes_the_same_steps_as_torch_adamw():
    """adamw_torch_fused is torch's AdamW as one kernel: same groups, same updates (to float rounding)."""
    def trained(optim: str) -> tuple[torch.optim.Optimizer, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        optimizer = build_optimizer(Recipe(optim=optim, learning_rate=1e-2, weight_decay=0.1), model)
        data = torch.Generator().manual_seed(1)
        for _ in range(5):
            model(torch.randn(32, 8, generator=data)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return optimizer, model

    fused, fused_model = trained("adamw_torch_fused")
    plain, plain_model = trained("adamw_torch")
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in plain.param_groups)
    # adamw_torch leaves the implementation to torch (fused=False would also switch off its foreach default)
    assert all(g["fused"] is None and g["foreach"] is None for g in plain.param_groups)
    assert [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]
    for a, b in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- scale_lr
@pytest.mark.parametrize("rule, effective, expected", [
    ("linear", 64, 4e-4), ("linear", 8, 5e-5), ("sqrt", 64, 2e-4), ("sqrt", 4, 5e-5), ("sqrt", 32, 1e-4 * 2 ** 0.5),
])
def test_scaled_learning_rate(rule, effective, expected):
    """Goyal et al.'s linear rule and the square-root rule, from learning_rate 1e-4 tuned at a batch of 16."""
    lr, record = scaled_learning_rate(Recipe(learning_rate=1e-4, scale_lr=rule, base_batch_size=16), effective)
    assert lr == pytest.approx(expected, rel=1e-12)
    assert record == {"rule": rule, "base_batch_size": 16, "effective_batch_size": effective,
                      "base_learning_rate": 1e-4, "factor": pytest.approx(expected / 1e-4, rel=1e-12),
                      "learning_rate": lr}
    assert scaled_learning_rate(Recipe(learning_rate=1e-4), effective) == (1e-4, None)


def test_scale_lr_needs_base_batch_size_and_nothing_else_takes_it(tmp_path):
    values = {"model_name_or_path": str(REPO / "models" / "tiny-llama"),
              "dataset_name": str(REPO / "data" / "chat.jsonl"),
              "output_dir": str(tmp_path / "o")}
    for bad, text in (({"scale_lr": "linear"}, "scale_lr=linear scales learning_rate from the batch"),
                      ({"scale_lr": "sqrt", "base_batch_size": 0}, "set base_batch_size (>= 1 examples), got 0"),
                      ({"base_batch_size": 32}, "base_batch_size=32 only applies with scale_lr linear or sqrt"),
                      ({"scale_lr": "cube", "base_batch_size": 32}, "scale_lr")):
        with pytest.raises(ConfigError) as info:
            recipe_from_dict({**values, **bad})
        assert any(text in p for p in info.value.problems), info.value.problems


def test_a_resumed_schedule_continues_at_the_new_peak():
    """The schedule resumed from a run at peak 1e-3 continues at its step with the new peak 4e-3, as a fresh
    schedule with peak 4e-3 would be at that step."""
    recipe = Recipe(learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2)
    saved_opt = build_optimizer(recipe, nn.Linear(3, 3))
    saved = build_scheduler(recipe, saved_opt, 10)
    for _ in range(4):
        saved_opt.step()
        saved.step()
    fresh_opt = build_optimizer(recipe, nn.Linear(3, 3), 4e-3)
    resumed = build_scheduler(recipe, fresh_opt, 10)
    fresh_opt.load_state_dict(saved_opt.state_dict())  # as accelerate's load_state: the saved lr comes back
    resumed.load_state_dict(saved.state_dict())
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor("cosine", 5, 10, 2))
    set_peak_learning_rate(resumed, 4e-3)
    for step in range(5, 11):
        assert fresh_opt.param_groups[0]["lr"] == pytest.approx(4e-3 * lr_factor("cosine", step, 10, 2), rel=1e-12)
        fresh_opt.step()
        resumed.step()


def test_a_model_zero3_loaded_partitioned_is_judged_by_its_whole_shapes(tmp_path, monkeypatch):
    """ZeRO-3 (zero3_init_flag) builds the model partitioned: every parameter's `.data` is an empty 1-D tensor while
    DeepSpeed holds the shards. The decay groups must still be those of the whole shapes (with `.ndim` every matrix
    went undecayed, and 2 ZeRO-3 processes with optim sgd and weight_decay 0.01 ended 3e-4 from one process), and so
    must the fused expert weights, the FLOPs per token (MFU) and the model summary's parameter counts (with
    `.numel()` all 0)."""
    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from hftrain.metrics import FlopCounter
    from hftrain.model import fused_expert_parameters, model_summary

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    moe_config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                               num_local_experts=2, num_experts_per_tok=1)
    whole, whole_moe = LlamaForCausalLM(config), MixtralForCausalLM(moe_config)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # what DeepSpeed reads of the launcher's environment
    # zero.Init replaces torch.nn.functional.linear for good (its "memory efficient linear"): put back at teardown,
    # or the later tests of this worker process run DeepSpeed's linear (torchao's int4 tensors have no aten.t)
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
            partitioned, partitioned_moe = LlamaForCausalLM(config), MixtralForCausalLM(moe_config)
        # the same shape test picks a mixture-of-experts model's fused 3-D expert weights (LoRA's dropout rule)
        fused = {"whole": fused_expert_parameters(whole_moe), "partitioned": fused_expert_parameters(partitioned_moe)}
        counted = {key: [(FlopCounter(m).per_token, model_summary(m)["parameters"]) for m in models]
                   for key, models in (("whole", (whole, whole_moe)), ("partitioned", (partitioned, partitioned_moe)))}
        recipe = Recipe(optim="sgd", weight_decay=0.01)
        groups = {}
        for key, model in (("whole", whole), ("partitioned", partitioned)):
            names = {id(p): n for n, p in model.named_parameters()}
            groups[key] = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"])
                           for g in build_optimizer(recipe, model).param_groups}
        assert all(p.ndim == 1 and p.numel() == 0 for p in partitioned.parameters())  # what ZeRO-3 leaves in .data
    finally:
        dist.destroy_process_group()
    # the whole model's own shapes decide: matrices decayed, the norm weights not
    assert groups["whole"] == {0.01: sorted(n for n, p in whole.named_parameters() if p.ndim == 2),
                               0.0: sorted(n for n, p in whole.named_parameters() if p.ndim == 1)}
    assert groups["partitioned"] == groups["whole"]
    assert fused["whole"] == [n for n, p in whole_moe.named_parameters() if p.ndim == 3] != []
    assert fused["partitioned"] == fused["whole"]
    # 6 FLOPs per matmul weight and token (all trained; a Mixtral token uses 1 of its 2 experts), counted here from
    # the whole models' own tensors
    embeddings = {"model.embed_tokens.weight"}
    for model, (per_token, parameters) in zip((whole, whole_moe), counted["whole"], strict=True):
        active = sum(p.numel() / (2 if ".experts." in n else 1) for n, p in model.named_parameters()
                     if n not in embeddings)
        assert per_token == 6 * active and parameters == sum(p.numel() for p in model.parameters())
    assert counted["partitioned"] == counted["whole"]
