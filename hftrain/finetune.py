"""Fine-tune a causal LM: setup -> data -> model -> optimizer -> loop (evaluate, save) -> final model.

    accelerate launch --config_file accelerate_configs/cpu.yaml hftrain/finetune.py \
        --config recipes/tiny-chat.yaml [--learning_rate 1e-3 --max_steps 50 ...]
    python -m hftrain.finetune --help

The launch preset picks the strategy (DDP, FSDP, DeepSpeed); the recipe holds everything else.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import the package, not sibling modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch

from hftrain import checkpoint, strategy
from hftrain.config import Recipe, check_environment, dump_recipe, load_recipe
from hftrain.data import (
    IGNORE_INDEX,
    Collator,
    eval_micro_batches,
    load_datasets,
    make_loader,
    training_plan,
    training_rows,
)
from hftrain.distributed import launch_info, make_accelerator, phase, preset_conflicts
from hftrain.errors import ConfigError, HftrainError, report_and_exit
from hftrain.metrics import FlopCounter, RunMeter, StepProfiler, current_memory_mb
from hftrain.model import (
    CausalLMTokenLoss,
    build_model,
    build_tokenizer,
    check_model_config,
    fit_embeddings_to_tokenizer,
    model_summary,
    pad_token_id,
)
from hftrain.optim import build_optimizer, build_scheduler
from hftrain.preemption import EXIT_PREEMPTED, Preempted, StopRequest
from hftrain.tracking import MetricLogger, quiet_other_ranks


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def trained_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of predicted tokens in a micro-batch (labels are shifted by the loss)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate(accelerator, dp, model, dataset, collator: Collator, recipe: Recipe) -> dict[str, float]:
    """Token-weighted loss over the whole eval set, every data-parallel rank evaluating a disjoint shard.

    Ranks reduce (loss sum, token count) pairs, which is exact whatever the shard sizes; every rank
    runs the same number of forwards so sharded models (FSDP, ZeRO-3, tensor parallel) stay in step.
    """
    model.eval()
    shards = eval_micro_batches(len(dataset), recipe.per_device_eval_batch_size, dp.world, dp.rank)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in make_loader(shards, collator, recipe.dataloader_num_workers,
                             pin_memory=recipe.dataloader_pin_memory):
        batch.pop("num_examples")
        batch = to_device(batch, accelerator.device)
        totals += torch.stack([model(**batch).double(), trained_tokens(batch).double()])
    loss_sum, tokens = dp.sum(totals).tolist()
    model.train()
    loss = loss_sum / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(tokens)}


def optimizer_step(accelerator, model, optimizer, scheduler, micro_batches, scale, max_norm, timer):
    """Forward/backward every micro-batch of one optimizer step, clip, then step -- unless the gradient norm
    is NaN/inf, in which case nothing is updated. Returns (summed local token loss, grad norm, updated?).

    The norm is taken after gradients are reduced across ranks, so every rank takes the same decision.
    """
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss_sum = model(**batch)
            timer.lap("forward")
            accelerator.backward(loss_sum * scale)
            step_loss += loss_sum.detach()
            timer.lap("backward")
            if accelerator.sync_gradients:
                grad_norm = strategy.clip_grad_norm(accelerator, model, max_norm)
                finite = grad_norm is None or math.isfinite(float(grad_norm))  # DeepSpeed gives a float
                if finite:
                    optimizer.step()
                scheduler.step()  # a skipped step still counts: the schedule follows optimizer steps
                optimizer.zero_grad(set_to_none=True)
                timer.lap("optimizer")
    return step_loss, grad_norm, finite


def run(recipe: Recipe) -> Path:
    # ------------------------------------------------------------------ setup
    checkpoint.never_world_writable()
    problems = check_environment(recipe, torch.cuda.is_available()) + preset_conflicts(recipe)
    if problems:
        raise ConfigError(problems, "recipe for this machine and launch")
    check_model_config(recipe)  # a missing model or a too-long max_length fails before any heavy work
    accelerator = make_accelerator(recipe)
    quiet_other_ranks(accelerator)
    dp = strategy.data_parallel(accelerator, recipe)  # ranks of one tensor-parallel group share their data
    from accelerate.utils import set_seed

    set_seed(recipe.seed)
    output_dir = Path(recipe.output_dir)
    resume_from = checkpoint.resolve_resume(recipe)
    world, rank = dp.world, dp.rank

    # ------------------------------------------------------------------- data
    # Before the model: a bad dataset should fail in seconds, not after loading weights.
    tokenizer = build_tokenizer(recipe)
    with phase(accelerator, "data preparation", recipe.ddp_timeout), accelerator.main_process_first():
        train_set, eval_set, data_stats = load_datasets(recipe, tokenizer)  # rank 0 fills the cache first
    rows = training_rows(train_set, recipe.packing, recipe.max_length)
    plan = training_plan(recipe, train_set, rows, world)
    if len(rows) < plan.global_batch:
        raise HftrainError(
            f"the training set has {len(rows)} usable {'packed rows' if recipe.packing else 'examples'}, fewer than "
            f"one global batch of {plan.global_batch} (per_device_train_batch_size x {world} processes x "
            "gradient_accumulation_steps); use a smaller batch or more data"
        )
    total_steps = recipe.max_steps if recipe.max_steps > 0 else \
        math.ceil(recipe.num_train_epochs * plan.steps_per_epoch)
    collator = Collator(train_set, pad_token_id(tokenizer), rows, packed=recipe.packing)
    eval_collator = Collator(eval_set, pad_token_id(tokenizer)) if eval_set is not None else None

    # ------------------------------------------------------------------ model
    memory_baseline_mb = current_memory_mb(accelerator.device)  # what the estimator's numbers sit on top of
    model = CausalLMTokenLoss(build_model(recipe), recipe.loss_chunk_tokens, recipe.use_liger_kernel)
    fit_embeddings_to_tokenizer(model.lm, tokenizer)
    flops = FlopCounter(model.lm)
    summary = model_summary(model)  # before prepare: sharding strategies hide the full parameter counts

    # -------------------------------------------------------------- optimizer
    optimizer = build_optimizer(recipe, model)
    scheduler = build_scheduler(recipe, optimizer, total_steps)
    model, optimizer = strategy.prepare(accelerator, model, optimizer)  # DDP / FSDP2 / DeepSpeed engine

    progress, resumed = checkpoint.Progress(world_size=world), {}
    if resume_from is not None:
        progress, resumed = checkpoint.load_checkpoint(accelerator, model, scheduler, resume_from, plan,
                                                        recipe)
    n_trainable, n_params = strategy.parameter_counts(model)
    memory = strategy.model_state_memory(accelerator, recipe, n_trainable, n_params)
    run_info = {"launch": launch_info(accelerator, model, optimizer), "model": summary, "data": data_stats,
                "effective_batch_size": plan.global_batch, "total_steps": total_steps, "memory_estimate": memory,
                "launch_preset": {"recipe": recipe.launch_preset, "reason": recipe.launch_preset_reason},
                "memory_baseline_mb": round(memory_baseline_mb, 1)}
    # Nothing is written into output_dir before the recipe, data and model have all been accepted.
    if accelerator.is_main_process:
        if recipe.overwrite_output_dir and resume_from is None:
            checkpoint.clear_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, output_dir / checkpoint.CONFIG_FILE)
    accelerator.wait_for_everyone()
    logger = MetricLogger(accelerator, recipe, progress.step, run_info, resumed)
    run_info.update(logger.run_ids())  # e.g. the W&B run id, so that a resumed run continues it
    meter = RunMeter(accelerator, flops, straggler_threshold=recipe.straggler_threshold,
                     peak_tflops_override=recipe.device_peak_tflops, cost_per_gpu_hour=recipe.cost_per_gpu_hour,
                     effective_batch_size=plan.global_batch, device_hours_before=resumed.get("device_hours", 0.0),
                     warn=logger.warn)
    logger.print(
        f"hftrain: {run_info['launch']['distributed_type']} with {accelerator.num_processes} process(es) on "
        f"{accelerator.device}, "
        f"model wrapped as {run_info['launch']['model_wrapper']}; "
        f"effective batch {plan.global_batch} = {recipe.per_device_train_batch_size} per device x {world} x "
        f"{recipe.gradient_accumulation_steps} accumulation; {total_steps} optimizer steps "
        f"({plan.steps_per_epoch} per epoch); {summary['method']} fine-tuning, {n_trainable:,} of "
        f"{n_params:,} parameters trained; "
        f"{len(train_set)} training examples in {len(rows)} rows"
        + (f"; resuming from {resume_from} at step {progress.step}" if resume_from else "")
    )
    logger.print(
        f"hftrain: parallelism {memory['strategy']} over {accelerator.num_processes} process(es): model state "
        f"~{memory['per_device_gib']} "
        f"GiB per device (+{memory['offloaded_gib']} GiB offloaded to CPU; activations extra) of "
        f"{memory['device_memory_gib']} GiB" + (f"; the recipe is sized for preset {recipe.launch_preset}: "
                                                 f"{recipe.launch_preset_reason or 'no reason given'}"
                                                 if recipe.launch_preset else "")
    )

    # ------------------------------------------------------------------- loop
    from tqdm.auto import tqdm

    accum, max_norm = recipe.gradient_accumulation_steps, recipe.max_grad_norm or float("inf")
    bar = tqdm(total=total_steps, initial=progress.step, desc="training",
               disable=recipe.disable_tqdm or not accelerator.is_main_process)
    profiler = StepProfiler(output_dir / "profile", recipe.profile_steps, recipe.profile_start_step, progress.step,
                            rank, accelerator.device)
    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    window_tokens, window_examples = 0, 0

    def current_run_info() -> dict:
        """run_info with what moves during training: device-hours so far, the schedule's state (plain numbers,
        stored as JSON with the progress)."""
        run_info.update(device_hours=meter.device_hours(), scheduler=scheduler.state_dict())
        return run_info

    def save() -> Path:
        return checkpoint.save_checkpoint(accelerator, output_dir, recipe, progress, current_run_info())

    model.train()
    with StopRequest() as stop, phase(accelerator, lambda: f"training step {progress.step + 1}", recipe.ddp_timeout):
        while progress.step < total_steps:
            batches = iter(make_loader(plan.micro_batches(progress.epoch, rank, progress.step_in_epoch), collator,
                                       recipe.dataloader_num_workers, pin_memory=recipe.dataloader_pin_memory))
            while progress.step_in_epoch < plan.steps_per_epoch and progress.step < total_steps:
                meter.timer.restart()
                micro_batches = [to_device(next(batches), accelerator.device) for _ in range(accum)]
                meter.timer.lap("data_wait")
                # The loss of an optimizer step is sum(token losses over all micro-batches and data-parallel ranks)
                # divided by the step's trained tokens over those ranks. Gradients are averaged over the
                # data-parallel ranks (DDP/FSDP/DeepSpeed; a tensor-parallel group computes one gradient together)
                # and the backward divides by `accum` (accelerate, or DeepSpeed's engine): world * accum undoes both.
                # The same collective carries each rank's stop request, so all ranks stop at the same step. All
                # int64: a float32 count would stop being exact above 2**24 tokens per step.
                local = torch.stack([sum(trained_tokens(b) for b in micro_batches),
                                     sum(b.pop("num_examples") for b in micro_batches),
                                     torch.tensor(int(stop.requested), device=accelerator.device)])
                step_tokens, step_examples, stop_votes = dp.sum(local)
                if stop_votes > 0:
                    with phase(accelerator, "the preemption checkpoint", recipe.ddp_timeout):
                        saved = save()
                    raise Preempted(stop.name or "a signal on another rank", progress.step, str(saved))
                scale = world * accum / step_tokens.clamp(min=1)
                learning_rate = optimizer.param_groups[0]["lr"]
                meter.timer.lap("token_sync")
                step_loss, grad_norm, updated = optimizer_step(accelerator, model, optimizer, scheduler,
                                                               micro_batches, scale, max_norm, meter.timer)
                if not updated and strategy.updates_inside_backward(accelerator):
                    raise HftrainError(
                        f"step {progress.step + 1} has a non-finite gradient norm under DeepSpeed, whose engine has "
                        "already applied it; resume from the last checkpoint with a lower learning_rate or "
                        "a max_grad_norm"
                    )
                if not updated and recipe.nan_policy == "stop":
                    saved = save()  # the parameters are those after the last good step
                    raise HftrainError(
                        f"step {progress.step + 1} has a non-finite gradient norm ({float(grad_norm)}): the loss "
                        f"diverged or a batch produced NaN/inf. The state after step {progress.step} is in {saved}. "
                        "Lower learning_rate, set max_grad_norm, check the data, or set nan_policy=skip_step"
                    )
                meter.count(micro_batches, local[0])
                profiler.step()
                progress.nan_skipped_steps += not updated
                if updated:
                    window_loss += step_loss
                    window_tokens += int(step_tokens)
                window_examples += int(step_examples)
                progress.step += 1
                progress.step_in_epoch += 1
                progress.trained_tokens += int(step_tokens)
                bar.update(1)

                if progress.step % recipe.logging_steps == 0 or progress.step in (1, total_steps):
                    loss_sum = dp.sum(window_loss).item()
                    loss = loss_sum / window_tokens if window_tokens else None
                    norm = float(grad_norm) if grad_norm is not None else None
                    row = {
                        "step": progress.step,
                        "epoch": round((progress.epoch + progress.step_in_epoch / plan.steps_per_epoch), 4),
                        "loss": loss,
                        "learning_rate": learning_rate,
                        "grad_norm": norm,
                        "trained_tokens": progress.trained_tokens,
                        "nan_skipped_steps": progress.nan_skipped_steps,
                        **meter.window(model=model, step=progress.step, loss=loss, grad_norm=norm,
                                       local_loss_sum=window_loss, global_tokens=window_tokens,
                                       global_examples=window_examples),
                    }
                    logger.log(row)
                    bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "skipped",
                                    tokens_per_s=f"{row['tokens_per_second']:,.0f}")
                    window_loss.zero_()
                    window_tokens, window_examples = 0, 0
                if eval_set is not None and recipe.eval_steps and progress.step % recipe.eval_steps == 0 \
                        and progress.step < total_steps:
                    with phase(accelerator, "evaluation", recipe.ddp_timeout):
                        metrics = evaluate(accelerator, dp, model, eval_set, eval_collator, recipe)
                    logger.log({"step": progress.step, **metrics})
                if recipe.save_steps and progress.step % recipe.save_steps == 0:
                    with phase(accelerator, "checkpointing", recipe.ddp_timeout):
                        save()
            if progress.step_in_epoch >= plan.steps_per_epoch:
                progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
    bar.close()
    profiler.stop()

    # --------------------------------------------------------- evaluate & save
    if eval_set is not None:
        with phase(accelerator, "the final evaluation", recipe.ddp_timeout):
            metrics = evaluate(accelerator, dp, model, eval_set, eval_collator, recipe)
        logger.log({"step": progress.step, **metrics})
        logger.print(f"hftrain: eval_loss {metrics['eval_loss']:.4f} after {progress.step} steps")
    final_dir = output_dir / "final"
    with phase(accelerator, "saving the final model", recipe.ddp_timeout):
        checkpoint.save_final(accelerator, model, tokenizer, final_dir)
    info = current_run_info()
    if accelerator.is_main_process:
        checkpoint.write_run_files(final_dir, recipe, progress, info)
    cost = f" (cost {info['device_hours'] * recipe.cost_per_gpu_hour:.2f})" if recipe.cost_per_gpu_hour else ""
    logger.print(f"hftrain: final model saved to {final_dir}; {info['device_hours']:.4f} device-hours{cost}")
    logger.close()
    return final_dir


def main(argv: list[str] | None = None) -> None:
    try:
        run(load_recipe(argv))
    except HftrainError as error:
        report_and_exit(error)
    except Preempted as stopped:
        print(f"hftrain: {stopped}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()
