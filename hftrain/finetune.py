"""Fine-tune a causal LM: setup -> data -> model -> optimizer -> train -> finish.

    accelerate launch --config_file accelerate_configs/cpu.yaml hftrain/finetune.py \
        --config recipes/tiny-chat.yaml [--learning_rate 1e-3 --max_steps 50 ...]
    python -m hftrain.finetune --help

The launch preset picks the parallelism backend (hftrain/parallel/); the recipe holds everything else. `Finetune`
runs the phases in order; the data and model phases return their results as values (`TrainingData`,
`ModelParts`), the later phases keep the run's state (optimizer, progress, logger) on the run.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import the package, not sibling modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch
from accelerate.utils import set_seed

from hftrain import attention, card, checkpoint, fp8, qat
from hftrain.compat.transformers import whole_loads
from hftrain.config import PRESET_DIR, Recipe, load_recipe, read_yaml, unused_settings
from hftrain.data import IGNORE_INDEX, Collator, eval_micro_batches, load_datasets, make_loader
from hftrain.data.feeds import TrainingData, setup_examples
from hftrain.data.image_data import load_image_chats
from hftrain.errors import HftrainError, first_line, run_tool, same_in_every_process
from hftrain.eval_tasks import TaskEvaluation
from hftrain.hub import HubPush, repo_url
from hftrain.merge import merge
from hftrain.metrics import FlopCounter, RunMeter, StepProfiler, current_memory_mb
from hftrain.model import build_model, build_tokenizer, fit_embeddings_to_tokenizer, model_summary
from hftrain.objectives import objective_for
from hftrain.optim import (
    build_optimizer,
    build_scheduler,
    optimizer_notes,
    scaled_learning_rate,
    set_peak_learning_rate,
)
from hftrain.parallel import Launch, devices_record, make_accelerator, phase, resolve, run_process
from hftrain.paths import CONFIG_FILE, FINAL_DIR, HUB_UPLOAD_DIR, PROFILE_DIR
from hftrain.preemption import EXIT_PREEMPTED, Preempted, StopRequest, signal_names
from hftrain.preflight import attention_choice, preflight
from hftrain.run_parts import DataRun, ModelParts, ModelRun, TrainRun
from hftrain.samples import CompletionSamples
from hftrain.steps import StepResult, Window, add_stats, summed_stats
from hftrain.ties import check_ties
from hftrain.tracking import MetricLogger, ProgressDisplay, quiet_console
from hftrain.vision import build_processor, is_image_text
from hftrain.watchdog import Watchdog


def to_device(batch: dict[str, torch.Tensor | int], device: torch.device) -> dict[str, torch.Tensor | int]:
    """The batch's tensors on `device`; plain numbers (the longest document, `max_length_q`) stay host values."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def trained_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of predicted tokens in a micro-batch (labels are shifted by the loss)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate(backend, model, loss_fn, dataset, collator: Collator, recipe: Recipe) -> dict[str, float]:
    """The objective's loss over the whole eval set (token-weighted for sft, per pair for dpo/simpo), every
    data-parallel rank evaluating a disjoint shard; `loss_fn` is the loss module inside `model`'s wrapper.

    Ranks reduce (loss sum, units, statistics) sums, which is exact whatever the shard sizes; every rank
    runs the same number of forwards so sharded models (FSDP, ZeRO-3, tensor parallel) stay in step.
    """
    accelerator, dp = backend.accelerator, backend.dp
    model.eval()
    shards = eval_micro_batches(len(dataset), recipe.per_device_eval_batch_size, dp.world, dp.rank)
    totals, stats = torch.zeros(2, dtype=torch.float64, device=accelerator.device), {}
    for batch in make_loader(shards, collator, recipe.dataloader_num_workers,
                             pin_memory=recipe.dataloader_pin_memory):
        batch.pop("num_examples")
        batch = to_device(batch, accelerator.device)
        with backend.micro_batch(batch) as inputs:
            loss_sum = model(**inputs)
        totals += torch.stack([loss_sum.double(), loss_fn.loss_units(batch).double()])
        stats = add_stats(stats, loss_fn.pop_stats())
    loss_sum, units = dp.sum(totals).tolist()
    model.train()
    return loss_fn.eval_metrics(loss_sum, int(units), summed_stats(dp, stats))


def preset_processes(name: str | None) -> int | None:
    """The process count of a shipped launch preset (None without one)."""
    path = PRESET_DIR / f"{name}.yaml"
    return int(read_yaml(str(path)).get("num_processes") or 1) if name and path.is_file() else None


def optimizer_step(backend, model, optimizer, scheduler, micro_batches, scale, max_norm, timer):
    """Forward/backward every micro-batch of one optimizer step, clip, then step -- unless the gradient norm
    is NaN/inf, in which case nothing is updated. Returns (summed local token loss, grad norm, updated?).

    The norm is taken after gradients are reduced across ranks, so every rank takes the same decision.
    """
    accelerator = backend.accelerator
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in micro_batches:
        with accelerator.accumulate(model), backend.micro_batch(batch) as inputs:
            step_loss += backend.forward_backward(model, inputs, scale, timer)  # backward of loss_sum * scale
            if accelerator.sync_gradients:
                grad_norm = backend.clip_grad_norm(model, max_norm)
                finite = grad_norm is None or math.isfinite(grad_norm)
                if finite:
                    optimizer.step()
                scheduler.step()  # a skipped step still counts: the schedule follows optimizer steps
                optimizer.zero_grad(set_to_none=True)
                timer.lap("optimizer")
    return step_loss, grad_norm, finite


def next_steps(output_dir: Path, writes_text: bool, processor=None, use: str = "score conversations") -> str:
    """The closing line's commands: talking to the final model (`hftrain chat`, for a model that writes text from text,
    not for an image-text model's, whose `processor` reads images; a model that does not write text is used as its
    README.md shows: `use`, e.g. a reward model scores conversations, an embedding model encodes texts) and the run's
    report."""
    final, out = shlex.quote(str(output_dir / FINAL_DIR)), shlex.quote(str(output_dir))
    report = f"hftrain report {out} for plots and a summary of the run"
    if not writes_text:
        return f"{use} with {final} as its README.md shows; {report}"
    return report if processor is not None else f"hftrain chat {final} to talk to the model; {report}"


class Finetune:
    """One fine-tuning run, phase by phase: `setup`, `setup_data`, `setup_model`, `setup_optimizer`, `train`,
    `finish` (`run` calls them in order).

    Seams for test launchers, which subclass this class instead of patching module globals: `make_accelerator`
    (e.g. to force FSDP2 on a CPU machine), `load_datasets` and `build_model`.
    """

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.last_headline: dict[str, str] = {}  # the headline metrics' last logged values (`headline`)
        self.first_step_seconds: float | None = None  # this process's first step (torch_compile: `report_compile`)
        self.objective = objective_for(recipe)  # the loss, its reference and notes: hftrain.objectives

    def run(self) -> Path:
        self.setup()
        self.setup_data()
        self.setup_optimizer(self.setup_model())
        self.describe_run()
        self.check_checkpoints()
        self.train()
        return self.finish()

    # ------------------------------------------------------------------------------------------- seams
    def make_accelerator(self, launch: Launch):
        return make_accelerator(self.recipe, launch)

    def load_datasets(self, tokenizer):
        if self.processor is not None:  # an image-text model: image chats, encoded by its processor
            return load_image_chats(self.recipe, self.processor)
        return load_datasets(self.recipe, tokenizer)

    def build_model(self) -> torch.nn.Module:
        layers = self.model_config.get_text_config().num_hidden_layers if self.model_config is not None else None
        load_kwargs = self.backend.model_load_kwargs()
        if self.attention is not None:  # the recipe's, or varlen chosen for packed rows (preflight.attention_choice)
            load_kwargs = {**load_kwargs, "attn_implementation": self.attention}
        return build_model(self.recipe, load_kwargs, self.backend.layers_to_load(layers) if layers else None,
                           fp8.float8_all_gather(self.recipe, self.backend.record.kind))

    # ------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Every machine/launch/model problem at once, then the accelerator, its parallelism backend, the seed and
        the checkpoint to resume from."""
        recipe = self.recipe
        checkpoint.never_world_writable()
        launch = Launch.from_environ()
        with same_in_every_process():  # from the recipe, the preset and the machine: one process of each reports
            self.model_config = preflight(recipe, launch, torch.cuda.is_available())
        # the attention the model loads with: the recipe's, else varlen for packed rows where it can run
        self.attention, self.attention_note = attention_choice(recipe, launch, torch.cuda.is_available(),
                                                               self.model_config)
        self.accelerator = self.make_accelerator(launch)
        quiet_console(self.accelerator)
        with same_in_every_process():
            self.backend = resolve(self.accelerator, recipe, launch)
        self.devices = devices_record(self.accelerator)  # refuses two processes on one GPU
        self.dp = self.backend.dp  # the ranks of one tensor-parallel group share their data
        set_seed(recipe.seed)
        self.output_dir = Path(recipe.output_dir)
        self.resume_from = checkpoint.resolve_resume(recipe)
        self.watchdog = Watchdog.for_run(self.accelerator, recipe, checkpoint.newest_intact)  # hangs: watchdog.py
        # eval_tasks: lm-eval's tasks checked and loaded now, before the data and the model
        self.task_evaluation = TaskEvaluation(recipe, self.backend) if recipe.eval_tasks else None

    def setup_data(self) -> None:
        """Tokenizer, then the objective's data (`objective.setup_data`: for sft/dpo `setup_examples`, streamed or
        not), handed back as one `TrainingData` (`self.data`; its feed: the loop's micro-batches). Before the model: a
        bad dataset should fail in seconds, not after loading weights."""
        recipe = self.recipe
        self.processor = build_processor(recipe) if is_image_text(self.model_config) else None
        self.tokenizer = build_tokenizer(recipe) if self.processor is None else self.processor.tokenizer
        # what the objective's hooks may use (objectives.base), handed on with what the later phases add
        self.data_run = DataRun(recipe=recipe, tokenizer=self.tokenizer, processor=self.processor,
                                accelerator=self.accelerator, dp=self.dp, backend=self.backend,
                                resume_from=self.resume_from, output_dir=self.output_dir, watchdog=self.watchdog,
                                setup_examples=self.setup_examples)
        self.data = self.objective.setup_data(self.data_run)
        # what each evaluation runs on the live model after the objective's own evaluation, each called with the
        # TrainRun: eval_tasks' benchmarks, log_completions' samples, the objective's own (retrieval metrics)
        samples = recipe.log_completions and self.objective.completes_eval_prompts and self.data.eval_set is not None
        self.eval_addons = [addon for addon in (
            self.task_evaluation, CompletionSamples(self.data_run, self.data.eval_set) if samples else None,
            *self.objective.eval_addons(self.data_run)) if addon is not None]

    def setup_examples(self) -> TrainingData:
        """Examples from datasets, map-style or streamed (sft, dpo, simpo, orpo, kto): hftrain.data.feeds reads
        them through this run's `load_datasets` seam."""
        return setup_examples(self)

    def setup_model(self) -> ModelParts:
        """The builder's model (full, LoRA, QLoRA: decided in hftrain.model), wrapped in the objective's loss module
        (summed losses), handed to the optimizer phase as one `ModelParts`."""
        baseline = current_memory_mb(self.accelerator.device)  # what the estimate sits on top of
        lm = self.build_model()
        fit_embeddings_to_tokenizer(lm, self.tokenizer)
        loss = self.objective.build_loss(self.recipe, lm, self.accelerator.device,
                                         lambda built: self.backend.frozen_copy(built, self.rebuild_model))
        if self.data.collator is not None:  # an objective that collates examples (grpo's batches are its rollouts)
            self.data.collator.mark_real_tokens = loss.needs_real_tokens  # e.g. the router loss skips padding
            self.data.collator.mark_documents = loss.needs_documents  # varlen attention: the packer's boundaries
        return ModelParts(loss, [*getattr(lm, "hftrain_notes", []), *loss.notes()], FlopCounter(lm),
                          model_summary(loss), baseline)  # the summary before prepare: sharding hides the counts

    def rebuild_model(self) -> torch.nn.Module:
        """The model as setup_model built it, once more (a backend that cannot copy the built one asks for it)."""
        lm = self.build_model()
        fit_embeddings_to_tokenizer(lm, self.tokenizer)
        return lm

    def setup_optimizer(self, parts: ModelParts) -> None:
        """Optimizer and schedule for the model phase's `parts`, prepared by the backend (DDP / FSDP2 / DeepSpeed
        engine), the resumed state, the run's first files, the logger and the throughput meter."""
        recipe, self.parts = self.recipe, parts
        self.learning_rate, self.lr_scaling = scaled_learning_rate(recipe, self.data.plan.global_batch)
        if self.lr_scaling is not None:
            self.parts.notes.append(f"learning rate {self.learning_rate:.6g} = {recipe.learning_rate:g} x "
                              f"{self.lr_scaling['factor']:.6g} (scale_lr {recipe.scale_lr}: effective batch "
                              f"{self.data.plan.global_batch} for base_batch_size {recipe.base_batch_size})")
        self.optimizer = build_optimizer(recipe, parts.loss, self.learning_rate)
        self.parts.notes.extend(optimizer_notes(self.optimizer))
        self.model, self.optimizer = self.backend.prepare(parts.loss, self.optimizer)
        check_ties(self.backend.unwrap(self.model), f"preparing the model for {self.backend.record.name}")
        self.scheduler = build_scheduler(recipe, self.optimizer, self.data.total_steps)  # on the optimizer that steps
        prepared = self.data_run.handed_on(ModelRun, data=self.data, parts=parts, model=self.model)
        self.objective_tensors = self.objective.prepare(prepared)  # e.g. dpo's reference: placed, precomputed
        self.feed = self.objective.feed(prepared)  # grpo's rollouts, built once the model they sample from is prepared
        self.progress, resumed = checkpoint.Progress(world_size=self.dp.world), {}
        if self.resume_from is not None:
            self.progress, resumed = checkpoint.load_checkpoint(self.backend, self.model, self.scheduler,
                                                                self.resume_from, self.data.plan)
            if self.lr_scaling is not None:  # the peak follows this run's effective batch, not the saved run's
                set_peak_learning_rate(self.scheduler, self.learning_rate)
        self.feed.start(self.progress.step, self.data.stream_state)  # a stream continues from the checkpoint's position
        self.saves = checkpoint.BackgroundSaves(self.backend, self.model, self.optimizer, recipe.async_checkpointing)
        if recipe.async_checkpointing and not self.saves.enabled:
            self.parts.notes.append(f"checkpoints are saved synchronously: {self.backend.checkpoints.synchronous()}")
        self.run_info = self.make_run_info()
        self.start_output_dir()
        self.logger = MetricLogger(self.accelerator, recipe, self.progress.step, self.run_info, resumed)
        self.run_info.update(self.logger.run_ids())  # e.g. the W&B run id, so that a resumed run continues it
        self.hub = HubPush(recipe, self.accelerator.is_main_process, self.logger.print, self.logger.warn)
        self.train_run = prepared.handed_on(
            TrainRun, feed=self.feed, progress=self.progress,
            evaluate_loss=partial(evaluate, self.backend, self.model, parts.loss, self.data.eval_set,
                                  self.data.eval_collator, recipe), say=self.logger.print)
        if recipe.push_to_hub:
            self.parts.notes.append(f"pushing to {repo_url(self.hub.repo_id)} (hub_strategy {recipe.hub_strategy}"
                              f"{', branch ' + recipe.hub_revision if recipe.hub_revision else ''})")
        self.meter = RunMeter(self.accelerator, self.parts.flops, straggler_threshold=recipe.straggler_threshold,
                              peak_tflops_override=recipe.device_peak_tflops,
                              cost_per_gpu_hour=recipe.cost_per_gpu_hour,
                              effective_batch_size=self.data.plan.global_batch,
                              device_hours_before=resumed.get("device_hours", 0.0), warn=self.logger.warn,
                              machines=self.backend.record.machines,
                              sequence_shards=self.backend.record.sequence_shards,
                              model_shards=self.backend.record.model_shards,
                              peers=self.backend.equal_work_groups(), on_lap=self.watchdog.lap)

    def make_run_info(self) -> dict:
        """What this run is, recorded in every checkpoint and the final folder (hftrain_state.json)."""
        recipe = self.recipe
        self.parameters = self.backend.parameter_counts(self.model)
        return {"launch": self.backend.launch_info(self.model, self.optimizer),
                "parallelism": asdict(self.backend.record), "devices": self.devices, "model": self.parts.summary,
                "data": self.data.data_stats,
                "effective_batch_size": self.data.plan.global_batch, "lr_scaling": self.lr_scaling,
                "async_checkpointing": self.saves.enabled,
                "total_steps": self.data.total_steps,
                "memory_estimate": self.backend.memory(self.parameters),
                "launch_preset": {"recipe": recipe.launch_preset, "reason": recipe.launch_preset_reason},
                "memory_baseline_mb": round(self.parts.memory_baseline_mb, 1)}

    def start_output_dir(self) -> None:
        """The first writes: nothing goes into output_dir before the recipe, data and model are all accepted."""
        if self.accelerator.is_main_process:
            if self.recipe.overwrite_output_dir and self.resume_from is None:
                checkpoint.clear_run(self.output_dir)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.recipe.dump(self.output_dir / CONFIG_FILE)
        self.accelerator.wait_for_everyone()

    def describe_run(self) -> None:
        """The start-up lines: layout, batch, method, data; model-state memory per device and the preset's reason."""
        recipe, memory = self.recipe, self.run_info["memory_estimate"]
        trained, total = self.parameters.trained, self.parameters.total
        resuming = f"; resuming from {self.resume_from} at step {self.progress.step}" if self.resume_from else ""
        quantized = self.parts.summary["quantized_linear_layers"]
        bits = "a 4-bit" if "Linear4bit" in quantized else "an 8-bit" if "Linear8bitLt" in quantized else None
        method = f"{self.parts.summary['method']} fine-tuning" + (f" of {bits} quantized base" if bits else "")
        self.logger.print(
            f"hftrain: {self.backend.record.describe()} on {self.accelerator.device}, model wrapped as "
            f"{self.run_info['launch']['model_wrapper']}; {self.batch_words()}; {self.data.total_steps} optimizer "
            f"steps {self.data.data_line[0]}; {method}, {trained:,} of {total:,} parameters trained; "
            f"{self.data.data_line[1]}{resuming}"
        )
        self.logger.print(f"hftrain: {self.speed_words()}")
        for note in self.parts.notes + unused_settings(recipe) + self.objective.notes(self.train_run):
            self.logger.print(f"hftrain: {note}")
        preset = (f"; the recipe is sized for preset {recipe.launch_preset}: "
                  f"{recipe.launch_preset_reason or 'no reason given'}" if recipe.launch_preset else "")
        self.logger.print(
            f"hftrain: parallelism {self.backend.record.describe()}: model state ~{memory['per_device_gib']} GiB per "
            f"device (+{memory['offloaded_gib']} GiB offloaded to CPU; {memory['activations']}) of "
            f"{memory['device_memory_gib']} GiB{preset}"
        )

    def speed_words(self) -> str:
        """The start-up line of the speed levers in use: the attention the loaded model runs (and, where packed rows
        kept sdpa, why not varlen), torch.compile, the loss's path to the logits."""
        summary, recipe = self.parts.summary, self.recipe
        kernel = attention.describe(summary["attention"], recipe.packing, self.attention_note,
                                    self.accelerator.device.type == "cuda")
        compiled = (f"on ({summary['compiled_blocks']} blocks, mode {recipe.torch_compile_mode or 'default'}, "
                    "dynamic shapes; the first step's time is reported)" if recipe.torch_compile else "off")
        return f"attention {kernel}; compile {compiled}; loss {self.parts.loss.loss_path}"

    def batch_words(self) -> str:
        """The effective batch and its factors; when the recipe names a preset of another data-parallel size, what
        this launch multiplied (a recipe written for one process, launched on 4, trains on 4x its batch)."""
        recipe, world = self.recipe, self.dp.world
        if world == self.accelerator.num_processes:
            copies = "process" if world == 1 else "processes"
        else:  # groups of ranks (tensor, pipeline, sequence parallel) share a batch: one data-parallel group each
            copies = "data-parallel group" if world == 1 else "data-parallel groups"
        words = (f"effective batch {self.data.plan.global_batch} = {recipe.per_device_train_batch_size} per device x "
                 f"{recipe.gradient_accumulation_steps} accumulation x {world} {copies}")
        sized_for = preset_processes(recipe.launch_preset)
        if sized_for is not None and sized_for != world and self.accelerator.num_processes == world:
            words += (f" (the recipe's launch_preset {recipe.launch_preset} runs {sized_for} "
                      f"process{'es' if sized_for != 1 else ''}: effective batch "
                      f"{self.data.plan.global_batch // world * sized_for} there)")
        return words

    def check_checkpoints(self) -> None:
        """checkpoint_preflight: one save and load of the initial state before step 1 (checkpoint.round_trip), when the
        run saves periodic checkpoints."""
        recipe = self.recipe
        periodic = recipe.save_strategy == "epoch" or (recipe.save_strategy == "steps" and bool(recipe.save_steps))
        if not (recipe.checkpoint_preflight and periodic):
            return
        with phase(self.accelerator, "the checkpoint preflight", recipe.ddp_timeout):
            took = checkpoint.round_trip(self.backend, self.model, self.optimizer, self.scheduler, self.output_dir,
                                         recipe, self.progress, self.current_run_info(), self.data.plan,
                                         self.objective_tensors, self.saves)
        self.logger.print(f"hftrain: checkpoint preflight: a {took['megabytes']:,.1f} MiB checkpoint saved in "
                          f"{took['save_seconds']:.1f} s and loaded back in {took['load_seconds']:.1f} s, weights and "
                          "optimizer state unchanged (checkpoint_preflight: false skips this)")

    # ------------------------------------------------------------------------------------------- train
    def train(self) -> None:
        """Optimizer steps until total_steps, epoch after epoch; logging, evaluation and checkpoints at their
        cadence. A stop signal on any rank ends every rank at the same step with a checkpoint."""
        recipe, progress = self.recipe, self.progress
        self.bar = ProgressDisplay(self.data.total_steps, progress.step,
                                   enabled=not recipe.disable_tqdm and self.accelerator.is_main_process)
        self.profiler = StepProfiler(self.output_dir / PROFILE_DIR, recipe.profile_steps,
                                     recipe.profile_start_step, progress.step, self.dp.rank, self.accelerator.device)
        self.window = Window(torch.zeros((), dtype=torch.float64, device=self.accelerator.device))
        self.model.train()
        step_name = lambda: f"training step {progress.step + 1}"  # noqa: E731 - named when a timeout happens
        try:
            with StopRequest() as stop, self.watchdog.watching(), \
                    phase(self.accelerator, step_name, recipe.ddp_timeout):
                while progress.step < self.data.total_steps:
                    batches = self.feed.batches(progress)
                    while (progress.step_in_epoch < self.data.plan.steps_per_epoch
                           and progress.step < self.data.total_steps):
                        started = time.perf_counter()
                        step = self.train_step(batches, stop)
                        if recipe.torch_compile and self.first_step_seconds is None:
                            self.first_step_seconds = time.perf_counter() - started
                            self.report_compile()
                        self.after_step(step)
                    if progress.step_in_epoch >= self.data.plan.steps_per_epoch:
                        progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
        except (HftrainError, Preempted):  # already handled: a refusal, a timeout, a preemption checkpoint
            self.bar.close()  # the bar's last line ends, so the message that follows has a line of its own
            raise
        except Exception as exc:  # noqa: BLE001 - an unexpected error: keep the last completed step if that is safe
            self.bar.close()
            self.rescue(exc)
        with phase(self.accelerator, "checkpointing", recipe.ddp_timeout):
            self.saves.wait()  # the last periodic checkpoint is complete before the final save
        self.bar.close()
        self.profiler.stop()
        self.meter.utilization.stop()

    def report_compile(self) -> None:
        """torch_compile: how long this process's first step took; it holds the compilation of the blocks' forward
        and backward (inductor's cache makes a later run's shorter)."""
        self.logger.note(f"hftrain: compile: step {self.progress.step + 1} took {self.first_step_seconds:.1f} s, "
                         f"compiling {self.parts.summary['compiled_blocks']} blocks' forward and backward "
                         "(torch_compile); the steps after it run the compiled code")

    def train_step(self, batches, stop: StopRequest) -> StepResult:
        """One optimizer step over `gradient_accumulation_steps` micro-batches, normalised by the step's tokens."""
        recipe, accelerator, timer = self.recipe, self.accelerator, self.meter.timer
        accum = recipe.gradient_accumulation_steps
        timer.restart()
        micro_batches = [to_device(next(batches), accelerator.device) for _ in range(accum)]
        timer.lap("data_wait")
        timer.move("data_wait", "generation", self.feed.pop_generation_seconds())  # grpo samples while the loop waits
        # The loss of an optimizer step is sum(token losses over all micro-batches and data-parallel ranks) divided by
        # the step's trained tokens over those ranks (for preference objectives: pair losses by the step's pairs,
        # `loss_units`). Gradients are averaged over the data-parallel ranks
        # (DDP/FSDP/DeepSpeed; a tensor-parallel group computes one gradient together; a sequence-parallel group's
        # ranks each return the group's loss, and DeepSpeed's mean over them undoes that: parallel/sequence.py) and the
        # backward divides by `accum` (accelerate, or DeepSpeed's engine): world * accum undoes both. The same
        # collective carries each rank's stop request, so all ranks stop at the same step. All int64: a float32 count
        # would stop being exact above 2**24 tokens per step.
        # The data votes too: a stream past max_bad_rows on any rank stops every rank at this step.
        local = torch.stack([sum(trained_tokens(b) for b in micro_batches),
                             sum(b.pop("num_examples") for b in micro_batches),
                             sum(self.parts.loss.loss_units(b) for b in micro_batches),
                             torch.tensor(int(self.feed.stop_reason is not None), device=accelerator.device),
                             *(torch.tensor(vote, device=accelerator.device) for vote in stop.votes())])
        step_tokens, step_examples, step_units, data_votes, *stop_votes = self.dp.sum(local)
        if any(stop_votes) or data_votes > 0:
            with phase(accelerator, "the preemption checkpoint", recipe.ddp_timeout), \
                    self.watchdog.window("the preemption checkpoint"):
                saved = self.save_checkpoint()
            if data_votes > 0:
                reason = self.feed.stop_reason or "the training data of another rank stopped the run"
                raise HftrainError(f"{reason}. The state after step {self.progress.step} is in {saved}: resume from "
                                   "it once fixed")
            raise Preempted(signal_names([int(v) for v in stop_votes]), self.progress.step, str(saved),
                            announce=accelerator.is_main_process)
        scale = self.dp.world * accum / step_units.clamp(min=1)
        learning_rate = self.optimizer.param_groups[0]["lr"]
        timer.lap("token_sync")
        self.parts.loss.prepare_step(self.model, micro_batches, self.dp.sum)  # e.g. what the step counts first
        loss, grad_norm, updated = optimizer_step(self.backend, self.model, self.optimizer, self.scheduler,
                                                  micro_batches, scale, recipe.max_grad_norm or float("inf"), timer)
        if not updated:
            self.refuse_non_finite_step(grad_norm)
        self.meter.count([shape for batch in micro_batches for shape in self.parts.loss.forward_shapes(batch)],
                         local[0], local[1], local[2])
        return StepResult(loss, int(step_units), int(step_tokens), int(step_examples), grad_norm, updated,
                          learning_rate, self.parts.loss.pop_stats(), self.parts.loss.pop_token_stats())

    def refuse_non_finite_step(self, grad_norm: float) -> None:
        """A step with a NaN/inf gradient norm was not applied: nan_policy skip_step goes on (the step is counted),
        stop saves the state of the last good step and stops. A backend that applies the step inside backward
        cannot skip it."""
        step = self.progress.step + 1
        if self.backend.step_applied_in_backward:
            raise HftrainError(
                f"step {step} has a non-finite gradient norm under {self.backend.record.name}, whose engine has "
                "already applied it; resume from the last checkpoint with a lower learning_rate or a max_grad_norm"
            )
        if self.recipe.nan_policy == "stop":
            saved = self.save_checkpoint()  # the parameters are those after the last good step
            raise HftrainError(
                f"step {step} has a non-finite gradient norm ({grad_norm}): the loss diverged or a batch produced "
                f"NaN/inf. The state after step {step - 1} is in {saved}. Lower learning_rate, set max_grad_norm, "
                "check the data, or set nan_policy=skip_step"
            )

    def after_step(self, step: StepResult) -> None:
        """Count the step, then log, evaluate and save when their cadence says so."""
        recipe, progress = self.recipe, self.progress
        self.profiler.step()
        self.window.add(step)
        progress.nan_skipped_steps += not step.updated
        progress.step += 1
        progress.step_in_epoch += 1
        progress.trained_tokens += step.tokens
        self.watchdog.step_done(progress.step)
        self.bar.update(1)
        if progress.step % recipe.logging_steps == 0 or progress.step in (1, self.data.total_steps):
            self.log_window(step)
        if self.evaluates and self.due(recipe.eval_strategy, recipe.eval_steps) \
                and progress.step < self.data.total_steps:  # the last step's evaluation is the final one
            with phase(self.accelerator, "evaluation", recipe.ddp_timeout), self.watchdog.window("evaluation"):
                metrics = self.evaluate()
            self.logger.log({"step": progress.step, **metrics})
            headline = self.objective.eval_headline  # eval_loss, grpo's eval_reward
            if self.accelerator.is_main_process and metrics.get(headline) is not None:
                self.bar.write(f"hftrain: {headline} {metrics[headline]:.4f} at step {progress.step}")
        if self.due(recipe.save_strategy, recipe.save_steps):
            with phase(self.accelerator, "checkpointing", recipe.ddp_timeout), \
                    self.watchdog.window("a checkpoint save"):
                saved = self.save_checkpoint(background=True)
                self.push_at_save(saved)

    def push_at_save(self, saved: Path) -> None:
        """hub_strategy every_save / checkpoint / all_checkpoints: the model for use as of this save, written by every
        rank as the final model is (card included) into output_dir/.hub-upload, then uploaded in the background by the
        main process, with the checkpoint the strategy names. Skipped on every rank while the previous upload runs."""
        if not self.hub.at_saves:
            return
        busy = torch.tensor(float(self.hub.busy()), device=self.accelerator.device)
        if self.accelerator.reduce(busy, reduction="sum").item():
            self.logger.print(f"hftrain: the hub upload before step {self.progress.step} still runs; this save is "
                              "not pushed")
            return
        model_dir = self.output_dir / HUB_UPLOAD_DIR
        checkpoint.save_final(self.backend, self.model, self.processor or self.tokenizer, model_dir, self.recipe,
                              self.recorded_progress(), self.current_run_info(), describe=self.card_writer(model_dir))
        written = self.saves.pending[1] if self.saves.pending and self.saves.pending[0] == saved else None
        self.hub.at_save(self.progress.step, model_dir, saved, written)

    def card_writer(self, location: Path, curve: bool = True):
        """What `checkpoint.save_final` calls on the main process to add the model card to the folder it writes."""
        return lambda folder: self.write_card(folder, location, curve)

    def write_card(self, folder: Path, location: Path, curve: bool = True) -> Path:
        """README.md of a folder for use (hftrain.card), from its run files and metrics.jsonl so far; `curve`: draw
        the loss curve (matplotlib, ~0.5 s: skipped for final/'s first card when the final evaluation rewrites it). The
        objective's own files first (`Objective.add_files`)."""
        self.objective.add_files(self.train_run, folder)
        return card.run_card(folder, self.output_dir, kind="adapter" if self.recipe.use_peft else "model",
                             device_hours=self.meter.device_hours(),
                             repo_id=self.hub.repo_id if self.recipe.push_to_hub else None, location=location,
                             curve=curve)

    def rescue(self, exc: Exception) -> None:
        """An unexpected error inside training. One process whose parameters are those of the last completed step
        (the error came before the step's update, so the schedule has not moved past the step count) saves them as a
        checkpoint that a resume continues from; otherwise the error is raised as it is. With several processes the
        other ranks may be inside a collective that a save would wait on: the last periodic checkpoint stands."""
        step = self.progress.step
        consistent = (self.accelerator.num_processes == 1 and not self.backend.step_applied_in_backward
                      and self.scheduler.last_epoch == step)
        if not (consistent and step > 0):
            raise exc
        rescue = self.save_checkpoint()
        raise HftrainError(
            f"training step {step + 1} failed ({type(exc).__name__}: {first_line(exc)}); the trained state after step "
            f"{step} is kept in {rescue}: fix the cause and rerun with --resume_from_checkpoint {rescue}"
        ) from exc

    def due(self, strategy: str, every: int | None) -> bool:
        """Whether an eval_strategy / save_strategy falls on the step just taken."""
        if strategy == "epoch":
            return self.progress.step_in_epoch == self.data.plan.steps_per_epoch
        return strategy == "steps" and bool(every) and self.progress.step % every == 0

    def log_window(self, step: StepResult) -> None:
        """One metrics row for the steps since the last one (loss summed over the data-parallel ranks here)."""
        progress, window = self.progress, self.window
        loss_sum = self.dp.sum(window.loss).item()
        loss = loss_sum / window.units if window.units else None
        stats = {name: value / window.units for name, value in summed_stats(self.dp, window.stats or {}).items()}
        data = self.feed.window_metrics(self.dp)  # a stream counts its own epochs (passes)
        row = {
            "step": progress.step,
            "epoch": data.pop("epoch", round(progress.epoch + progress.step_in_epoch / self.data.plan.steps_per_epoch,
                                             4)),
            "loss": loss,
            **stats,
            **({name: value / window.tokens for name, value in summed_stats(self.dp, window.token_stats or {}).items()}
               if window.tokens else {}),  # e.g. the router loss's aux_loss
            "learning_rate": step.learning_rate,
            "grad_norm": step.grad_norm,
            "trained_tokens": progress.trained_tokens,
            "nan_skipped_steps": progress.nan_skipped_steps,
            **data,
            **self.watchdog.metrics(),
            **self.meter.window(checksum=self.backend.param_checksum(self.model), step=progress.step, loss=loss,
                                grad_norm=step.grad_norm, local_loss_sum=window.loss, global_tokens=window.tokens,
                                global_examples=window.examples),
        }
        row[f"{self.parts.loss.examples_name}_per_second"] = row["samples_per_second"]  # pairs_per_second for dpo
        self.logger.log(row)
        self.bar.show(progress.step, {**self.headline(row), "tokens/s": f"{row['tokens_per_second']:,.0f}"})
        window.reset()

    def headline(self, row: dict) -> dict[str, str]:
        """The objective's headline metrics of a logged row (`headline` of its loss module: the loss; grpo's reward
        first, logged at the steps that sample), as the progress display shows them; the closing line shows the last
        logged value of each."""
        shown = {name: "skipped" if row[name] is None else f"{row[name]:.4f}"
                 for name in self.parts.loss.headline if name in row}
        self.last_headline.update(shown)
        return shown

    @property
    def evaluates(self) -> bool:
        """Whether evaluations run anything: the objective's (with an eval set), eval_tasks or log_completions."""
        return self.data.eval_set is not None or bool(self.eval_addons)

    def evaluate(self) -> dict:
        """One evaluation row, every rank calling: the objective's evaluation when there is an eval set
        (`Objective.evaluate`: the eval loss, or grpo's rewards of generated completions), then each add-on on the
        live model (eval_tasks' benchmarks, log_completions' samples)."""
        metrics = self.objective.evaluate(self.train_run) if self.data.eval_set is not None else {}
        for addon in self.eval_addons:
            metrics.update(addon(self.train_run))
        return metrics

    def current_run_info(self) -> dict:
        """run_info with what moves during training: device-hours so far and the schedule's state (plain numbers,
        stored as JSON with the progress)."""
        self.run_info.update(device_hours=self.meter.device_hours(), scheduler=self.scheduler.state_dict())
        return self.run_info

    def recorded_progress(self) -> checkpoint.Progress:
        """The progress a checkpoint or the final folder records (every rank calls it: a stream's passes are summed
        over the data-parallel ranks, as logged)."""
        return self.feed.recorded_progress(self.progress, self.dp)

    def save_checkpoint(self, background: bool = False) -> Path:
        """checkpoint-N of the current state; the save in flight is waited for first. `background`: return once the
        state is staged (async_checkpointing), the folder appears when it is written."""
        return checkpoint.save_checkpoint(self.backend, self.output_dir, self.recipe, self.recorded_progress(),
                                          self.current_run_info(), self.objective_tensors, self.saves, background,
                                          self.feed.state_dict(self.progress.step))

    # ------------------------------------------------------------------------------------------ finish
    def finish(self) -> Path:
        """The final model first (with its card), then the final evaluation (whatever it does, the trained model is
        kept) and the card again with its result, then the push to the hub after the uploads in flight."""
        final_dir = self.save_final()
        self.save_quantized(final_dir)
        if self.evaluates:
            self.final_evaluation(final_dir)
            if self.accelerator.is_main_process:
                self.write_card(final_dir, final_dir)
        device_hours = self.meter.device_hours()
        cost = f" (cost {device_hours * self.recipe.cost_per_gpu_hour:.2f})" if self.recipe.cost_per_gpu_hour else ""
        last = ", ".join(f"{name} {value}" for name, value in self.last_headline.items())
        self.logger.print(f"hftrain: final model saved to {final_dir}; {device_hours:.4f} device-hours{cost}"
                          + (f"; last logged {last}" if last else ""))
        try:
            self.hub.finish(final_dir, self.output_dir / HUB_UPLOAD_DIR if self.hub.at_saves else None)
            advice = next_steps(self.output_dir, self.objective.writes_text, self.processor, self.objective.final_use)
            self.logger.print(f"hftrain: next: {advice}")
        finally:
            self.logger.close()
        return final_dir

    def save_final(self) -> Path:
        """The final model (full size whatever the backend) with its run files. If saving fails, the trained state is
        kept as a checkpoint instead of being lost with the process."""
        final_dir = self.output_dir / FINAL_DIR
        try:
            with phase(self.accelerator, "saving the final model", self.recipe.ddp_timeout):
                checkpoint.save_final(self.backend, self.model, self.processor or self.tokenizer, final_dir,
                                      self.recipe, self.recorded_progress(), self.current_run_info(),
                                      describe=self.card_writer(final_dir, curve=self.data.eval_set is None))
        except HftrainError:  # e.g. a collective timed out: another save would wait on the same ranks
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: keep what was trained, then report
            rescue = self.save_checkpoint()
            raise HftrainError(
                f"saving the final model to {final_dir} failed ({first_line(exc)}); the trained state after step "
                f"{self.progress.step} is kept in {rescue}: fix the cause and rerun with --resume_from_checkpoint "
                f"{rescue} (it resumes at the end and saves the final model without training again)"
            ) from exc
        return final_dir

    def save_quantized(self, final_dir: Path) -> None:
        """qat_scheme: final-quantized/, the trained final/ (an adapter: merged into its base first, `hftrain merge`)
        converted to real quantized weights (hftrain.qat)."""
        if self.recipe.qat_scheme is None:
            return
        if self.accelerator.is_main_process:
            folder, merged = self.output_dir / qat.QUANTIZED_DIR, self.output_dir / f".tmp-merged-{qat.QUANTIZED_DIR}"
            shutil.rmtree(merged, ignore_errors=True)
            try:
                source = final_dir
                if self.recipe.use_peft:
                    with whole_loads():  # the main process alone, under ZeRO-3 too
                        merge(final_dir, merged)
                    source = merged
                folder = qat.save_quantized(self.recipe, source, folder, self.processor or self.tokenizer)
            finally:
                shutil.rmtree(merged, ignore_errors=True)
            self.logger.print(f"hftrain: quantized model ({self.recipe.qat_scheme}, torchao) saved to {folder}")
        with phase(self.accelerator, "the conversion of the QAT model", self.recipe.ddp_timeout):
            self.accelerator.wait_for_everyone()

    def final_evaluation(self, final_dir: Path) -> None:
        try:
            with phase(self.accelerator, "the final evaluation", self.recipe.ddp_timeout):
                metrics = self.evaluate()
        except Exception as exc:  # noqa: BLE001 - the model is saved; say so next to the cause
            raise HftrainError(f"the final evaluation failed ({first_line(exc)}); the trained model was saved to "
                               f"{final_dir} before it") from exc
        self.logger.log({"step": self.progress.step, **metrics})
        headline = self.objective.eval_headline
        if metrics.get(headline) is not None:
            self.logger.print(f"hftrain: {headline} {metrics[headline]:.4f} after {self.progress.step} steps")


def entry_prog(as_module: bool) -> str:
    """What `--help` and the recipe's errors call this entry point, as it was started (`hftrain finetune` passes its
    own name): `python -m hftrain.finetune`; the script under `accelerate launch` (which sets
    ACCELERATE_MIXED_PRECISION in every process it starts), or run by python."""
    if as_module:
        return "python -m hftrain.finetune"
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ
    return f"{'accelerate launch [options]' if launched else 'python'} {sys.argv[0]}"


def main(argv: list[str] | None = None, runner: type[Finetune] = Finetune, prog: str | None = None) -> None:
    """`runner`: the phase object; test launchers pass a subclass. `prog`: the command's name in `--help`."""
    def run() -> Path:
        with same_in_every_process():  # every process reads the same recipe
            recipe = load_recipe(argv, prog=prog or entry_prog(as_module=__spec__ is not None))
        return runner(recipe).run()

    try:
        run_tool(run)
    except Preempted as stopped:
        if stopped.announce:
            print(f"hftrain: {stopped}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:  # Ctrl-C before training started, or a second one during it: stop without saving
        if os.environ.get("RANK", "0") == "0":
            print("hftrain: interrupted; nothing was saved after the last checkpoint", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    run_process(main)
