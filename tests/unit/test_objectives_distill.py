"""objective distill's loss (hftrain/objectives/distill.py) against independent computations: the generalized JSD
written in plain PyTorch with autograd's gradient, TRL 1.16's own GKDTrainer.generalized_jsd_loss and
DistillationTrainer's chunked divergence, chunked == unchunked, and DistillLoss on two tiny models against full
logits; plus the recipe's rules and the teacher's tokenizer check."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hftrain.config import Recipe, validate
from hftrain.estimate import estimate, model_shape
from hftrain.objectives.distill import (
    DistillLoss,
    FrozenTeacher,
    WithGradient,
    chunked_divergence,
    on_policy_step,
    teacher_problems,
    token_divergence,
)
from hftrain.report import plot_all
from tests.conftest import REPO

TINY = REPO / "models" / "tiny-llama"


def plain_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Per-token generalized JSD from its definition (GKD paper eq. 1), written apart from hftrain's."""
    ps = torch.softmax(student / temperature, dim=-1)
    pt = torch.softmax(teacher / temperature, dim=-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def logits_pair(n=11, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3, \
        torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_divergence_and_gradient_equal_plain_pytorch(beta, temperature):
    student, teacher = logits_pair()
    weights = torch.linspace(0.5, 2.0, len(student), dtype=torch.float64)  # a non-uniform upstream gradient
    leaf = student.clone().requires_grad_(True)
    expected = plain_jsd(leaf, teacher, beta, temperature)
    (expected * weights).sum().backward()

    mine = student.float().clone().requires_grad_(True)
    divergence, grad, _ = chunked_divergence(mine.detach(), lambda s, e: teacher[s:e].float(), beta, temperature, 4)
    out = WithGradient.apply(mine, divergence, grad)
    (out * weights.float()).sum().backward()
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.grad.double(), leaf.grad, rtol=1e-4, atol=1e-6)


def test_chunked_equals_unchunked_and_entropy_is_the_students():
    student, teacher = logits_pair(n=23)
    whole = chunked_divergence(student.float(), lambda s, e: teacher[s:e].float(), 0.5, 1.3, 1000)
    for chunk in (1, 5, 22):
        parts = chunked_divergence(student.float(), lambda s, e: teacher[s:e].float(), 0.5, 1.3, chunk)
        for a, b in zip(parts, whole):
            torch.testing.assert_close(a, b)
    p = torch.softmax(student / 1.3, dim=-1)
    torch.testing.assert_close(whole[2].double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equal_to_trl_gkd_and_distillation_losses(beta):
    """TRL's two implementations on the same logits: GKDTrainer.generalized_jsd_loss (temperature passed) and
    DistillationTrainer's _chunked_divergence_loss (its CPU path, logits made from hidden states and heads)."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    distillation = pytest.importorskip("trl.trainer.distillation_trainer")
    g = torch.Generator().manual_seed(1)
    hidden_s, hidden_t = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 12, generator=g)
    head_s, head_t = torch.randn(29, 8, generator=g), torch.randn(29, 12, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    student, teacher = hidden_s @ head_s.T, hidden_t @ head_t.T
    trained = mask.bool()
    divergence, _, entropy = token_divergence(student[trained], teacher[trained], beta, 0.8)
    labels = torch.where(trained, 1, -100)
    theirs_gkd = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=0.8)
    theirs, their_entropy, count = distillation._chunked_divergence_loss(hidden_s, hidden_t, head_s, head_t, mask,
                                                                         beta, temperature=0.8)
    assert int(count) == trained.sum()
    torch.testing.assert_close(divergence.mean(), theirs_gkd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(divergence.mean(), theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy.sum(), their_entropy, rtol=1e-5, atol=1e-5)


def tiny_model(hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=53, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("chunk", [0, 3])
def test_distill_loss_equals_full_logits(chunk):
    """DistillLoss's summed divergence and its gradients (a wider teacher; chunks of 3 tokens or the default) equal
    plain PyTorch on both models' full logits at the trained positions."""
    student, teacher = tiny_model(16, 0), tiny_model(24, 1)
    recipe = Recipe(objective="distill", teacher_model_name_or_path="t", beta=0.5, temperature=0.9,
                    loss_chunk_tokens=chunk)
    loss_fn = DistillLoss(student, recipe, FrozenTeacher(teacher, torch.device("cpu"), "teacher"))
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(1, 53, (3, 9), generator=g)
    labels = input_ids.clone()
    labels[:, :4] = -100
    labels[2, 6:] = -100
    loss = loss_fn(input_ids, labels)
    loss.backward()
    mine = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    trained = labels[:, 1:] != -100
    with torch.no_grad():
        teacher_logits = teacher(input_ids).logits[:, :-1][trained]
    expected = plain_jsd(student(input_ids).logits[:, :-1][trained].double(), teacher_logits.double(), 0.5, 0.9).sum()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for name, p in student.named_parameters():
        torch.testing.assert_close(mine[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    stats = loss_fn.pop_stats()
    with torch.no_grad():
        p = torch.softmax(student(input_ids).logits[:, :-1][trained].double() / 0.9, dim=-1)
    assert float(stats["entropy"]) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert all(not p.requires_grad for p in teacher.parameters())


def problems_of(**fields) -> list[str]:
    return validate(Recipe(model_name_or_path=str(TINY), dataset_name=str(REPO / "data" / "chat.jsonl"), **fields))


def test_recipe_rules():
    assert any("needs teacher_model_name_or_path" in p for p in problems_of(objective="distill"))
    assert problems_of(objective="distill", lmbda=0.5, teacher_model_name_or_path=str(TINY)) == []
    said = " ".join(problems_of(objective="distill", teacher_model_name_or_path=str(TINY), beta=1.5, lmbda=2.0,
                                packing=True, temperature=0.0))
    for part in ("beta must be in [0, 1]", "lmbda must be in [0, 1]", "packing with objective distill",
                 "temperature must be > 0"):
        assert part in said
    assert problems_of(objective="distill", teacher_model_name_or_path=str(TINY), beta=0.0) == []
    assert any("teacher_model_name_or_path is set but objective=sft" in p
               for p in problems_of(teacher_model_name_or_path=str(TINY)))


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    recipe = Recipe(model_name_or_path=str(TINY), objective="distill", teacher_model_name_or_path=str(TINY))
    assert teacher_problems(recipe, tokenizer) == []
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(TINY)
    model.resize_token_embeddings(760)
    model.save_pretrained(other)
    shrunk = AutoTokenizer.from_pretrained(TINY)
    shrunk.add_tokens(["<extra_a>", "<extra_b>"])
    shrunk.save_pretrained(other)
    (said,) = teacher_problems(Recipe(model_name_or_path=str(TINY), objective="distill",
                                      teacher_model_name_or_path=str(other)), tokenizer)
    assert "must share one tokenizer and vocabulary" in said
    assert "has vocab_size 760 but the student" in said and "'<extra_a>': 753" in said


def test_the_lmbda_coin_is_a_function_of_seed_and_step():
    assert not any(on_policy_step(42, 0.0, step) for step in range(1, 500))
    assert all(on_policy_step(42, 1.0, step) for step in range(1, 500))
    draws = [on_policy_step(42, 0.3, step) for step in range(1, 4001)]
    assert 0.27 < sum(draws) / len(draws) < 0.33
    assert draws == [on_policy_step(42, 0.3, step) for step in range(1, 4001)]
    assert draws != [on_policy_step(7, 0.3, step) for step in range(1, 4001)]


def test_the_memory_estimate_counts_the_teacher_where_hftrain_places_it():
    """`hftrain estimate --objective distill --teacher`: the teacher's weights per GPU, per strategy (a copy in the
    loaded dtype for one GPU / DDP, 16-bit engine weights under ZeRO-1/2, 1/g under ZeRO-3 and FSDP, in host memory
    with parameter offload, in the base's dtype beside a LoRA student)."""
    student, teacher = model_shape(str(TINY), False), model_shape(str(REPO / "models" / "llama-3-70b-shape"), False)
    t, g = teacher.params, 4
    alone = {r.strategy: r for r in estimate(student, g, 1, 512).rows}
    rows = {r.strategy: r for r in estimate(student, g, 1, 512, objective="distill", teacher=teacher).rows}
    added = {name: rows[name].weights - alone[name].weights for name in rows}
    assert added["DDP"] == 4 * t and added["ZeRO-1"] == added["ZeRO-2"] == 2 * t
    assert added["ZeRO-3"] == 2 * t / g and added["FSDP full shard"] == 4 * t / g
    assert added["LoRA r=16 (DDP)"] == added["QLoRA r=16 (DDP)"] == 2 * t
    offload = "ZeRO-3 + parameter and optimizer offload"
    assert added[offload] == 0 and rows[offload].cpu - alone[offload].cpu == 2 * t / g
    assert f"{t / 1e9:,.2f}B-parameter teacher" in rows["DDP"].note


def test_the_report_plots_distills_entropy(tmp_path):
    train = [{"step": s, "loss": 1.0 / s, "entropy": 6.0 - s, "learning_rate": 1e-3} for s in (1, 2, 3)]
    made = plot_all(train, [{"step": 3, "eval_loss": 0.4, "eval_entropy": 3.5}], tmp_path)
    assert tmp_path / "distill.png" in made and (tmp_path / "distill.png").stat().st_size > 0
