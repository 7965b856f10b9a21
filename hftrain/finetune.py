"""Fine-tune a causal LM: setup -> data -> model -> optimizer -> loop (evaluate, save) -> final model.

    accelerate launch --config_file accelerate_configs/cpu.yaml hftrain/finetune.py \
        --config recipes/tiny-chat.yaml [--learning_rate 1e-3 --max_steps 50 ...]
    python -m hftrain.finetune --help

The launch preset picks the strategy (DDP, FSDP, DeepSpeed); the recipe holds everything else.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import the package, not sibling modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import torch

from hftrain import checkpoint
from hftrain.config import Recipe, check_environment, dump_recipe, load_recipe
from hftrain.data import IGNORE_INDEX, BatchPlan, Collator, eval_micro_batches, load_datasets, make_loader
from hftrain.distributed import launch_info, make_accelerator, preset_conflicts
from hftrain.errors import ConfigError, HftrainError, report_and_exit
from hftrain.model import (
    CausalLMTokenLoss,
    build_model,
    build_tokenizer,
    check_model_fits,
    model_summary,
    pad_token_id,
)
from hftrain.optim import build_optimizer, build_scheduler
from hftrain.tracking import MetricLogger, peak_memory_mb


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def trained_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of predicted tokens in a micro-batch (labels are shifted by the loss)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate(accelerator, model, dataset, collator: Collator, recipe: Recipe) -> dict[str, float]:
    """Token-weighted loss over the whole eval set, every rank evaluating a disjoint shard.

    Ranks reduce (loss sum, token count) pairs, which is exact whatever the shard sizes; every rank
    runs the same number of forwards so sharded models (FSDP, ZeRO-3) stay in step.
    """
    model.eval()
    shards = eval_micro_batches(len(dataset), recipe.per_device_eval_batch_size,
                                accelerator.num_processes, accelerator.process_index)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in make_loader(shards, collator, recipe.dataloader_num_workers):
        batch = to_device(batch, accelerator.device)
        totals += torch.stack([model(**batch).double(), trained_tokens(batch).double()])
    loss_sum, tokens = accelerator.reduce(totals, reduction="sum").tolist()
    model.train()
    loss = loss_sum / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(tokens)}


def run(recipe: Recipe) -> Path:
    # ------------------------------------------------------------------ setup
    problems = check_environment(recipe, torch.cuda.is_available()) + preset_conflicts(recipe)
    if problems:
        raise ConfigError(problems, "recipe for this machine and launch")
    accelerator = make_accelerator(recipe)
    from accelerate.utils import set_seed

    set_seed(recipe.seed)
    output_dir = Path(recipe.output_dir)
    resume_from = checkpoint.resolve_resume(recipe)
    world, rank = accelerator.num_processes, accelerator.process_index
    if accelerator.is_main_process:
        if recipe.overwrite_output_dir and resume_from is None:
            checkpoint.clear_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_recipe(recipe, output_dir / checkpoint.CONFIG_FILE)

    # ------------------------------------------------------------------- data
    # Before the model: a bad dataset should fail in seconds, not after loading weights.
    tokenizer = build_tokenizer(recipe)
    with accelerator.main_process_first():  # rank 0 tokenizes and fills the cache, the others read it
        train_set, eval_set, data_stats = load_datasets(recipe, tokenizer)
    plan = BatchPlan(len(train_set), recipe.per_device_train_batch_size, world, recipe.gradient_accumulation_steps,
                     recipe.seed, shuffle=recipe.train_sampling_strategy == "random")
    if len(train_set) < plan.global_batch:
        raise HftrainError(
            f"the training set has {len(train_set)} usable examples, fewer than one global batch of "
            f"{plan.global_batch} (per_device_train_batch_size x {world} processes x gradient_accumulation_steps); "
            "use a smaller batch or more data"
        )
    total_steps = recipe.max_steps if recipe.max_steps > 0 else math.ceil(recipe.num_train_epochs * plan.steps_per_epoch)
    collator = Collator(train_set, pad_token_id(tokenizer))
    eval_collator = Collator(eval_set, pad_token_id(tokenizer)) if eval_set is not None else None

    # ------------------------------------------------------------------ model
    model = CausalLMTokenLoss(build_model(recipe))
    check_model_fits(recipe, model.lm)
    summary = model_summary(model)  # before prepare: sharding strategies hide the full parameter counts

    # -------------------------------------------------------------- optimizer
    optimizer = build_optimizer(recipe, model)
    scheduler = build_scheduler(recipe, optimizer, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by the loop once per optimizer step

    progress = checkpoint.Progress(world_size=world)
    if resume_from is not None:
        progress, _ = checkpoint.load_checkpoint(accelerator, model, resume_from)
        if progress.world_size != world:  # keep the data position in examples, not in (resized) steps
            examples_done = progress.step_in_epoch * plan.global_batch // world * progress.world_size
            progress.step_in_epoch, progress.world_size = examples_done // plan.global_batch, world
    run_info = {"launch": launch_info(accelerator, model), "model": summary, "data": data_stats,
                "effective_batch_size": plan.global_batch, "total_steps": total_steps}
    logger = MetricLogger(accelerator, recipe, progress.step, run_info)
    logger.print(
        f"hftrain: {run_info['launch']['distributed_type']} with {world} process(es) on {accelerator.device}, "
        f"model wrapped as {run_info['launch']['model_wrapper']}; "
        f"effective batch {plan.global_batch} = {recipe.per_device_train_batch_size} per device x {world} x "
        f"{recipe.gradient_accumulation_steps} accumulation; {total_steps} optimizer steps "
        f"({plan.steps_per_epoch} per epoch); {summary['method']} fine-tuning, {summary['trainable_parameters']:,} "
        f"of {summary['parameters']:,} parameters trained; "
        f"data {data_stats['train']}" + (f"; resuming from {resume_from} at step {progress.step}" if resume_from else "")
    )

    # ------------------------------------------------------------------- loop
    from tqdm.auto import tqdm

    accum, max_norm = recipe.gradient_accumulation_steps, recipe.max_grad_norm or float("inf")
    bar = tqdm(total=total_steps, initial=progress.step, disable=not accelerator.is_main_process, desc="training")
    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    window_tokens, window_examples, window_start = 0, 0, time.perf_counter()
    model.train()
    while progress.step < total_steps:
        batches = iter(make_loader(plan.micro_batches(progress.epoch, rank, progress.step_in_epoch), collator,
                                   recipe.dataloader_num_workers))
        while progress.step_in_epoch < plan.steps_per_epoch and progress.step < total_steps:
            micro_batches = [to_device(next(batches), accelerator.device) for _ in range(accum)]
            # The loss of an optimizer step is sum(token losses over all micro-batches and ranks) divided by
            # the step's trained tokens over all ranks. Gradients are averaged over ranks (DDP/FSDP/DeepSpeed)
            # and accelerator.backward divides by `accum`: multiplying by world * accum undoes both.
            step_tokens = accelerator.reduce(sum(trained_tokens(b) for b in micro_batches), reduction="sum")
            scale = world * accum / step_tokens.clamp(min=1)
            learning_rate = optimizer.param_groups[0]["lr"]
            for batch in micro_batches:
                with accelerator.accumulate(model):
                    loss_sum = model(**batch)
                    accelerator.backward(loss_sum * scale)
                    window_loss += loss_sum.detach()
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            window_tokens += int(step_tokens)
            window_examples += min(plan.global_batch, plan.num_examples - progress.step_in_epoch * plan.global_batch)
            progress.step += 1
            progress.step_in_epoch += 1
            progress.trained_tokens += int(step_tokens)
            bar.update(1)

            if progress.step % recipe.logging_steps == 0 or progress.step in (1, total_steps):
                elapsed = time.perf_counter() - window_start
                loss = accelerator.reduce(window_loss, reduction="sum").item() / max(window_tokens, 1)
                logger.log({
                    "step": progress.step,
                    "epoch": round((progress.epoch + progress.step_in_epoch / plan.steps_per_epoch), 4),
                    "loss": loss,
                    "learning_rate": learning_rate,
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "trained_tokens": progress.trained_tokens,
                    "tokens_per_second": window_tokens / elapsed,
                    "samples_per_second": window_examples / elapsed,
                    "peak_memory_mb": round(peak_memory_mb(accelerator.device), 1),
                })
                bar.set_postfix(loss=f"{loss:.4f}")
                window_loss.zero_()
                window_tokens, window_examples, window_start = 0, 0, time.perf_counter()
            if eval_set is not None and recipe.eval_steps and progress.step % recipe.eval_steps == 0 \
                    and progress.step < total_steps:
                logger.log({"step": progress.step, **evaluate(accelerator, model, eval_set, eval_collator, recipe)})
            if recipe.save_steps and progress.step % recipe.save_steps == 0:
                checkpoint.save_checkpoint(accelerator, output_dir, recipe, progress, run_info)
        if progress.step_in_epoch >= plan.steps_per_epoch:
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
    bar.close()

    # --------------------------------------------------------- evaluate & save
    if eval_set is not None:
        metrics = evaluate(accelerator, model, eval_set, eval_collator, recipe)
        logger.log({"step": progress.step, **metrics})
        logger.print(f"hftrain: eval_loss {metrics['eval_loss']:.4f} after {progress.step} steps")
    final_dir = output_dir / "final"
    checkpoint.save_final(accelerator, model, tokenizer, final_dir)
    if accelerator.is_main_process:
        checkpoint.write_run_files(final_dir, recipe, progress, run_info)
    logger.print(f"hftrain: final model saved to {final_dir}")
    logger.close()
    return final_dir


def main(argv: list[str] | None = None) -> None:
    try:
        run(load_recipe(argv))
    except HftrainError as error:
        report_and_exit(error)


if __name__ == "__main__":
    main()
