"""Where grpo's completions are sampled: a rollout generator, chosen once by `build_generator` from the recipe
(transformers' `generate`, or vLLM with `use_vllm: true`). The rollout source (`rl.grpo.Rollouts`) calls
`generator.sample(prompts, seeds)` at the start of each generation window and does the rest (rewards, advantages,
rollouts.jsonl, the checkpointed buffer, metrics) the same way whichever generator sampled.

Both generators return, for prompt i, one completion sampled with seeds[i] (`rollouts.row_seed`): its tokens up to
and including the first EOS, whether it was truncated (no EOS within max_completion_length) and, from vLLM, its
sampling log-probs (for the importance-sampling correction; None from transformers, whose samples come from the
trained model itself).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from hftrain.rl.rollouts import Sampled, Sampling, generate_rows
from hftrain.rl.vllm_generation import VLLMGenerator


class RolloutGenerator(Protocol):
    def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        """Prompt i's completion, sampled with seeds[i]; every process calls it at once (a window's start)."""
        ...


class TransformersGenerator:
    """transformers' `generate` on the trained model, inside the backend's `generation_context` (ZeRO-3 gathers the
    weights, FSDP2 generates through its shards; `rollouts.generate_rows`: one call per window, Gumbel-max noise from
    each completion's own generator) and inside `autocast`, the accelerator's mixed-precision context: the training
    forward runs under it (prepare wraps the loss module's forward, not the causal LM's that generate calls), so with
    bf16 the completions are sampled from the policy the loss trains, at its speed, as TRL's generate runs inside
    accelerate's autocast-wrapped forward (a no-op without mixed precision, and under DeepSpeed, whose engine holds
    bf16 weights)."""

    def __init__(self, backend, model, sampling: Sampling, eos_ids: set[int], pad_id: int,
                 autocast: Callable[[], AbstractContextManager] = nullcontext):
        self.backend, self.model, self.sampling, self.eos_ids, self.pad_id = backend, model, sampling, eos_ids, pad_id
        self.autocast = autocast

    def sample(self, prompts: list[list[int]], seeds: list[int], inputs: list[dict] | None = None) -> list[Sampled]:
        """`inputs`: an image-text model's per-prompt processor outputs (hftrain.rl.images), generated with."""
        # every rank at once; a sequence-parallel group's ranks each generate the whole sequences
        with self.backend.generation_context(self.model) as (lm, synced_gpus), self.autocast(), \
                self.backend.whole_sequences():
            rows = generate_rows(lm, prompts, seeds, self.sampling, self.eos_ids, self.pad_id, synced_gpus,
                                 inputs=inputs)
        return [Sampled(ids, truncated) for ids, truncated in rows]

    def describe(self) -> str:
        return "transformers' generate"


def build_generator(recipe, backend, model, lm, accelerator, sampling: Sampling, eos_ids: set[int],
                    pad_id: int) -> RolloutGenerator:
    """The recipe's generator, once the backend has prepared `model` (`lm`: the causal LM (or peft model) inside the
    loss wrapper, whose weights vLLM receives). The vllm package is imported only when a recipe asks for it."""
    if recipe.use_vllm:
        return VLLMGenerator(recipe, lm, accelerator, sampling, eos_ids)
    return TransformersGenerator(backend, model, sampling, eos_ids, pad_id, autocast=accelerator.autocast)
