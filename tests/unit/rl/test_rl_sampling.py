"""Batched sampling of objective grpo (hftrain.rl.rollouts.generate_rows) against plain transformers on the tiny
model: each row's completion does not depend on the batch it is sampled in (left padding, other rows), and the
sampled tokens follow softmax(logits / temperature) restricted to the top-k, computed here from the plain model."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from hftrain.config import Recipe
from hftrain.rl.generation import build_generator
from hftrain.rl.rollouts import Sampling, generate_rows, generate_rows_with_logps
from tests.conftest import REPO

TINY = REPO / "models" / "tiny-llama"
EOS, PAD = {2}, 0


def load():
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


def test_a_row_samples_the_same_alone_and_in_a_padded_batch():
    model = load()
    short, long = [1, 45, 300], [1, 12, 99, 7, 250, 31, 400]
    sampling = Sampling(max_completion_length=6, temperature=0.9)
    batch = generate_rows(model, [long, short, long, short], [11, 12, 13, 14], sampling, EOS, PAD)
    alone = [generate_rows(model, [p], [s], sampling, EOS, PAD)[0] for p, s in
             zip([long, short, long, short], [11, 12, 13, 14])]
    assert batch == alone
    assert batch[0] != batch[2]  # the seeds differ, so do the samples (same prompt)
    rng = torch.get_rng_state()
    again = generate_rows(model, [short], [12], sampling, EOS, PAD)
    assert again == [batch[1]] and torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    for ids, truncated in batch:
        assert (len(ids) == 6 and not set(ids[:-1]) & EOS) if truncated else ids[-1] in EOS


def test_the_samplers_log_probs_are_the_full_forwards_on_the_same_tokens():
    """generate_rows_with_logps (the rollout worker's behaviour log-probs): the same rows as generate_rows, and for
    each kept token log_softmax(logits / temperature) of one plain forward over prompt + completion, before the
    repetition penalty and the suppressed tokens (what the trainer's log-probs are), within generate's incremental
    rounding."""
    model = load()
    prompts = [[1, 12, 99, 7, 250, 31, 400], [1, 45, 300], [1, 45, 300]]
    sampling = Sampling(max_completion_length=6, temperature=0.7, repetition_penalty=1.3, suppress_tokens=(5, 6))
    rows = generate_rows_with_logps(model, prompts, [3, 4, 5], sampling, EOS, PAD)
    assert [(ids, truncated) for ids, truncated, _ in rows] == generate_rows(model, prompts, [3, 4, 5], sampling,
                                                                              EOS, PAD)
    for prompt, (ids, _, logps) in zip(prompts, rows):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].double()
        want = torch.log_softmax(logits / 0.7, dim=-1)[len(prompt) - 1:-1].gather(-1, torch.tensor(ids)[:, None])
        assert len(logps) == len(ids)
        torch.testing.assert_close(torch.tensor(logps, dtype=torch.double), want[:, 0], rtol=0, atol=1e-5)


def test_first_tokens_follow_the_tempered_top_k_distribution():
    """4,000 first tokens of one prompt (4,000 seeds, one call) against the plain model's next-token distribution:
    softmax(logits / 0.7) over its 5 most likely tokens; every frequency within 4.5 standard errors."""
    model = load()
    prompt, n = [1, 45, 300, 17], 4000
    out = generate_rows(model, [prompt] * n, list(range(n)), Sampling(max_completion_length=1, temperature=0.7,
                                                                        top_k=5), EOS, PAD)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / 0.7
    top = logits.topk(5)
    probs = torch.softmax(top.values, dim=0)
    counts = torch.bincount(torch.tensor([ids[0] for ids, _ in out]), minlength=logits.numel()).double()
    assert counts.sum() == counts[top.indices].sum()  # nothing outside the top 5
    freq = counts[top.indices] / n
    stderr = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 4.5 * stderr + 1e-9).all(), (freq, probs)


def test_generation_runs_under_the_accelerators_autocast():
    """build_generator hands TransformersGenerator the accelerator's autocast: with bf16 every forward of generate
    runs in it (what the training forward does, inside the loss wrapper's autocast), without mixed precision none."""
    model = load()
    seen = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))

    @contextmanager
    def whole_model(m):
        yield m, False

    backend = SimpleNamespace(generation_context=whole_model, whole_sequences=nullcontext)
    sampling = Sampling(max_completion_length=3)
    for autocast, expected in ((lambda: torch.autocast("cpu", dtype=torch.bfloat16), (True, torch.bfloat16)),
                               (nullcontext, (False, None))):
        accelerator = SimpleNamespace(autocast=autocast)
        generator = build_generator(Recipe(), backend, model, model, accelerator, sampling, EOS, PAD)
        seen.clear()
        (sampled,) = generator.sample([[1, 45, 300]], [11])
        assert len(seen) >= 1 and len(sampled.completion_ids) <= 3
        assert {enabled for enabled, _ in seen} == {expected[0]}
        if expected[0]:
            assert {dtype for _, dtype in seen} == {expected[1]}
