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
  generate's raw logits / temperature: `rollouts.generate_rows_with_logps`) and its policy version; the loss corrects
  for the difference between them and the trained model's log-probs with TRL's importance-sampling correction
  (`hftrain.rl.loss.vllm_importance_sampling_ratio`, vllm_importance_sampling_*), as for vLLM's samples.

Every data-parallel rank runs its own worker for its own rows (the same rows and row seeds as the synchronous run).
A worker that fails or dies stops the run at the next window, naming it (`WorkerFailure`).
"""

from __future__ import annotations

import math
import os
import queue
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LogitsProcessor

from hftrain.rl.rollouts import Sampled, Sampling, WindowPlan, generate_rows_with_logps, row_seed
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
    first_window: int
    last_window: int  # exclusive
    weight_sync_steps: int
    max_staleness: int
    threads: int


@dataclass
class SampledWindow:
    """One window's rows of one rank as the worker sends them."""

    window: int
    version: int
    seeds: list[int]
    completions: list[tuple[list[int], bool, list[float]]]  # (tokens, truncated, behaviour log-probs)
    busy_seconds: float  # sampling and scoring this window
    idle_seconds: float  # waiting for its weights or for room in the queue before it


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
            with torch.no_grad():
                sampled = generate_rows_with_logps(model, prompt_ids, seeds, spec.sampling, spec.eos_ids,
                                                   spec.pad_id, extra=[Beat(progress)])
            busy = time.perf_counter() - started
            results.put(SampledWindow(window, version, seeds, sampled, busy, started - waited))
    except KeyboardInterrupt:
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which stops the run naming it
        results.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6)))
        raise SystemExit(1) from exc


class WorkerFailure(Exception):
    """The rollout worker failed or died; the message names it."""


class RolloutWorker:
    """The trainer's side of one rank's worker: starts the process, pushes weights, takes windows in order."""

    def __init__(self, spec: WorkerSpec, lm, bound: int, stall_seconds: float):
        self.spec, self.lm, self.bound, self.stall_seconds = spec, lm, bound, stall_seconds
        context = mp.get_context("spawn")
        self.progress = context.Value("d", time.monotonic(), lock=False)
        self.control, self.results = context.Queue(), context.Queue(maxsize=bound)
        self.control.cancel_join_thread()  # an exiting trainer does not wait for a dead worker to read its weights
        self.process = context.Process(target=worker_main, args=(spec, self.control, self.results, self.progress),
                                       name=f"hftrain-rollout-worker-{spec.rank}", daemon=True)
        self.pushed = -1  # the newest version pushed
        self.received = 0  # windows taken (a worker is judged hung only once it has sent one)
        self.pending: dict[int, SampledWindow] = {}  # windows taken for a checkpoint, or handed back by one
        self.wait_seconds = 0.0  # the trainer's time blocked on the queue, since the last metrics
        self.process.start()

    @property
    def name(self) -> str:
        return f"the rollout worker of process {self.spec.rank} (pid {self.process.pid})"

    def push(self, version: int) -> None:
        """Send the current weights as `version` (versions go out in order, each once)."""
        if version <= self.pushed:
            return
        self.control.put((version, PackedWeights.pack(pushed_weights(self.lm))))
        self.pushed = version

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
        return {"async_complete": True, "async_windows": [asdict(self.pending[w]) for w in due]}

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
        progress."""
        started, started_at = time.perf_counter(), time.monotonic()
        while True:
            try:
                item = self.results.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerFailure(f"{self.name} died (exit code {self.process.exitcode})") from None
                silent = time.monotonic() - max(self.progress.value, started_at)
                if self.stall_seconds and self.received and silent > self.stall_seconds:  # start-up takes any time
                    self.kill()
                    raise WorkerFailure(f"{self.name} made no progress for {silent:.0f} s while the trainer waited "
                                        f"for generation batch {window} (hung; hang_timeout {self.stall_seconds:g} "
                                        "s); it was killed") from None
        self.wait_seconds += time.perf_counter() - started
        self.received += 1
        if isinstance(item, tuple) and item and item[0] == "error":
            raise WorkerFailure(f"{self.name} failed: {item[1]} (its traceback: {item[2].strip()})")
        if item.window != window:
            raise WorkerFailure(f"{self.name} sent generation batch {item.window} where {window} was due")
        return item

    def kill(self) -> None:
        """SIGKILL (a stopped or hung worker ignores SIGTERM, and the exiting trainer would wait for it)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def worker_threads(local_processes: int) -> int:
    """The worker's torch threads: half this machine's cores shared by the local trainer processes, at least 1."""
    return max(1, (os.cpu_count() or 2) // 2 // max(1, local_processes))


def sampled_rows(item: SampledWindow) -> list[Sampled]:
    return [Sampled(ids, truncated, logps) for ids, truncated, logps in item.completions]
