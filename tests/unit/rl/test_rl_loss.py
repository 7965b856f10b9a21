"""GRPO's loss over fixed rollouts (hftrain.rl.loss) against (a) TRL's formula written out here, one completion
and one token at a time, and (b) TRL 1.16's own `GRPOTrainer._compute_loss` called on the same tensors with a
stand-in trainer (its model call returns the fixed log-probs). Each micro-batch split and process count is
compared as the loop combines them: the micro-batch sums added over the step, divided by the step's units."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hftrain.rl.loss import (
    LOSS_TYPES,
    LossSettings,
    clip_statistics,
    completion_log_probs,
    group_advantages,
    loss_units,
    micro_batch_loss,
    per_token_loss,
)

N, T, G, MAX_LEN = 8, 5, 4, 6  # completions of the generation batch, padded length, group size, max_completion_length


def rollouts(seed: int = 0, beta: bool = False, old: bool = False):
    """Fixed rollouts: log-probs (leaf, requires grad), optional stored old and reference log-probs, advantages
    (some positive, some negative) and a completion mask with varied lengths (one empty completion)."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(N, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old_logps = (logps.detach() + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)) if old else None
    ref = logps.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64) if beta else None
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 4, 0, 2, 5, 3])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return logps, old_logps, ref, adv, mask


def trl_formula(logps, old, ref, adv, mask, s: LossSettings, micro: int, processes: int) -> torch.Tensor:
    """TRL 1.16's loss of a whole generation batch, written independently: per token, per completion, then each
    loss type's normalisation of `micro`-completion micro-batches, summed over accumulation and averaged over
    processes (DDP) as TRL's trainer does."""
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    old = logps.detach() if old is None else old
    per_rank = N // processes
    accum = per_rank // micro
    tokens_all = int(mask.sum())
    total = 0.0
    for rank in range(processes):
        for k in range(accum):
            rows = range(rank * per_rank + k * micro, rank * per_rank + (k + 1) * micro)
            token_losses = {}
            for i in rows:
                n_i = int(mask[i].sum())
                zero = torch.zeros((), dtype=torch.float64)
                seq_ratio = torch.exp(sum((logps[i, t] - old[i, t] for t in range(n_i)), zero) / max(1, n_i))
                for t in range(n_i):
                    ratio = torch.exp(logps[i, t] - old[i, t]) if s.importance_sampling_level == "token" else seq_ratio
                    if s.loss_type == "cispo":  # MiniMax-M1: REINFORCE weighted by the ratio clipped at eps_high
                        loss = -min(ratio.item(), hi) * adv[i] * logps[i, t]
                    elif s.loss_type == "sapo":  # a sigmoid gate of temperature tau (float32, as TRL's torch.where)
                        tau = float(torch.tensor(s.sapo_temperature_pos if adv[i] > 0 else s.sapo_temperature_neg,
                                                 dtype=torch.float32))
                        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv[i]
                    else:
                        clipped = torch.clamp(ratio, 1 - lo, 1 + hi)
                        loss = -torch.min(ratio * adv[i], clipped * adv[i])
                    if s.beta:
                        d = ref[i, t] - logps[i, t]
                        loss = loss + s.beta * (torch.exp(d) - d - 1) * ratio
                    token_losses[i, t] = loss
            micro_sum = sum(token_losses.values(), torch.zeros((), dtype=torch.float64))
            micro_tokens = sum(int(mask[i].sum()) for i in rows)
            if s.loss_type in ("dapo", "cispo"):  # all tokens of the generation batch / processes x accum / accum
                part = micro_sum / (tokens_all / processes)
            elif s.loss_type in ("grpo", "sapo"):
                per_seq = [sum((token_losses[i, t] for t in range(int(mask[i].sum()))),
                               torch.zeros((), dtype=torch.float64)) / max(1, int(mask[i].sum())) for i in rows]
                part = sum(per_seq) / micro / accum
            elif s.loss_type == "bnpo":
                part = micro_sum / max(1, micro_tokens) / accum
            else:  # dr_grpo
                part = micro_sum / (micro * s.max_completion_length) / accum
            total = total + part / processes  # DDP averages the processes' gradients
    return total


def ours(logps, old, ref, adv, mask, s: LossSettings, micro: int) -> torch.Tensor:
    """hftrain's: micro-batch sums (per_token_loss + micro_batch_loss) added over the step and divided once by the
    step's units, as the loop does; the process split does not change this sum."""
    total, units = 0.0, 0
    for start in range(0, N, micro):
        rows = slice(start, start + micro)
        loss, _, _ = per_token_loss(logps[rows], None if old is None else old[rows],
                                    None if ref is None else ref[rows], adv[rows], mask[rows], s)
        total = total + micro_batch_loss(loss, mask[rows], s)
        units += int(loss_units(mask[rows], s.loss_type))
    return total / units


SPLITS = [(8, 1), (2, 1), (2, 2)]  # (micro-batch, processes): 1 x 8, accumulation 4 x 2, 2 processes x 2 x 2
# cispo's epsilon_high is the ratio's upper clip itself: 1.1 clips some of these ratios (0.28 would clip nearly all)
EPSILON_HIGH = {**dict.fromkeys(LOSS_TYPES, 0.28), "cispo": 1.1}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_and_gradient_match_trl_formula(loss_type, level):
    """Every loss type, both importance-sampling levels, stored old log-probs (ratios away from 1, so clipping on
    both sides happens), beta > 0 and an asymmetric epsilon_high: the loss and its gradient equal TRL's formula for
    every micro-batch split and process count of the generation batch that TRL's normalisation makes equal."""
    s = LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=EPSILON_HIGH[loss_type], beta=0.04,
                     importance_sampling_level=level, max_completion_length=MAX_LEN, sapo_temperature_pos=0.9,
                     sapo_temperature_neg=1.3)
    logps, old, ref, adv, mask = rollouts(beta=True, old=True)
    for micro, processes in SPLITS:
        if loss_type == "bnpo" and (micro, processes) != (8, 1):
            continue  # bnpo normalises each micro-batch by its own tokens: split-dependent in TRL too (below)
        expected = trl_formula(logps, old, ref, adv, mask, s, micro, processes)
        (want_grad,) = torch.autograd.grad(expected, logps)
        got = ours(logps, old, ref, adv, mask, s, 2 if processes > 1 else micro)
        (got_grad,) = torch.autograd.grad(got, logps)
        assert got.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12), (micro, processes)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_bnpo_depends_on_the_split_as_in_trl():
    """bnpo is TRL's per-micro-batch token mean averaged over micro-batches: hftrain keeps that (so a recipe moved
    from TRL trains the same), and the difference from the whole-batch mean is real on these rollouts."""
    s = LossSettings(loss_type="bnpo", max_completion_length=MAX_LEN)
    logps, _, _, adv, mask = rollouts()
    whole = ours(logps, None, None, adv, mask, s, 8)
    split = ours(logps, None, None, adv, mask, s, 2)
    assert split.item() == pytest.approx(trl_formula(logps, None, None, adv, mask, s, 2, 1).item(), rel=1e-12)
    assert abs(split.item() - whole.item()) > 1e-3


def test_first_pass_ratio_is_one_with_the_policy_gradient():
    """Without stored old log-probs the ratio is exactly 1 and, for dapo, the gradient is -A_i m / tokens per token."""
    s = LossSettings(max_completion_length=MAX_LEN)
    logps, _, _, adv, mask = rollouts()
    loss, ratio, kl = per_token_loss(logps, None, None, adv, mask, s)
    assert kl is None and torch.equal(ratio, torch.ones_like(ratio))
    (grad,) = torch.autograd.grad(micro_batch_loss(loss, mask, s) / loss_units(mask, "dapo"), logps)
    torch.testing.assert_close(grad, -adv.unsqueeze(1) * mask / mask.sum(), rtol=1e-12, atol=1e-15)


def test_log_probs_divide_the_logits_by_the_temperature():
    g = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g)
    logps, entropy = completion_log_probs(logits, tokens, temperature=0.7)
    for b in range(2):
        for t in range(3):
            p = torch.softmax(logits[b, t].double() / 0.7, dim=0)
            assert logps[b, t].item() == pytest.approx(math.log(p[tokens[b, t]].item()), abs=1e-5)
            assert entropy[b, t].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def plain_advantages(rewards_per_func, weights, scale):
    """TRL's advantages one completion at a time: nan-weighted sums, group mean, Bessel std (group or batch)."""
    n = len(rewards_per_func)
    rewards = []
    for row in rewards_per_func.tolist():
        scored = [w * r for w, r in zip(weights, row) if not math.isnan(r)]
        rewards.append(sum(scored) if scored else math.nan)

    def std(values):
        vals = [v for v in values if not math.isnan(v)]
        m = sum(vals) / len(vals)
        return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))

    out = []
    for i in range(n):
        group = rewards[i // G * G:(i // G + 1) * G]
        scored = [v for v in group if not math.isnan(v)]
        a = rewards[i] - sum(scored) / len(scored)
        if scale == "group":
            a /= std(group) + 1e-4
        elif scale == "batch":
            a /= std(rewards) + 1e-4
        out.append(0.0 if math.isnan(a) else a)
    return rewards, out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages(scale):
    """Weighted rewards with None (NaN) from one function, one completion no function scored (advantage 0, left
    out of its group's statistics) and one group whose rewards are all equal (advantage 0, flagged)."""
    r = torch.tensor([[1.0, 0.5], [0.0, math.nan], [2.0, 1.0], [math.nan, math.nan],
                      [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    weights = [1.0, -0.5]
    rewards, adv, zero_std = group_advantages(r, torch.tensor(weights), G, scale)
    want_rewards, want_adv = plain_advantages(r, weights, scale)
    torch.testing.assert_close(rewards, torch.tensor(want_rewards), equal_nan=True)
    torch.testing.assert_close(adv, torch.tensor(want_adv), rtol=1e-5, atol=1e-6)
    assert adv[3] == 0 and torch.all(adv[4:] == 0)
    if scale != "batch":
        assert zero_std.tolist() == [False] * 4 + [True] * 4


def test_nanstd_is_trls():
    from trl.trainer.utils import nanstd as trl_nanstd

    from hftrain.rl.loss import nanstd

    x = torch.tensor([[1.0, math.nan, 3.0, 4.0], [2.0, 2.0, 5.0, math.nan]])
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1))
    torch.testing.assert_close(nanstd(x), trl_nanstd(x))


# ----------------------------------------------------------------------------------- TRL 1.16's own _compute_loss
class _Accelerator:
    def __init__(self, processes):
        self.num_processes = processes

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


def trl_compute_loss(logps, old, ref, adv, mask, s: LossSettings, micro: int, processes: int, temperature=1.0):
    """TRL's `GRPOTrainer._compute_loss` on each micro-batch, with a stand-in trainer whose model call returns the
    given log-probs; summed over accumulation and averaged over processes as its trainer's backward and DDP do."""
    from trl import GRPOTrainer

    per_rank = N // processes
    accum = per_rank // micro
    total = 0.0
    for start in range(0, N, micro):
        rows = slice(start, start + micro)
        trainer = SimpleNamespace(
            top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
            importance_sampling_level=s.importance_sampling_level, beta=s.beta, loss_type=s.loss_type,
            epsilon_low=s.epsilon, epsilon_high=s.upper, use_vllm=False, model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=accum, max_completion_length=s.max_completion_length,
            accelerator=_Accelerator(processes), _entropy_bonus_enabled=False,
            _metrics=defaultdict(lambda: defaultdict(list)),
            args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=accum,
                                 sapo_temperature_pos=s.sapo_temperature_pos,
                                 sapo_temperature_neg=s.sapo_temperature_neg),
            _get_per_token_logps_and_entropies=lambda *a, _r=rows, **k: (logps[_r], torch.zeros_like(logps[_r]), None),
        )
        inputs = {"prompt_ids": torch.zeros(micro, 2, dtype=torch.long), "prompt_mask": torch.ones(micro, 2),
                  "completion_ids": torch.zeros(micro, T, dtype=torch.long), "completion_mask": mask[rows],
                  "advantages": adv[rows], "num_items_in_batch": mask.sum().double()}
        if old is not None:
            inputs["old_per_token_logps"] = old[rows]
        if ref is not None:
            inputs["ref_per_token_logps"] = ref[rows]
        total = total + GRPOTrainer._compute_loss(trainer, None, inputs) / processes
    return total, trainer._metrics["train"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_against_trl_compute_loss(loss_type):
    """TRL 1.16's own code on the same tensors: 1 x 8, accumulation 4 x 2 and 2 processes x 2 x 2 (bnpo: 1 x 8 and
    4 x 2, which TRL normalises per micro-batch), token and sequence level, old and reference log-probs."""
    logps, old, ref, adv, mask = rollouts(seed=3, beta=True, old=True)
    for level in ("token", "sequence"):
        s = LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=EPSILON_HIGH[loss_type], beta=0.04,
                         importance_sampling_level=level, max_completion_length=MAX_LEN, sapo_temperature_pos=0.9,
                         sapo_temperature_neg=1.3)
        for micro, processes in SPLITS:
            if loss_type == "bnpo" and processes > 1:
                continue
            expected, metrics = trl_compute_loss(logps, old, ref, adv, mask, s, micro, processes)
            (want_grad,) = torch.autograd.grad(expected, logps)
            got = ours(logps, old, ref, adv, mask, s, micro)
            (got_grad,) = torch.autograd.grad(got, logps)
            assert got.item() == pytest.approx(expected.item(), rel=1e-10), (level, micro, processes)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    # TRL's clip-ratio metrics for one micro-batch of the whole batch equal clip_statistics' sums / counts
    s = LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=EPSILON_HIGH[loss_type],
                     max_completion_length=MAX_LEN)
    _, metrics = trl_compute_loss(logps, old, None, adv, mask, s, N, 1)
    _, ratio, _ = per_token_loss(logps, old, None, adv, mask, s)
    statistics = clip_statistics(ratio, adv, mask, s)
    # the same metric names as TRL (sapo: none; cispo: cispo_clip_ratio), and some clipping happened
    assert set(statistics) == {name for name in metrics if "clip" in name and not name.endswith(("_min", "_max"))}
    assert loss_type == "sapo" or any(value > 0 for value, _ in statistics.values())
    for name, (value, count) in statistics.items():
        assert (value / count).item() == pytest.approx(metrics[name][-1], rel=1e-6), name


# ----------------------------------------------------------------------------------- RLOO's leave-one-out advantages
def plain_rloo(rewards_per_func, weights, kl, normalize):
    """RLOOTrainer's advantages one completion at a time (TRL 1.16 `_generate_and_score_completions`): the weighted
    reward minus the KL penalty, minus the mean of the other scored rewards of its group; then optionally
    standardised over the batch (Bessel std, + 1e-4); unscored (or alone in its group) -> 0."""
    rewards = []
    for row, k in zip(rewards_per_func.tolist(), kl):
        scored = [w * r for w, r in zip(weights, row) if not math.isnan(r)]
        rewards.append(sum(scored) - k if scored else math.nan)
    adv = []
    for i, r in enumerate(rewards):
        others = [v for j, v in enumerate(rewards[i // G * G:(i // G + 1) * G]) if j != i % G and not math.isnan(v)]
        adv.append(math.nan if math.isnan(r) or not others else r - sum(others) / len(others))
    if normalize:
        vals = [a for a in adv if not math.isnan(a)]
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((a - m) ** 2 for a in vals) / (len(vals) - 1))
        adv = [(a - m) / (sd + 1e-4) for a in adv]
    return [0.0 if math.isnan(a) else a for a in adv]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("with_kl", [False, True])
def test_leave_one_out_advantages_are_rloos(normalize, with_kl):
    """Weighted rewards with None, one completion no function scored (advantage 0, left out of its siblings'
    baselines), one group whose rewards are equal; the KL penalty (beta x summed first-order KL) enters the reward
    before the baseline; the logged reward is the unpenalised one, as RLOOTrainer logs it."""
    from hftrain.rl.loss import leave_one_out_advantages

    r = torch.tensor([[1.0, 0.5], [0.0, math.nan], [2.0, 1.0], [math.nan, math.nan],
                      [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    weights = [1.0, -0.5]
    kl = torch.tensor([0.3, -0.1, 0.0, 0.7, 0.2, 0.0, -0.4, 0.1]) if with_kl else None
    rewards, adv, zero_std = leave_one_out_advantages(r, torch.tensor(weights), G, normalize, kl)
    want = plain_rloo(r, weights, kl.tolist() if with_kl else [0.0] * N, normalize)
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert adv[3] == 0
    torch.testing.assert_close(rewards, torch.tensor([0.75, 0.0, 1.5, math.nan, 0.5, 0.5, 0.5, 0.5]), equal_nan=True)
    assert zero_std.tolist() == [False] * 4 + [not with_kl] * 4
    if not normalize and not with_kl:  # the leave-one-out baseline differs from GRPO's group mean
        _, grpo_adv, _ = group_advantages(r, torch.tensor(weights), G, "none")
        assert not torch.allclose(adv, grpo_adv)
