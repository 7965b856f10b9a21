"""Knowledge distillation (recipe `objective: distill`): the student learns the teacher's next-token distributions,
as TRL 1.16's DistillationTrainer (trl/trainer/distillation_trainer.py, its chunked divergence in
trl/kernels/chunked_divergence.py) and GKDTrainer (trl/experimental/gkd) compute it.

Per trained token, with p_s = softmax(student logits / temperature) and p_t = softmax(teacher logits / temperature),
the generalized Jensen-Shannon divergence of the GKD paper (eq. 1), m = (1 - beta) p_s + beta p_t:

    beta = 0: KL(p_t || p_s) (forward KL);  beta = 1: KL(p_s || p_t) (reverse KL);
    else:     beta KL(p_t || m) + (1 - beta) KL(p_s || m)   (0.5: the JSD)

The loss module returns the sum over the micro-batch's trained tokens; the loop divides by the optimizer step's
trained tokens (all micro-batches and processes), which is DistillationTrainer's reduction (the divergence summed and
divided by the step's completion tokens) and GKDTrainer's with num_items_in_batch; temperature is applied inside the
loss as DistillationTrainer does (GKDTrainer leaves it out of its loss).

The teacher is a frozen model placed like a reference (`FrozenTeacher`: replicated, partitioned under ZeRO-3, sharded
under FSDP2). Its logits exist one chunk of tokens at a time (`chunked_divergence`): its forward returns the hidden
states of the trained positions, and each chunk is projected through its output head (gathered whole once per
micro-batch, as TRL's `full_tensor()`), compared with the student's and dropped; the divergence's gradient with
respect to the student's logits is computed in the same pass (closed form, as TRL's backward kernel), so no teacher
chunk is kept for the backward. The student's own logits of the trained tokens are held, as for sft.

Which completions: `lmbda` (GKDConfig's): 0 the dataset's (offline); 1 the student's own samples of each prompt
(on-policy, DistillationTrainer's way); in between, one coin per optimizer step drawn from (seed, step)
(`OnPolicyFeed`: the completions sampled in the step that trains on them, written to rollouts.jsonl as grpo's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from hftrain import hub
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.data.feeds import TrainingData
from hftrain.errors import HftrainError
from hftrain.jsonl import keep_through
from hftrain.loss import ObjectiveLoss
from hftrain.model import HEAD_ONLY_MODEL_TYPES, WrapsCausalLM, load_base_model, pad_token_id
from hftrain.objectives.base import Objective
from hftrain.objectives.reference import local_bytes
from hftrain.paths import ROLLOUTS_FILE
from hftrain.rl.generation import build_generator
from hftrain.rl.rollouts import Sampling
from hftrain.router_loss import router_loss
from hftrain.run_parts import DataRun, ModelRun, TrainRun

# tokens whose teacher logits exist at once (TRL's TOKEN_CHUNK_SIZE); loss_chunk_tokens > 0 sets another
TEACHER_CHUNK_TOKENS = 4096


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float):
    """(divergence, its gradient w.r.t. the student logits, student entropy) per token of [n, V] logits, fp32.

    The gradient is TRL's closed form (trl/kernels/chunked_divergence.py, `_backward_tile`), divided by the
    temperature: forward KL p_s - p_t; reverse KL p_s (log p_s - log p_t - KL); generalized JSD
    (1 - beta) p_s (log p_s - log m - KL(p_s || m))."""
    log_ps = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    ps = log_ps.exp()
    if beta == 0.0:
        pt = log_pt.exp()
        divergence = (pt * (log_pt - log_ps)).sum(-1)
        grad = ps - pt
    elif beta == 1.0:
        divergence = (ps * (log_ps - log_pt)).sum(-1)
        grad = ps * (log_ps - log_pt - divergence[:, None])
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
        kl_student = (ps * (log_ps - log_m)).sum(-1)
        divergence = beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * kl_student
        grad = (1 - beta) * ps * (log_ps - log_m - kl_student[:, None])
    entropy = -(ps * log_ps).sum(-1)
    return divergence, grad / temperature, entropy


def chunked_divergence(student_logits: torch.Tensor, teacher_logits: Callable[[int, int], torch.Tensor],
                       beta: float, temperature: float, chunk_tokens: int):
    """`token_divergence` over [N, V] student logits, the teacher's made `chunk_tokens` tokens at a time by
    `teacher_logits(start, end)`: (divergence [N], gradient [N, V], entropy [N])."""
    n = len(student_logits)
    divergence = student_logits.new_zeros(n, dtype=torch.float32)
    entropy = torch.zeros_like(divergence)
    grad = torch.zeros(student_logits.shape, dtype=torch.float32, device=student_logits.device)
    with torch.no_grad():
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            divergence[start:end], grad[start:end], entropy[start:end] = token_divergence(
                student_logits[start:end], teacher_logits(start, end), beta, temperature)
    return divergence, grad, entropy


class WithGradient(torch.autograd.Function):
    """`divergence` as a function of `logits` whose gradient was computed beside it: backward is grad_out x grad."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, divergence: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return divergence.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad_out[:, None] * grad).to(grad.dtype), None, None


class TeacherHidden(WrapsCausalLM):
    """The teacher as a module of its own (what a sharding strategy wraps, as dpo's reference): `forward` returns
    its last hidden states at the trained positions [N, H] (for an architecture whose logits are not its head's
    projection of them, the logits [N, V] instead)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm.eval().requires_grad_(False)
        self.head_only = lm.config.model_type in HEAD_ONLY_MODEL_TYPES

    def forward(self, input_ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "use_cache": False}
        if self.head_only:
            return self.lm.get_decoder()(**inputs).last_hidden_state[:, :-1][trained]
        return self.lm(**inputs).logits[:, :-1][trained]


def whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as one full tensor: an FSDP2 shard (DTensor) gathered, anything else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class FrozenTeacher:
    """The teacher model, frozen, kept off the student's module tree and prepared by the parallelism backend like a
    reference model (`prepare`: replicated for one process, DDP and ZeRO-1/2, partitioned under ZeRO-3, sharded
    under FSDP2)."""

    def __init__(self, lm: nn.Module, device: torch.device, name: str):
        self.inner = TeacherHidden(lm).to(device)
        self.module, self.how, self.name = self.inner, "replicated", name
        self.gathered: Callable[[list], contextlib.AbstractContextManager] = lambda params: contextlib.nullcontext()

    def prepare(self, backend) -> None:
        self.module, self.how = backend.prepare_frozen(self.inner)
        self.gathered = backend.gathered

    def describe(self) -> str:
        return f"{self.name}, frozen, {self.how} (+{local_bytes(self.module) / 2**20:,.1f} MiB per device)"

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, trained)

    @contextlib.contextmanager
    def head(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """(weight, bias) of the teacher's output head as whole tensors, for the time of the context (ZeRO-3
        gathers them, an FSDP2 shard is gathered); None for a teacher whose `hidden` returns logits."""
        if not self.inner.head_only:
            yield None
            return
        head = self.inner.lm.get_output_embeddings()
        params = [p for p in (head.weight, head.bias) if p is not None]
        with self.gathered(params):
            yield whole(head.weight), whole(head.bias)


class DistillLoss(ObjectiveLoss):
    """Wraps the student so that `forward` returns the sum of the generalized JSD to the teacher over the
    micro-batch's trained tokens (the loop divides by the step's trained tokens); the student's entropy is summed
    as a statistic (TRL's `entropy`, logged as its mean per token)."""

    def __init__(self, lm: nn.Module, recipe: Recipe, teacher: FrozenTeacher):
        super().__init__(lm)
        if (router := router_loss(lm, recipe.router_aux_loss_coef)) is not None:
            raise HftrainError(
                f"objective distill on a mixture-of-experts student: the router load-balancing loss is not added to "
                f"the divergence in hftrain yet; set router_aux_loss_coef: 0 (the model's config has {router.coef})"
            )
        self.teacher = teacher  # a plain object: its model stays out of this module's parameters
        self.beta, self.temperature = recipe.beta, recipe.temperature
        self.chunk = recipe.loss_chunk_tokens or TEACHER_CHUNK_TOKENS
        self.stats = None

    def student_logits(self, input_ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "use_cache": False}
        if self.head_only:
            hidden = self.lm.get_decoder()(**inputs).last_hidden_state[:, :-1][trained]
            return self.lm.get_output_embeddings()(hidden).float()
        return self.lm(**inputs).logits[:, :-1][trained].float()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                real_tokens: torch.Tensor | None = None, **model_inputs: torch.Tensor) -> torch.Tensor:
        trained = labels[:, 1:] != IGNORE_INDEX
        logits = self.student_logits(input_ids, trained)
        hidden = self.teacher.hidden(input_ids, trained)
        with self.teacher.head() as head:
            if head is None:
                teacher = lambda start, end: hidden[start:end]  # noqa: E731 - the teacher's own logits
            else:
                weight, bias = head
                teacher = lambda start, end: F.linear(  # noqa: E731
                    hidden[start:end].float(), weight.float(), None if bias is None else bias.float())
            divergence, grad, entropy = chunked_divergence(logits.detach(), teacher, self.beta, self.temperature,
                                                           self.chunk)
        with torch.no_grad():
            stats = entropy.sum().double().reshape(1)
            self.stats = stats if self.stats is None else self.stats + stats
        return WithGradient.apply(logits, divergence, grad).sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """The student entropy summed over the trained tokens since the last call (TRL's `entropy`)."""
        stats, self.stats = self.stats, None
        return {} if stats is None else {"entropy": stats[0]}

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": loss_sum / max(units, 1), "eval_tokens": int(units),
                **{f"eval_{name}": value / max(units, 1) for name, value in stats.items()}}


def teacher_recipe(recipe: Recipe) -> Recipe:
    """The recipe the teacher loads with: its folder and revision, the student's dtype and attention, never
    quantized or patched (it is not trained)."""
    return dataclasses.replace(recipe, model_name_or_path=recipe.teacher_model_name_or_path,
                               model_revision=recipe.teacher_model_revision, load_in_4bit=False, load_in_8bit=False,
                               use_liger_kernel=False)


def teacher_problems(recipe: Recipe, tokenizer) -> list[str]:
    """Whether the teacher shares the student's tokenizer and vocabulary, judged from its config and tokenizer files
    before either model loads (GKDTrainer compares the vocab sizes after loading both)."""
    name = recipe.teacher_model_name_or_path
    folder = Path(name).expanduser()
    if not folder.is_dir() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        return [f"teacher_model_name_or_path {name!r} is not a folder; give a local model folder or a hub id "
                "(org/name)"]
    kwargs = {"revision": recipe.teacher_model_revision, "trust_remote_code": recipe.trust_remote_code}
    if (unreachable := hub.unreachable_problem("teacher model", name, recipe.teacher_model_revision)):
        return [unreachable]
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
        teacher_config = AutoConfig.from_pretrained(name, **kwargs)
        student_config = AutoConfig.from_pretrained(recipe.model_name_or_path, revision=recipe.model_revision,
                                                    trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError) as exc:
        return [f"teacher_model_name_or_path {name!r} could not be read: {str(exc).splitlines()[0]}"]
    student_vocab = student_config.get_text_config().vocab_size
    teacher_vocab = teacher_config.get_text_config().vocab_size
    problems = []
    if student_vocab != teacher_vocab:
        problems.append(f"the teacher {name!r} has vocab_size {teacher_vocab} but the student "
                        f"{recipe.model_name_or_path!r} has {student_vocab}")
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        theirs, ours = teacher_tokenizer.get_vocab(), tokenizer.get_vocab()
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        problems.append(f"the teacher's tokenizer maps tokens to other ids than the student's ({len(theirs)} vs "
                        f"{len(ours)} entries; e.g. {', '.join(f'{t!r}: {i}' for t, i in differ)})")
    if problems:
        return [f"objective distill compares the teacher's and the student's next-token distributions id by id, so "
                f"they must share one tokenizer and vocabulary: {'; '.join(problems)}. Use a teacher of the "
                "student's family (TRL's GOLD trainer distills across tokenizers; hftrain does not)"]
    return []


def draw(seed: int, *key) -> int:
    """A 63-bit number from (seed, *key): the same on every process and after a resume."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, (seed, *key))).encode()).digest()[:8], "little") % 2**63


def on_policy_step(seed: int, lmbda: float, step: int) -> bool:
    """Whether optimizer step `step` trains on the student's own completions: a coin of probability `lmbda` drawn
    from (seed, step). GKDTrainer draws random.random() <= lmbda per micro-batch and process from the global random
    state; one coin per step keeps every micro-batch and process of a step alike (so accumulation and processes
    change nothing) and a resumed run draws the same coins."""
    return lmbda >= 1.0 or (lmbda > 0.0 and draw(seed, "lmbda", step) / 2**63 < lmbda)


def sampling(recipe: Recipe) -> Sampling:
    """The student's sampling settings for its on-policy completions."""
    return Sampling(recipe.max_completion_length, recipe.temperature, recipe.top_p, recipe.top_k,
                    recipe.repetition_penalty)


class OnPolicyFeed:
    """The examples' feed (`data.batching.IndexedFeed`) with distill's on-policy steps: in a step whose coin says so
    (`on_policy_step`), each row's completion is replaced by the student's own sample of its prompt (the tokens
    before its first trained token), generated with the recipe's sampling settings, each row from its own generator
    seeded by (seed, step, prompt tokens), up to max_completion_length tokens and the first EOS (trained, as the
    dataset's completions). The rows of every on-policy step go to output_dir/rollouts.jsonl, in grpo's names (step,
    prompt_ids, completion_ids, prompt and completion text, truncated); log_completions' evaluation samples keep
    completions.jsonl. Nothing is buffered across steps, so a checkpoint holds no generation state and a resumed run
    samples the same completions."""

    def __init__(self, inner, recipe: Recipe, generator, tokenizer, pad_id: int, accelerator, dp, output_dir: Path):
        """`generator`: the prepared student's sampler (rl.generation.build_generator, with `sampling(recipe)`)."""
        self.inner, self.recipe, self.accum, self.pad_id = inner, recipe, recipe.gradient_accumulation_steps, pad_id
        self.generator, self.tokenizer, self.accelerator, self.dp = generator, tokenizer, accelerator, dp
        self.file = output_dir / ROLLOUTS_FILE
        self.seconds = 0.0
        self.counts = torch.zeros(4, dtype=torch.float64)  # on-policy rows, their tokens, truncated rows, steps

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, step: int, state) -> None:
        """A resumed run (or one overwriting an earlier run) keeps rollouts.jsonl's rows up to `step`."""
        if self.accelerator.is_main_process:
            keep_through(self.file, step)
        self.inner.start(step, state)

    def batches(self, progress) -> Iterator[dict]:
        first = progress.step + 1
        for index, batch in enumerate(self.inner.batches(progress)):
            step = first + index // self.accum
            yield self.sampled(batch, step) if on_policy_step(self.recipe.seed, self.recipe.lmbda, step) else batch

    def sampled(self, batch: dict, step: int) -> dict:
        """The micro-batch with the student's completions of its prompts (rows without a trained token stay)."""
        started = time.perf_counter()
        labels = batch["labels"]
        rows = [r for r in range(len(labels)) if (labels[r, 1:] != IGNORE_INDEX).any()]
        prompts = [batch["input_ids"][r, :int((labels[r] != IGNORE_INDEX).nonzero()[0])].tolist() for r in rows]
        seeds = [draw(self.recipe.seed, "sample", step, *p) for p in prompts]
        # every process generates once per on-policy micro-batch (sharded models gather weights inside generate)
        sampled = self.generator.sample(prompts or [[self.pad_id]], seeds or [0])[:len(prompts)]
        width = max([len(p) + len(s.completion_ids) for p, s in zip(prompts, sampled)] + [labels.shape[1]])
        input_ids = torch.full((len(labels), width), self.pad_id, dtype=torch.long)
        new_labels = torch.full_like(input_ids, IGNORE_INDEX)
        input_ids[:, :labels.shape[1]] = batch["input_ids"]
        for r, prompt, s in zip(rows, prompts, sampled):
            ids = prompt + s.completion_ids
            input_ids[r] = self.pad_id
            input_ids[r, :len(ids)] = torch.tensor(ids)
            new_labels[r, len(prompt):len(ids)] = torch.tensor(s.completion_ids)
        self.counts += torch.tensor([len(rows), sum(len(s.completion_ids) for s in sampled),
                                     sum(s.truncated for s in sampled), 0.0], dtype=torch.float64)
        self.write_rows([{"step": step, "prompt_ids": p, "completion_ids": s.completion_ids,
                          "prompt": self.tokenizer.decode(p),
                          "completion": self.tokenizer.decode(s.completion_ids, skip_special_tokens=True),
                          "truncated": s.truncated} for p, s in zip(prompts, sampled)])
        self.seconds += time.perf_counter() - started
        return {**batch, "input_ids": input_ids, "labels": new_labels}

    def write_rows(self, rows: list[dict]) -> None:
        rows = gather_object(rows) if self.accelerator.num_processes > 1 else rows
        if self.accelerator.is_main_process:
            with self.file.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

    def pop_generation_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds + self.inner.pop_generation_seconds()

    def window_metrics(self, dp) -> dict:
        """TRL's completions/mean_length and completions/clipped_ratio over the window's on-policy completions
        (every process's), and the share of on-policy micro-batch rows (on_policy_fraction)."""
        rows, tokens, truncated, _ = dp.sum(self.counts.to(self.accelerator.device)).tolist()
        self.counts.zero_()
        metrics = dict(self.inner.window_metrics(dp))
        if rows:
            metrics.update({"completions/mean_length": tokens / rows, "completions/clipped_ratio": truncated / rows})
        return metrics


class Distill(Objective):
    """distill: `DistillLoss` around the student, the teacher prepared beside it."""

    name = "distill"

    def setup_data(self, run: DataRun) -> TrainingData:
        """The teacher checked against the student's tokenizer first (before any model loads), then the examples as
        for sft (their completions are the offline completions)."""
        problems = teacher_problems(run.recipe, run.tokenizer)
        if problems:
            raise HftrainError("; ".join(problems))
        return run.setup_examples()

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> DistillLoss:
        teacher = FrozenTeacher(load_base_model(teacher_recipe(recipe)), device,
                                f"teacher {recipe.teacher_model_name_or_path}")
        return DistillLoss(lm, recipe, teacher)

    def prepare(self, run: ModelRun) -> None:
        """The teacher placed like the student."""
        run.parts.loss.teacher.prepare(run.backend)
        return None

    def feed(self, run: ModelRun):
        """The data phase's feed; with lmbda > 0 inside an `OnPolicyFeed` with the prepared student's sampler
        (transformers' generate inside the backend's generation context, as grpo's)."""
        recipe = run.recipe
        if recipe.lmbda <= 0:
            return run.data.feed
        eos, pad = run.tokenizer.eos_token_id, pad_token_id(run.tokenizer)
        generator = build_generator(recipe, run.backend, run.model, run.parts.loss.lm, run.accelerator,
                                    sampling(recipe), {eos} if isinstance(eos, int) else set(eos or []), pad)
        return OnPolicyFeed(run.data.feed, recipe, generator, run.tokenizer, pad, run.accelerator, run.dp,
                            run.output_dir)

    def notes(self, run: TrainRun) -> list[str]:
        recipe = run.recipe
        divergence = {0.0: "forward KL(teacher || student)", 1.0: "reverse KL(student || teacher)"}.get(
            recipe.beta, f"generalized JSD, beta {recipe.beta:g}")
        return [f"objective distill: {divergence} at temperature {recipe.temperature:g}, per trained token, mean "
                f"over the step's tokens; {run.parts.loss.teacher.describe()}; completions: {completions(recipe)}"]


def completions(recipe: Recipe) -> str:
    """Which completions the steps train on, in words."""
    sampled = (f"sampled by the student (temperature {recipe.temperature:g}, top_p {recipe.top_p:g}, top_k "
               f"{recipe.top_k}, up to {recipe.max_completion_length} tokens; written to {ROLLOUTS_FILE})")
    if recipe.lmbda == 0:
        return "the dataset's (lmbda 0)"
    if recipe.lmbda >= 1:
        return f"the student's own, {sampled}"
    return f"the student's own in a share lmbda={recipe.lmbda:g} of the steps (drawn from the seed), {sampled}"
