"""optim: muon: the parameter split, the steps against torch's two optimizers built by hand, the state a checkpoint
carries, and the layouts refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain.config import Recipe, validate
from hftrain.optim import (
    MuonWithAdamW,
    build_optimizer,
    build_scheduler,
    lr_factor,
    muon_launch_problems,
    muon_split,
    optimizer_notes,
)
from hftrain.parallel.launch import Launch
from hftrain.preflight import launch_problems
from tests.conftest import REPO

HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def hidden_names(model) -> set[str]:
    """The decoder layers' projection weights, by name (what Moonlight trains with Muon)."""
    return {n for n, _ in model.named_parameters() if n.split(".")[-2] in HIDDEN}


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = tiny_llama(tied)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, rest = muon_split(model)
    assert {names[id(p)] for p in hidden} == hidden_names(model)
    expected_rest = {n for n, _ in model.named_parameters()} - hidden_names(model)
    assert {names[id(p)] for p in rest} == expected_rest
    assert ("lm_head.weight" in expected_rest) is not tied  # tied: the head is the embedding, listed once
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= expected_rest


def test_frozen_parameters_and_a_classification_head_stay_out_of_muon():
    from transformers import LlamaForSequenceClassification

    model = LlamaForSequenceClassification(tiny_llama().config)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, rest = muon_split(model)
    assert "score.weight" in {names[id(p)] for p in rest}
    assert {names[id(p)] for p in hidden} == hidden_names(model) - {"model.layers.0.self_attn.q_proj.weight"}


def reference_optimizers(model, lr, weight_decay, betas, eps):
    """torch.optim.Muon (Moonlight's adjust_lr_fn) and torch.optim.AdamW as torch's docstring builds them, the split
    made by name; AdamW decays matrices only."""
    named = dict(model.named_parameters())
    hidden = [named[n] for n in sorted(hidden_names(model), key=list(named).index)]
    rest = [p for n, p in named.items() if n not in hidden_names(model)]
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=lr, betas=betas, eps=eps)
    return muon, adamw


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 40, (3, 12), generator=generator)


def train(model, optimizers, schedulers, steps):
    ids = batch()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()


RECIPE = dict(optim="muon", learning_rate=2e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
              lr_scheduler_type="cosine", warmup_steps=2)


def test_muon_steps_equal_torchs_two_optimizers_built_by_hand():
    """5 steps with a warmup + cosine schedule: the same weights, bit for bit, as torch.optim.Muon and AdamW built
    and scheduled by hand; and not the weights AdamW alone gives (the comparison can fail)."""
    recipe, total = Recipe(**RECIPE), 5
    model = tiny_llama()
    by_hand = copy.deepcopy(model)
    adamw_only = copy.deepcopy(model)
    optimizer = build_optimizer(recipe, model)
    assert isinstance(optimizer, MuonWithAdamW)
    train(model, [optimizer], [build_scheduler(recipe, optimizer, total)], total)

    muon, adamw = reference_optimizers(by_hand, 2e-2, 0.1, (0.9, 0.95), 1e-8)
    schedule = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: lr_factor("cosine", i + 1, total, 2))
                for o in (muon, adamw)]
    train(by_hand, [muon, adamw], schedule, total)
    for (name, got), expected in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(got, expected), name

    plain = build_optimizer(Recipe(**{**RECIPE, "optim": "adamw_torch"}), adamw_only)
    train(adamw_only, [plain], [build_scheduler(recipe, plain, total)], total)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(dict(model.named_parameters())[q_proj], dict(adamw_only.named_parameters())[q_proj])


def test_muon_with_lora_steps_the_adapter_matrices_as_torchs_muon_built_by_hand():
    """LoRA r 4 on every decoder projection (peft, B drawn so that A's gradient is not zero from the first step):
    the trained tensors are the 28 2-D factors A and B, all to Muon, nothing to AdamW; 5 steps equal bit for bit
    torch.optim.Muon built by hand on the lora_A / lora_B weights (each factor orthogonalized on its own, Moonlight's
    scaling of its own shape), and differ from AdamW's adapters (the comparison can fail)."""
    from peft import LoraConfig, get_peft_model

    def adapted():
        model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                        target_modules=list(HIDDEN)))
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model

    recipe, total = Recipe(**RECIPE, use_peft=True), 5
    model, by_hand, adamw_only = adapted(), adapted(), adapted()
    optimizer = build_optimizer(recipe, model)
    assert isinstance(optimizer, MuonWithAdamW)
    # r x (in + out) per projection: q, o 16 -> 16; k, v 16 -> 8 (one kv head of 8); gate, up 16 -> 24; down 24 -> 16
    adapter = 2 * 4 * (2 * 32 + 2 * 24 + 3 * 40)
    assert optimizer.describe() == (f"optim muon: torch.optim.Muon on 28 hidden matrices ({adapter:,} parameters), "
                                    "nothing trained left for AdamW")
    train(model, [optimizer], [build_scheduler(recipe, optimizer, total)], total)

    factors = [p for n, p in by_hand.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    assert len(factors) == 28 and all(p.requires_grad for p in factors)
    muon = torch.optim.Muon(factors, lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw")
    train(by_hand, [muon], [torch.optim.lr_scheduler.LambdaLR(muon, lambda i: lr_factor("cosine", i + 1, total, 2))],
          total)
    for (name, got), expected in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(got, expected), name

    plain = build_optimizer(Recipe(**{**RECIPE, "optim": "adamw_torch"}, use_peft=True), adamw_only)
    train(adamw_only, [plain], [build_scheduler(recipe, plain, total)], total)
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert not torch.allclose(dict(model.named_parameters())[a], dict(adamw_only.named_parameters())[a])


def test_the_state_dict_holds_both_optimizers_and_a_loaded_one_continues_exactly():
    """2 steps, state_dict, a fresh optimizer on a copy of the model loads it: 2 more steps equal the uninterrupted
    optimizer's 2 more steps. The state holds Muon's momentum buffers and AdamW's moments."""
    recipe = Recipe(**RECIPE)
    model = tiny_llama()
    optimizer = build_optimizer(recipe, model)
    scheduler = build_scheduler(recipe, optimizer, 6)
    train(model, [optimizer], [scheduler], 2)
    saved, saved_schedule = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())
    names = {i: n for i, (n, _) in enumerate(model.named_parameters())}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    kinds = {names[index[id(order[i])]]: set(state) for i, state in saved["state"].items()}
    assert all(kinds[n] == {"momentum_buffer"} for n in hidden_names(model))
    assert all(kinds[n] == {"step", "exp_avg", "exp_avg_sq"} for n in set(kinds) - hidden_names(model))
    assert len(kinds) == len(names)

    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(recipe, resumed_model, learning_rate=1.0)  # the checkpoint brings the lr back
    resumed_schedule = build_scheduler(recipe, resumed, 6)
    resumed.load_state_dict(saved)
    resumed_schedule.load_state_dict(saved_schedule)
    train(model, [optimizer], [scheduler], 2)
    train(resumed_model, [resumed], [resumed_schedule], 2)
    for (name, got), expected in zip(resumed_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(got, expected), name
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in optimizer.param_groups]
    assert all(part.param_groups[0] is g for part, g in zip(resumed.parts, (resumed.param_groups[0],
                                                                              resumed.param_groups[1]), strict=True))


def test_the_start_up_line_counts_each_optimizers_parameters():
    model = tiny_llama()
    (line,) = optimizer_notes(build_optimizer(Recipe(optim="muon"), model))  # 2 layers x 7 projections; embedding,
    # head, 2 layers x 2 norms, the final norm
    hidden = [p for n, p in model.named_parameters() if n in hidden_names(model)]
    rest_count = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in hidden)
    assert line == (f"optim muon: torch.optim.Muon on 14 hidden matrices ({sum(p.numel() for p in hidden):,} "
                    f"parameters), AdamW on 7 other tensors ({rest_count:,} parameters: embeddings, head, norms, "
                    "biases)")
    assert optimizer_notes(build_optimizer(Recipe(), model)) == []


def recipe_problems(**values) -> list[str]:
    return validate(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), optim="muon", **values))


def test_recipes_muon_cannot_run_are_refused_by_name():
    assert recipe_problems(use_peft=True) == []  # LoRA: Muon on the adapter matrices (above)
    (tp,) = recipe_problems(tp_size=2)
    assert tp.startswith("optim: muon with tp_size=2 is refused (tensor parallelism splits each projection's")
    assert "Newton-Schulz step orthogonalizes each weight matrix as a whole" in tp
    assert recipe_problems(muon_momentum=1.0, muon_ns_steps=0) == [
        "muon_momentum must be in [0, 1), got 1.0", "muon_ns_steps must be in [1, 99] (torch.optim.Muon's limit), "
        "got 0"]
    assert recipe_problems() == []
    assert validate(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), use_peft=True)) == []


@pytest.mark.parametrize("launch, refused", [
    (Launch("fsdp2", 2, 2), "optim: muon with fsdp2 is refused (FSDP2 shards every parameter over the processes)"),
    (Launch("deepspeed", 2, 2, deepspeed_config_path="ds.json",
            deepspeed_config={"zero_optimization": {"stage": 2}}),
     "optim: muon with deepspeed is refused (DeepSpeed ZeRO-2 flattens the parameters and partitions them"),
    (Launch("ddp", 2, 2), None), (Launch("single", 1, 1), None),
])
def test_sharded_launches_are_refused_in_the_preflight(launch, refused):
    recipe = Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), optim="muon")
    found = [p for p in launch_problems(recipe, launch) if "muon" in p]
    if refused is None:
        assert found == []
    else:
        (problem,) = found
        assert problem.startswith(refused) and "hftrain does not gather the matrices for the step" in problem
    assert muon_launch_problems(Recipe(), launch.kind, launch.zero_stage) == []
