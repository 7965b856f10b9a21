"""async_generation: grpo's rollout worker, a separate process that samples generation windows with transformers
while the trainer trains on earlier ones (the idea of TRL's experimental AsyncGRPOTrainer, with its field names).

The schedule is fixed, so a run is reproducible and `max_staleness: 0` with `weight_sync_steps: 1` is the
synchronous run:

- a policy version is one weight push: the trainer pushes the weights after step n when n is a multiple of
  weight_sync_steps (version n / weight_sync_steps; version 0 is the starting model), before it takes the next
  window;
- window w is trained at step w + 1 (one optimizer step per window), when the trainer's version is
  V(w) = w // weight_sync_steps; the worker samples it with version max(0, V(w) - max_staleness) exactly
  (`sampling_version`): it reads the pushed versions in order and waits for that one; a window that would be older
  than max_staleness versions at its training step is never generated (TRL generates and drops such samples; here
  none is dropped);
- the worker's queue holds at most `queue_windows` sampled windows (max_inflight_tasks), so it stays that far ahead
  at most;
- each completion comes back with its behaviour log-probs (the worker's model's log-probs of the sampled tokens from
  generate's raw logits / temperature: `rollouts.generate_rows_with_logps`; with tool calling one forward over each
  whole conversation) and its policy version; the loss corrects for
  the difference between them and the trained model's log-probs with TRL's importance-sampling correction
  (`hftrain.rl.loss.vllm_importance_sampling_ratio`, vllm_importance_sampling_*), as for vLLM's samples.

Every data-parallel rank runs its own worker for its own rows (the same rows and row seeds as the synchronous run).
A worker that fails or dies stops the run at the next window, naming it (`WorkerFailure`).

With tool calling (`tools`, `environment_factory`) the worker runs the multi-turn loop of `hftrain.rl.tools` on its
rows (it holds the whole model and needs no collective, so each turn is one generate call on its own rows), with the
tools and environments it loads itself from the recipe's entries; each completion comes back with its tool mask,
executed calls and messages, the prompts as the environments' reset left them, and the environments themselves
(pickled by the queue) for the reward functions, which run in the trainer.
"""

from __future__ import annotations

import base64
import math
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LogitsProcessor

from hftrain.rl.loss import token_log_probs
from hftrain.rl.rollouts import (
    Completion,
    Prompt,
    Sampled,
    Sampling,
    WindowPlan,
    collate,
    generate_rows,
    generate_rows_with_logps,
    render_prompt,
    row_seed,
)
from hftrain.rl.tools import Tooling, load_environment, load_tools
from hftrain.rl.vllm_generation import named_weights

POLL_SECONDS = 0.5  # how often a waiting trainer checks that its worker is alive
STALL_FLOOR_SECONDS = 300.0  # hang_timeout unset: a worker silent this long while the trainer waits is hung (TRL's
# heartbeat_stale_after_s default)


class Beat(LogitsProcessor):
    """Every generated token: the worker's progress time (a shared value the waiting trainer reads)."""

    def __init__(self, progress):
        self.progress = progress

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.progress.value = time.monotonic()
        return scores


def sampling_version(window: int, weight_sync_steps: int, max_staleness: int) -> int:
    """The policy version that samples `window` (module docstring)."""
    return max(0, window // weight_sync_steps - max_staleness)


def held_windows(step: int, last_window: int, weight_sync_steps: int, max_staleness: int) -> list[int]:
    """The windows a checkpoint after `step` must hold: those after it sampled by a policy version older than the
    oldest one the resumed run pushes (its weights are version step / weight_sync_steps only at a push; else its
    first push is the next version)."""
    available = step // weight_sync_steps + (step % weight_sync_steps != 0)
    due, window = [], step
    while window < last_window and sampling_version(window, weight_sync_steps, max_staleness) < available:
        due.append(window)
        window += 1
    return due


def queue_windows(max_inflight_tasks: int, max_staleness: int, window_size: int, global_batch: int) -> int:
    """The worker queue's bound in whole windows: max_inflight_tasks completions (-1: TRL's automatic
    max(max_staleness, 1) x the completions of one optimizer step), at least one window."""
    tasks = max(max_staleness, 1) * global_batch if max_inflight_tasks == -1 else max_inflight_tasks
    return max(1, tasks // window_size)


@dataclass(frozen=True)
class ToolSpec:
    """Tool calling in the worker: what it needs to run the multi-turn loop (hftrain.rl.tools) on its rows, with the
    recipe's names (`Tooling` reads them); the tools and the environment factory are loaded again in the worker from
    the recipe's entries (the trainer checked them before the model loaded)."""

    tools: tuple[str, ...]
    environment_factory: str | None
    tokenizer: Any
    prompts: list[Prompt]  # every prompt, dataset order: environments reset with its row, re-rendered after
    max_prompt_length: int | None
    max_completion_length: int
    max_tool_calling_iterations: int | None
    tool_call_timeout: float
    max_model_length: int | None

    def build(self) -> Tooling:
        tools, problems = load_tools(self.tools)
        factory, probe, more = load_environment(self.environment_factory)
        if problems or more:
            raise RuntimeError("; ".join(problems + more))
        return Tooling(self, tools, factory, probe, self.tokenizer, max_model_length=self.max_model_length)


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process needs to sample this rank's rows of every window (picklable)."""

    config: Any  # the causal LM's transformers config
    dtype: torch.dtype
    prompts: list[list[int]]  # every prompt's token ids, dataset order
    plan: WindowPlan
    rank: int
    seed: int
    sampling: Sampling
    eos_ids: frozenset[int]
    pad_id: int
    temperature: float
    mask_truncated: bool
    first_window: int
    last_window: int  # exclusive
    weight_sync_steps: int
    max_staleness: int
    threads: int
    tools: ToolSpec | None = None  # tool calling: the multi-turn loop runs in the worker

    def sample(self, model, prompt_ids: list[list[int]], seeds: list[int], extra) -> list[Sampled]:
        """One model turn of each prompt: transformers' generate with the settings above (`rollouts.generate_rows`)."""
        return [Sampled(ids, truncated) for ids, truncated in generate_rows(
            model, prompt_ids, seeds, self.sampling, self.eos_ids, self.pad_id, extra=extra)]

    def sample_with_logps(self, model, prompt_ids: list[list[int]], seeds: list[int], extra
                          ) -> list[tuple[list[int], bool, list[float]]]:
        """One turn of each prompt with its behaviour log-probs from generate's own logits
        (`rollouts.generate_rows_with_logps`: no second forward)."""
        return generate_rows_with_logps(model, prompt_ids, seeds, self.sampling, self.eos_ids, self.pad_id,
                                        extra=extra)


@dataclass
class SampledWindow:
    """One window's rows of one rank as the worker sends them."""

    window: int
    version: int
    seeds: list[int]
    completions: list[tuple[list[int], bool, list[float]]]  # (tokens, truncated, behaviour log-probs)
    busy_seconds: float  # sampling and scoring this window
    idle_seconds: float  # waiting for its weights or for room in the queue before it
    # tool calling: per completion (tool_mask, executed calls, messages); the prompts as sampled (an environment's
    # reset may have added to them); environment_factory: the rollouts' environments after them
    tools: list[tuple[list[int], list[dict], list[dict]]] | None = None
    prompts: list[Prompt] | None = None
    environments: list | None = None

    def record(self) -> dict:
        """For a checkpoint (JSON): the environments pickled, base64."""
        out = asdict(replace(self, environments=None))
        if self.environments is not None:
            out["environments"] = base64.b64encode(pickle.dumps(self.environments)).decode()
        return out

    @classmethod
    def restore(cls, item: dict) -> SampledWindow:
        item = dict(item)
        if item.get("prompts") is not None:
            item["prompts"] = [Prompt(**p) for p in item["prompts"]]
        if item.get("environments") is not None:
            item["environments"] = pickle.loads(base64.b64decode(item["environments"]))  # noqa: S301 - our checkpoint
        return cls(**item)


def behaviour_log_probs(model, prompt_ids: list[list[int]], rows: list[tuple[list[int], bool]], micro_batch: int,
                        pad_id: int, temperature: float, mask_truncated: bool,
                        tool_masks: list[list[int]] | None = None) -> list[list[float]]:
    """The sampling model's log-prob of each sampled token, computed per micro-batch in the layout the trainer
    collates (`rollouts.collate`), from logits / temperature as the trained log-probs (`rl.loss.token_log_probs`).
    With tool calling (`tool_masks`) each turn's context is the prefix of the whole completion, so one forward over
    it gives every turn's log-probs; the tool results' tokens (mask 0) were not sampled: NaN."""
    out = []
    for start in range(0, len(rows), micro_batch):
        chunk = rows[start:start + micro_batch]
        part = [Completion(i, 0, 0, ids, truncated) for i, (ids, truncated) in enumerate(chunk)]
        prompts = prompt_ids[start:start + micro_batch]
        batch = collate(prompts, part, torch.zeros(len(part)), pad_id, mask_truncated)
        logps = token_log_probs(model, batch["input_ids"], temperature)[0]
        for i, (p, c) in enumerate(zip(prompts, part)):
            out.append(logps[i, len(p) - 1:len(p) - 1 + len(c.completion_ids)].tolist())
    if tool_masks is not None:
        out = [[v if m else math.nan for v, m in zip(values, mask)] for values, mask in zip(out, tool_masks)]
    return out


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor) as the full tensor (an all-gather: every rank at once); any other tensor as it
    is (ZeRO-3's inside its GatheredParameters context, one process's, DDP's)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pushed_weights(lm) -> dict[str, torch.Tensor]:
    """The weights the worker samples with: the causal LM's state dict, or for a peft model (LoRA, DoRA) the base
    model's weights under its own names with each adapter merged into a copy of its base weight (peft's safe merge,
    `vllm_generation.named_weights`: what vLLM receives), so that the worker runs the plain causal LM."""
    if hasattr(lm, "peft_config"):
        return {name: tensor.detach() for name, tensor in named_weights(lm)}
    return {k: v.detach() for k, v in lm.state_dict().items()}


@dataclass
class PackedWeights:
    """One push: the weights copied into one flat CPU tensor per dtype, and where each lies in it. A queue hands a
    tensor to another process as a shared-memory block whose file descriptor the receiver fetches from a thread of
    the sender, which waits for the trainer's GIL; so one block per dtype instead of one per tensor (the worker's
    wait for a push of the tiny model's 21 tensors: about 0.18 s unpacked, 0.02 s packed, on the loaded 2-core
    machine; docs/benchmarks.md)."""

    flats: dict[torch.dtype, torch.Tensor]
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]  # name, dtype, shape, offset

    @classmethod
    def pack(cls, state: dict[str, torch.Tensor]) -> PackedWeights:
        sizes: dict[torch.dtype, int] = {}
        layout = []
        for name, tensor in state.items():
            offset = sizes.get(tensor.dtype, 0)
            layout.append((name, tensor.dtype, tuple(tensor.shape), offset))
            sizes[tensor.dtype] = offset + tensor.numel()
        # in shared memory already, so that the queue hands the blocks over without copying them again
        flats = {dtype: torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
        for (_, dtype, _, offset), tensor in zip(layout, state.values()):
            flats[dtype][offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        return cls(flats, layout)

    def unpack(self) -> dict[str, torch.Tensor]:
        return {name: self.flats[dtype][offset:offset + math.prod(shape)].view(shape)
                for name, dtype, shape, offset in self.layout}


def load_pushed(model, state: dict[str, torch.Tensor]) -> None:
    """Load a push into the worker's model. A merged LoRA push names each parameter once (a tied weight's other name
    is left out) and no buffers (the model built from the config has them); anything else missing is an error."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    current, buffers = model.state_dict(), {name for name, _ in model.named_buffers()}
    loaded = {current[name].data_ptr() for name in state}
    left = [name for name in missing if name not in buffers and current[name].data_ptr() not in loaded]
    if unexpected or left:
        raise RuntimeError(f"the pushed weights do not fit the worker's model: unexpected {unexpected[:5]}, missing "
                           f"{left[:5]}")


def worker_main(spec: WorkerSpec, control, results, progress) -> None:
    """The worker process: windows first_window.. in order, each with its policy version's weights (read from
    `control` in push order: (version, PackedWeights), or None to stop), into `results` (blocking when full);
    `progress`: the time of its last sign of progress (a generated token, a window's steps)."""
    try:
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(spec.config, dtype=spec.dtype).eval()
        tooling = spec.tools.build() if spec.tools is not None else None
        version, plan, G = -1, spec.plan, spec.plan.num_generations
        rows = plan.rank_rows(spec.rank)
        for window in range(spec.first_window, spec.last_window):
            waited = time.perf_counter()
            need = sampling_version(window, spec.weight_sync_steps, spec.max_staleness)
            while version < need:
                message = control.get()
                if message is None:
                    return
                version, packed = message
                load_pushed(model, packed.unpack())
                del packed
                progress.value = time.monotonic()
            started = time.perf_counter()
            progress.value = time.monotonic()
            index = plan.window_prompts(window)
            prompt_ids = [spec.prompts[index[row // G]] for row in rows]
            seeds = [row_seed(spec.seed, window, row // G, row % G) for row in rows]
            prompts = environments = tools = None
            with torch.no_grad():
                if tooling is None:
                    completions = spec.sample_with_logps(model, prompt_ids, seeds, [Beat(progress)])
                else:  # each turn's context is a prefix of the whole conversation: one forward gives every turn's
                    prompts, sampled, environments = tool_rollouts(spec, tooling, model, progress, window,
                                                                   [index[row // G] for row in rows], rows)
                    progress.value = time.monotonic()
                    behaviour = behaviour_log_probs(model, [p.ids for p in prompts],
                                                    [(s.completion_ids, s.truncated) for s in sampled],
                                                    plan.micro_batch, spec.pad_id, spec.temperature,
                                                    spec.mask_truncated, [s.tool_mask for s in sampled])
                    completions = [(s.completion_ids, s.truncated, logps) for s, logps in zip(sampled, behaviour)]
                    tools = [(s.tool_mask, s.tool_calls, s.messages) for s in sampled]
            busy = time.perf_counter() - started
            results.put(SampledWindow(window, version, seeds, completions, busy, started - waited, tools, prompts,
                                      environments))
    except KeyboardInterrupt:
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which stops the run naming it
        results.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6)))
        raise SystemExit(1) from exc


def tool_rollouts(spec: WorkerSpec, tooling: Tooling, model, progress, window: int, prompt_index: list[int],
                  rows) -> tuple[list[Prompt], list[Sampled], list | None]:
    """(the prompts as sampled, the multi-turn completions, the environments or None) of this rank's rows of
    `window`: the trainer's tool loop (`Tooling.rollouts`) with each turn sampled here, seeded per (row, turn) as the
    synchronous run seeds it."""
    G, tools = spec.plan.num_generations, spec.tools

    def render(value, columns):
        return render_prompt(value, columns, tools.tokenizer, tools.max_prompt_length, tooling.schema_tools)

    def seed(i: int, turn: int) -> int:
        return row_seed(spec.seed, window, rows[i] // G, rows[i] % G, turn)

    out = tooling.rollouts(lambda ids, seeds: spec.sample(model, ids, seeds, [Beat(progress)]),
                           [tools.prompts[i] for i in prompt_index], seed, render)
    return out.prompts, out.sampled, out.environments


class WorkerFailure(Exception):
    """The rollout worker failed or died; the message names it."""


class WindowQueue:
    """The trainer's side of one rank's rollout worker, whatever samples (this module's process, or
    `vllm_server.ServerRolloutWorker`'s thread): the sampled windows taken from `results` in order, each checked to be
    the one due, and those a checkpoint holds kept in `pending`. A subclass starts the sampler and gives `name`,
    `send` (a push's weights), `kill`, and `check`: raise `WorkerFailure` when the sampler is gone (or hung) while the
    trainer waits."""

    def __init__(self, spec: WorkerSpec, results):
        self.spec, self.results = spec, results
        self.pushed = -1  # the newest version pushed
        self.received = 0  # windows taken
        self.pending: dict[int, SampledWindow] = {}  # windows taken for a checkpoint, or handed back by one
        self.wait_seconds = 0.0  # the trainer's time blocked on the queue, since the last metrics

    @property
    def name(self) -> str:
        raise NotImplementedError

    def push(self, version: int) -> None:
        """Send the current weights as `version` (versions go out in order, each once)."""
        if version > self.pushed:
            self.send(version)
            self.pushed = version

    def send(self, version: int) -> None:
        raise NotImplementedError

    def check(self, window: int, started_at: float) -> None:
        """Called while the trainer has waited for `window` since `started_at` (time.monotonic) and nothing came."""
        raise NotImplementedError

    def failure(self, error: str, trace: str) -> str:
        """The WorkerFailure message of an error the sampler reported (its traceback: `trace`)."""
        return f"{self.name} failed: {error}"

    def held(self, step: int) -> dict:
        """A checkpoint after `step`: the sampled windows after it whose policy version the resumed run cannot push
        again (older than the checkpoint's weights, which are version step / weight_sync_steps only at a push),
        taken from the queue now (waiting for the worker) and kept here for their steps; `async_complete` false when
        the worker failed on the way (the checkpoint then cannot resume exactly)."""
        due = held_windows(step, self.spec.last_window, self.spec.weight_sync_steps, self.spec.max_staleness)
        try:
            for window in due:
                if window not in self.pending:
                    self.pending[window] = self.receive(window)
        except WorkerFailure:
            return {"async_complete": False, "async_windows": []}
        return {"async_complete": True, "async_windows": [self.pending[w].record() for w in due]}

    def hold(self, windows: list[SampledWindow]) -> None:
        """A resumed run: the windows its checkpoint held, handed out before the worker's."""
        self.pending.update({item.window: item for item in windows})

    def take(self, window: int) -> SampledWindow:
        """Window `window`'s rows: held ones first, else the next in the queue."""
        if window in self.pending:
            return self.pending.pop(window)
        return self.receive(window)

    def receive(self, window: int) -> SampledWindow:
        """The next window in the queue, which must be `window`, waiting while the worker lives and makes
        progress (`check`)."""
        started, started_at = time.perf_counter(), time.monotonic()
        while True:
            try:
                item = self.results.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                self.check(window, started_at)
        self.wait_seconds += time.perf_counter() - started
        self.received += 1
        if isinstance(item, tuple) and item and item[0] == "error":
            raise WorkerFailure(self.failure(item[1], item[2]))
        if item.window != window:
            raise WorkerFailure(f"{self.name} sent generation batch {item.window} where {window} was due")
        return item


class RolloutWorker(WindowQueue):
    """The trainer's side of one rank's worker process: starts it, pushes weights, takes windows in order."""

    def __init__(self, spec: WorkerSpec, lm, bound: int, stall_seconds: float,
                 gathered: Callable[[list], AbstractContextManager] = lambda params: nullcontext()):
        context = mp.get_context("spawn")
        super().__init__(spec, context.Queue(maxsize=bound))
        self.lm, self.bound, self.stall_seconds = lm, bound, stall_seconds
        self.gathered = gathered  # the strategy's context holding the parameters whole (Backend.gathered: ZeRO-3)
        self.progress = context.Value("d", time.monotonic(), lock=False)
        self.control = context.Queue()
        self.control.cancel_join_thread()  # an exiting trainer does not wait for a dead worker to read its weights
        self.process = context.Process(target=worker_main, args=(spec, self.control, self.results, self.progress),
                                       name=f"hftrain-rollout-worker-{spec.rank}", daemon=True)
        self.process.start()

    @property
    def name(self) -> str:
        return f"the rollout worker of process {self.spec.rank} (pid {self.process.pid})"

    def send(self, version: int) -> None:
        """The weights packed into shared memory and queued for the process."""
        # ZeRO-3: the partitions gathered on every rank for the copy; FSDP2: each shard's full tensor gathered
        with self.gathered(list(self.lm.parameters())):
            packed = PackedWeights.pack({name: whole(tensor) for name, tensor in pushed_weights(self.lm).items()})
        self.control.put((version, packed))

    def check(self, window: int, started_at: float) -> None:
        """The process died, or has been silent past stall_seconds (judged only once it has sent a window: start-up
        takes any time): it is killed."""
        if not self.process.is_alive():
            raise WorkerFailure(f"{self.name} died (exit code {self.process.exitcode})") from None
        silent = time.monotonic() - max(self.progress.value, started_at)
        if self.stall_seconds and self.received and silent > self.stall_seconds:
            self.kill()
            raise WorkerFailure(f"{self.name} made no progress for {silent:.0f} s while the trainer waited "
                                f"for generation batch {window} (hung; hang_timeout {self.stall_seconds:g} "
                                "s); it was killed") from None

    def failure(self, error: str, trace: str) -> str:
        return f"{super().failure(error, trace)} (its traceback: {trace.strip()})"

    def kill(self) -> None:
        """SIGKILL (a stopped or hung worker ignores SIGTERM, and the exiting trainer would wait for it)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def worker_threads(local_processes: int) -> int:
    """The worker's torch threads: half this machine's cores shared by the local trainer processes, at least 1."""
    return max(1, (os.cpu_count() or 2) // 2 // max(1, local_processes))


def sampled_rows(item: SampledWindow) -> list[Sampled]:
    tools = item.tools or [(None, None, None)] * len(item.completions)
    return [Sampled(ids, truncated, logps, mask, calls, messages)
            for (ids, truncated, logps), (mask, calls, messages) in zip(item.completions, tools)]


@dataclass(frozen=True)
class WorkerStarter:
    """How a trainer process starts its rollout worker once the weights are loaded, given the first window it
    samples (`spec` holds the rest)."""

    spec: WorkerSpec
    lm: Any  # the causal LM (or peft model) whose weights are pushed
    bound: int  # the queue's bound in windows
    stall_seconds: float
    gathered: Callable[[list], AbstractContextManager] = lambda params: nullcontext()  # Backend.gathered

    def __call__(self, first_window: int) -> RolloutWorker:
        return RolloutWorker(replace(self.spec, first_window=first_window), self.lm, self.bound, self.stall_seconds,
                             self.gathered)
