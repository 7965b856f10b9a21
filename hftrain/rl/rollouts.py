"""Rollouts of objective grpo: which prompts a generation window holds (`WindowPlan`), sampling them with
transformers' `generate` (`generate_group`), the window's buffer (`Window`) and its rows of rollouts.jsonl.

Layout. A generation window holds per_device_train_batch_size x processes x steps_per_generation completions:
`prompts_per_window` prompts (a permutation of the data seeded by (seed, epoch)), each sampled num_generations
times. Rank r trains the window's completions [r x b x S, (r + 1) x b x S), micro-batch k the b after k x b of them.
A window is trained for steps_per_generation x num_iterations / gradient_accumulation_steps optimizer steps.

Sampling is seeded per prompt group: the group's generator seed depends only on (seed, window, group), so the
same run on any number of processes, with any accumulation, samples the same completions, and a resumed run samples
what the uninterrupted run sampled (no RNG state has to travel). A rank generates the whole groups its
completions belong to (when b x S is not a multiple of num_generations two ranks generate a shared group, and each
keeps its own completions).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from hftrain.data import IGNORE_INDEX


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


@dataclass
class Prompt:
    value: object  # the dataset's prompt: text, or a list of chat messages
    text: str  # rendered (chat template with the generation prompt for messages)
    ids: list[int]
    columns: dict  # the row's other columns, passed to the reward functions


PASSED_OVER = ("prompt", "completion", "completion_ids")  # columns TRL does not pass to reward functions


def render_prompts(dataset, tokenizer, max_prompt_length: int | None) -> list[Prompt]:
    """Every row's prompt rendered and tokenized; with max_prompt_length the last tokens are kept (next to where
    the completion starts)."""
    prompts = []
    for row in dataset:
        value = row["prompt"]
        if is_conversational(value):
            text = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = value
            ids = tokenizer(text)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
            text = tokenizer.decode(ids)
        prompts.append(Prompt(value, text, list(ids), {k: v for k, v in row.items() if k not in PASSED_OVER}))
    return prompts


@dataclass(frozen=True)
class WindowPlan:
    """Which prompts and completions each generation window, rank and micro-batch holds (module docstring)."""

    num_prompts: int
    num_generations: int
    micro_batch: int
    world: int
    accum: int
    steps_per_generation: int
    num_iterations: int
    seed: int
    shuffle: bool = True

    @property
    def window_size(self) -> int:  # completions per window, all ranks
        return self.micro_batch * self.world * self.steps_per_generation

    @property
    def prompts_per_window(self) -> int:
        return self.window_size // self.num_generations

    @property
    def windows_per_epoch(self) -> int:
        return self.num_prompts // self.prompts_per_window

    @property
    def steps_per_window(self) -> int:
        return self.steps_per_generation * self.num_iterations // self.accum

    @property
    def steps_per_epoch(self) -> int:
        return self.windows_per_epoch * self.steps_per_window

    @property
    def global_batch(self) -> int:  # completions per optimizer step
        return self.micro_batch * self.world * self.accum

    # BatchPlan's names, read by checkpoint.realign: a step trains global_batch "examples"
    @property
    def num_examples(self) -> int:
        return self.steps_per_epoch * self.global_batch

    def window_prompts(self, window: int) -> list[int]:
        """Dataset indices of window `window`'s prompts (counted over the whole run)."""
        epoch, position = divmod(window, self.windows_per_epoch)
        if self.shuffle:
            order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(
                self.seed * 100_003 + epoch)).tolist()
        else:
            order = list(range(self.num_prompts))
        return order[position * self.prompts_per_window:(position + 1) * self.prompts_per_window]

    def rank_rows(self, rank: int) -> range:
        """The window completions rank `rank` trains (indices into the window's G x prompts rows)."""
        per_rank = self.micro_batch * self.steps_per_generation
        return range(rank * per_rank, (rank + 1) * per_rank)

    def micro_batches(self, epoch: int, rank: int, start_step: int = 0):
        """(window, micro-batch index, iteration) of this rank's micro-batches from `start_step` of `epoch` on."""
        for step in range(start_step, self.steps_per_epoch):
            window_in_epoch, position = divmod(step, self.steps_per_window)
            window = epoch * self.windows_per_epoch + window_in_epoch
            for j in range(self.accum):
                iteration, micro = divmod(position * self.accum + j, self.steps_per_generation)
                yield window, micro, iteration

    def first_step(self, window: int) -> int:
        """The optimizer step (from 1) that trains the window's first micro-batches."""
        return window * self.steps_per_window + 1


def group_seed(seed: int, window: int, group: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{window}:{group}".encode()).digest()[:8], "little") % 2**63


@dataclass(frozen=True)
class Sampling:
    """generate's settings (GRPOConfig's names)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    mask_truncated_completions: bool = False


@torch.no_grad()
def generate_group(lm, prompt_ids: list[int], n: int, sampling: Sampling, seed: int, eos_ids: set[int],
                   pad_id: int) -> list[tuple[list[int], bool]]:
    """`n` completions of one prompt, sampled with a generator seeded by `seed` (the caller's RNG is untouched):
    each (its tokens up to and including the first EOS, whether it was truncated at max_completion_length)."""
    device = next(lm.parameters()).device
    input_ids = torch.tensor([prompt_ids] * n, device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = lm.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                          max_new_tokens=sampling.max_completion_length, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k or None,
                          repetition_penalty=sampling.repetition_penalty, pad_token_id=pad_id,
                          eos_token_id=sorted(eos_ids), use_cache=True)
    completions = []
    for row in out[:, len(prompt_ids):].tolist():
        end = next((i for i, token in enumerate(row) if token in eos_ids), None)
        completions.append((row if end is None else row[:end + 1], end is None))
    return completions


@dataclass
class Completion:
    """One rollout: the group (prompt index within the window) it belongs to, its tokens and its score."""

    row: int  # index within the window
    group: int
    prompt: int  # dataset index
    completion_ids: list[int]
    truncated: bool
    rewards: list[float] = field(default_factory=list)  # per function, NaN for None
    reward: float = math.nan
    advantage: float = 0.0


def collate(prompt_ids: list[list[int]], completions: list[Completion], advantages: torch.Tensor, pad_id: int,
            mask_truncated: bool) -> dict[str, torch.Tensor]:
    """A micro-batch: prompt + completion right-padded (a causal model never attends to the right padding, so no
    attention mask), labels = the trained completion tokens (-100 elsewhere; a truncated completion is not trained
    with mask_truncated_completions), each completion's advantage, `num_examples`."""
    rows = [p + c.completion_ids for p, c in zip(prompt_ids, completions)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        row = p + c.completion_ids
        input_ids[i, :len(row)] = torch.tensor(row)
        if not (mask_truncated and c.truncated):
            labels[i, len(p):len(row)] = torch.tensor(c.completion_ids, dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels, "advantages": advantages.to(torch.float32),
            "num_examples": torch.tensor(len(rows))}
