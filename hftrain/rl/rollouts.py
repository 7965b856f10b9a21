"""Rollouts of objective grpo: which prompts a generation window holds (`WindowPlan`), sampling them with
transformers' `generate` (`generate_rows`), collation into micro-batches.

Layout. A generation window holds per_device_train_batch_size x processes x steps_per_generation completions:
`prompts_per_window` prompts (a permutation of the data seeded by (seed, epoch)), each sampled num_generations
times. Rank r trains the window's completions [r x b x S, (r + 1) x b x S), micro-batch k the b after k x b of them.
A window is trained for steps_per_generation x num_iterations / gradient_accumulation_steps optimizer steps.

Sampling. A rank samples all its completions of a window in one `generate` call (its prompts left-padded), and each
completion draws its sampling noise from a generator of its own, seeded by (seed, window, group, index in the group)
(`row_seed`, `RowSeededSampling`). So the same run on any number of processes, with any accumulation, samples the
same completions (up to the float rounding of a differently padded batch), and a resumed run samples what the
uninterrupted run sampled: the seeds are derived, no RNG state has to travel in a checkpoint.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hftrain.data import IGNORE_INDEX
from hftrain.data.image_chats import PER_TOKEN_PAD


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


@dataclass
class Prompt:
    value: object  # the dataset's prompt: text, or a list of chat messages
    text: str  # rendered (chat template with the generation prompt for messages)
    ids: list[int]
    columns: dict  # the row's other columns, passed to the reward functions
    # an image-text model's prompt (hftrain.rl.images): its images as the data names them (rollouts.jsonl) and where
    # each is read from (a path made absolute, or the image itself); None for a text model
    images: list | None = None
    image_sources: list | None = None


PASSED_OVER = ("prompt", "completion", "completion_ids")  # columns TRL does not pass to reward functions


def render_prompt(value, columns: dict, tokenizer, max_prompt_length: int | None, tools=None) -> Prompt:
    """One prompt rendered (chat messages with the generation prompt and, with tool calling, the tools' schemas, as
    TRL renders them: `apply_chat_template(tools=...)`) and tokenized; with max_prompt_length the last tokens are
    kept (next to where the completion starts)."""
    if is_conversational(value):
        text = tokenizer.apply_chat_template(value, tools=tools or None, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = value
        ids = tokenizer(text)["input_ids"]
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        ids = ids[-max_prompt_length:]
        text = tokenizer.decode(ids)
    return Prompt(value, text, list(ids), columns)


def render_prompts(dataset, tokenizer, max_prompt_length: int | None, tools=None) -> list[Prompt]:
    """Every row's prompt rendered and tokenized (`render_prompt`)."""
    return [render_prompt(row["prompt"], {k: v for k, v in row.items() if k not in PASSED_OVER}, tokenizer,
                          max_prompt_length, tools) for row in dataset]


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


def row_seed(seed: int, window: int, group: int, index: int, turn: int = 0) -> int:
    """The seed of one completion's sampling noise: completion `index` of prompt `group` of generation window
    `window` (independent of the process count, the accumulation and the other rows of its batch); `turn`: the
    model's turn after `turn` rounds of tool calls (tool calling), each with noise of its own."""
    key = f"{seed}:{window}:{group}:{index}{f':{turn}' if turn else ''}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 2**63


@dataclass(frozen=True)
class Sampling:
    """generate's settings (GRPOConfig's names)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    mask_truncated_completions: bool = False
    suppress_tokens: tuple[int, ...] = ()  # never sampled: an image-text model's image tokens (as TRL suppresses)


# A micro-batch's keys other than the model's inputs; every other key (an image-text processor's pixel_values,
# image_sizes, token_type_ids, ...: hftrain.rl.images) goes to the model's forward as it is
ROLLOUT_KEYS = ("input_ids", "labels", "advantages", "num_examples", "old_logps", "ref_logps", "sampling_weights")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch's image inputs (nothing for text prompts)."""
    return {k: v for k, v in batch.items() if k not in ROLLOUT_KEYS}


def batch_inputs(rows: list[dict[str, torch.Tensor]], lengths: list[int], width: int,
                 left: bool) -> dict[str, torch.Tensor]:
    """Per-row processor outputs (each a batch of 1; {} for a row without images) as one batch's, for rows
    `lengths` tokens long in a `width`-wide batch: per-token outputs (token_type_ids, mm_token_type_ids, ...) over
    each row's prompt, where the row sits (left-padded for generate, at the start for training), 0 elsewhere (the
    completion, a multi-turn context's turns and tool results after the prompt, the padding); per-image outputs
    (pixel_values, image_grid_thw, ...) concatenated in row order, as the model fills the image tokens in order."""
    out = {}
    for key in sorted({k for row in rows for k in row}):
        values = [row[key] for row in rows if key in row]
        if key in PER_TOKEN_PAD:
            padded = torch.zeros((len(rows), width), dtype=values[0].dtype)
            for i, (row, n) in enumerate(zip(rows, lengths)):
                if key in row:
                    start = width - n if left else 0
                    padded[i, start:start + row[key].shape[1]] = row[key][0]
            out[key] = padded
        else:
            out[key] = torch.cat(values)
    return out


class RowSeededSampling(LogitsProcessor):
    """Multinomial sampling with one generator per row, by the Gumbel-max trick: argmax(scores + G) with G =
    -log(-log(U)), U uniform, is a sample of softmax(scores). Last in generate's processor list (after the repetition
    penalty, temperature, top-k and top-p, the order of transformers' sampling) with greedy decoding, so each row's
    tokens depend only on its own generator and the model's scores for that row: a batch of any composition samples
    what the rows would sample alone, and the caller's RNG is untouched."""

    def __init__(self, seeds: list[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device)
                               for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))
        return scores.float() + gumbel


@torch.no_grad()
def generate_rows(lm, prompts: list[list[int]], seeds: list[int], sampling: Sampling, eos_ids: set[int],
                  pad_id: int, synced_gpus: bool = False, extra: list[LogitsProcessor] = (),
                  inputs: list[dict[str, torch.Tensor]] | None = None) -> list[tuple[list[int], bool]]:
    """One completion of each prompt, all in one `lm.generate` call (prompts left-padded), row i sampled with the
    generator seeded by seeds[i] (RowSeededSampling): each (its tokens up to and including the first EOS, whether it
    was truncated at max_completion_length). `lm` and `synced_gpus`: what the backend's `generation_context` gives
    (a causal LM, or the loss wrapper whose generate is the causal LM's). `extra`: processors that only observe
    (the rollout worker's progress beat), run first. `inputs`: an image-text model's per-row processor outputs
    (pixel_values, ...: hftrain.rl.images), passed to generate with the prompts (`batch_inputs`)."""
    out, width = sampled_sequences(lm, prompts, seeds, sampling, eos_ids, pad_id, synced_gpus, extra, inputs)
    return [cut_at_eos(row, eos_ids)[:2] for row in out[:, width:].tolist()]


def generate_rows_with_logps(lm, prompts: list[list[int]], seeds: list[int], sampling: Sampling, eos_ids: set[int],
                             pad_id: int, extra: list[LogitsProcessor] = ()
                             ) -> list[tuple[list[int], bool, list[float]]]:
    """`generate_rows` (the same tokens) with the sampler's log-prob of each kept token: log-softmax of generate's raw
    logits / temperature (before repetition penalty, suppression and the warpers, as the trained log-probs
    `rl.loss.token_log_probs` are), fp32. Generate's incremental forward rounds differently from a full forward over
    the finished rows, by about 1e-7 per token in fp32: the behaviour log-probs of vLLM's samples are a different
    computation from the trainer's too, and this costs no second forward."""
    out, width = sampled_sequences(lm, prompts, seeds, sampling, eos_ids, pad_id, False, extra, None, logits=True)
    logits = torch.stack(out.logits, dim=1).float() / sampling.temperature  # [B, new tokens, V]
    tokens = out.sequences[:, width:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    rows = []
    for row, row_logps in zip(tokens.tolist(), logps):
        kept, truncated, length = cut_at_eos(row, eos_ids)
        rows.append((kept, truncated, row_logps[:length]))
    return rows


def sampled_sequences(lm, prompts: list[list[int]], seeds: list[int], sampling: Sampling, eos_ids: set[int],
                      pad_id: int, synced_gpus: bool, extra: list[LogitsProcessor],
                      inputs: list[dict[str, torch.Tensor]] | None, logits: bool = False):
    """(generate's output: the sequences, or with `logits` a dict of them and each step's raw logits; the prompts'
    padded width)."""
    device = next(lm.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    warpers = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    # greedy over the noised scores is sampling; every sampling setting is explicit, so the model's own
    # generation_config (do_sample, temperature, top_k, ...) cannot add a second warper
    config = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_completion_length, temperature=1.0,
                              top_k=None, top_p=1.0, repetition_penalty=sampling.repetition_penalty,
                              pad_token_id=pad_id, eos_token_id=sorted(eos_ids), use_cache=True,
                              suppress_tokens=list(sampling.suppress_tokens) or None,
                              return_dict_in_generate=logits, output_logits=logits)
    images = batch_inputs(inputs, [len(p) for p in prompts], width, left=True) if inputs else {}
    out = lm.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                      generation_config=config, synced_gpus=synced_gpus,
                      **{k: v.to(device) for k, v in images.items()},
                      logits_processor=LogitsProcessorList([*extra, *warpers, RowSeededSampling(seeds, device)]))
    return out, width


@dataclass
class Sampled:
    """One completion as a generator returns it."""

    completion_ids: list[int]
    truncated: bool
    sampling_logps: list[float] | None = None  # the sampler's log-prob of each completion token (NaN: none given)
    # a multi-turn rollout with tool calls (hftrain.rl.tools): as in Completion
    tool_mask: list[int] | None = None
    tool_calls: list[dict] | None = None
    messages: list[dict] | None = None

    @property
    def model_tokens(self) -> int:
        return len(self.completion_ids) if self.tool_mask is None else sum(self.tool_mask)


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> tuple[list[int], bool, int]:
    """(tokens up to and including the first EOS, truncated: no EOS, the kept length): the same rule for every
    generator, so rows of rollouts.jsonl depend on the tokens only."""
    end = next((i for i, token in enumerate(tokens) if token in eos_ids), None)
    kept = tokens if end is None else tokens[:end + 1]
    return kept, end is None, len(kept)


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
    sampling_logps: list[float] | None = None  # the sampler's log-prob of each token (vLLM), NaN where none
    # tool calling (hftrain.rl.tools): 1 for each token the model sampled, 0 for the tool results and the template
    # tokens around them (never trained); the executed calls; the completion's messages (what reward functions see)
    tool_mask: list[int] | None = None
    tool_calls: list | None = None
    messages: list[dict] | None = None
    # the policy that sampled it: its version (weight pushes to the rollout worker; else the optimizer steps taken)
    # and its log-prob of each token (a sampler's own, else the trained model's at generation when computed)
    policy_version: int | None = None
    behaviour_logps: list[float] | None = None

    def behaviour_values(self) -> list[float | None] | None:
        """rollouts.jsonl's behaviour_logps: the sampler's log-probs, else the trained model's at generation, else
        None (not computed); null where a sampler gave none."""
        values = self.sampling_logps if self.sampling_logps is not None else self.behaviour_logps
        return None if values is None else [None if math.isnan(v) else v for v in values]

    @property
    def model_tokens(self) -> int:
        """The completion's length as TRL counts it: the tokens the model sampled."""
        return len(self.completion_ids) if self.tool_mask is None else sum(self.tool_mask)


def sampling_log_probs(prompt_ids: list[list[int]], completions: list[Completion], width: int) -> torch.Tensor:
    """The sampler's per-token log-probs of a micro-batch laid out as the trained log-probs ([B, width - 1]: position
    t predicts token t + 1, so completion token j of a prompt of length P sits at P - 1 + j), 0 elsewhere; NaN where
    the sampler gave none."""
    out = torch.zeros((len(completions), width - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        values = c.sampling_logps if c.sampling_logps is not None else [math.nan] * len(c.completion_ids)
        out[i, len(p) - 1:len(p) - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def collate(prompt_ids: list[list[int]], completions: list[Completion], advantages: torch.Tensor, pad_id: int,
            mask_truncated: bool, inputs: list[dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """A micro-batch: prompt + completion right-padded (a causal model never attends to the right padding, so no
    attention mask), labels = the trained completion tokens (-100 elsewhere: tool results (tool_mask 0) are never
    trained, and a truncated completion is not trained with mask_truncated_completions), each completion's advantage,
    `num_examples`; with an image-text model's per-row processor outputs (`inputs`), those as the batch's
    (`batch_inputs`): the prompts' pixels, read by every forward over the micro-batch."""
    rows = [p + c.completion_ids for p, c in zip(prompt_ids, completions)]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        row = p + c.completion_ids
        input_ids[i, :len(row)] = torch.tensor(row)
        if not (mask_truncated and c.truncated):
            trained = torch.tensor(c.completion_ids, dtype=torch.long)
            if c.tool_mask is not None:
                trained[torch.tensor(c.tool_mask) == 0] = IGNORE_INDEX
            labels[i, len(p):len(row)] = trained
    images = batch_inputs(inputs, [len(p) for p in prompt_ids], length, left=False) if inputs else {}
    return {"input_ids": input_ids, "labels": labels, "advantages": advantages.to(torch.float32),
            "num_examples": torch.tensor(len(rows)), **images}
