"""The logging group: where a run writes, how often it logs, evaluates and saves, what it resumes from, which
trackers it reports to, and the rules judged from the recipe alone (`problems`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hftrain.fields import recipe_field as _f

TRACKERS = ("wandb", "tensorboard", "mlflow", "none")


def _cadence(action: str, every: str, none: str, note: str) -> Any:
    """eval_strategy / save_strategy: TrainingArguments' IntervalStrategy values, documented alike."""
    return _f("steps", f"When to {action} (TrainingArguments' name): steps (every {every} when set), epoch (after "
              f"every epoch) or no ({none}). {note}", group="logging", choices=("steps", "epoch", "no"))


@dataclass
class LoggingFields:
    logging_steps: int = _f(10, "Log training metrics every N optimizer steps (and at the first step).",
                            group="logging")
    eval_strategy: str = _cadence("evaluate", "eval_steps", "never; nothing is held out, and eval_steps and "
                                  "eval_dataset_name are not used",
                                  "Any but no also evaluates at the end.")
    eval_steps: int | None = _f(None, "Evaluate every N optimizer steps (eval_strategy steps); always at the end.",
                                group="logging")
    save_strategy: str = _cadence("save checkpoint-N", "save_steps", "no checkpoints; save_steps is not used",
                                  "The final model is saved all the same.")
    save_steps: int | None = _f(None, "Save checkpoint-N every N optimizer steps (save_strategy steps).",
                                group="logging")
    checkpoint_preflight: bool = _f(
        True, "When the run saves periodic checkpoints (save_strategy epoch, or steps with save_steps): before step "
        "1, save a checkpoint of the initial state under the real strategy and process count, load it back, check "
        "that weights and optimizer state are unchanged and that the disk holds another checkpoint of that size, "
        "then delete it and print the save and load times. A run whose checkpoints would not save or load stops "
        "there instead of at its first save.", group="logging",
    )
    async_checkpointing: bool | None = _f(
        None, "Write periodic checkpoints in the background: training waits only while the state is copied to CPU "
        "memory (one more copy of it stays there), at most one save is in flight, and checkpoint-N appears only once "
        "complete. Works with one process, DDP and FSDP2 (sharded state dicts); DeepSpeed and tensor-parallel runs "
        "save synchronously and say why. Preemption, NaN-stop and final saves wait for the one in flight. Unset "
        "(default): on for FSDP2 (each rank stages only its shard), off for one process and DDP (the copy is the "
        "whole model and optimizer state on rank 0, and a local disk's page cache already absorbs the write: "
        "docs/benchmarks.md); set true for slow or network storage.",
        group="logging",
    )
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints (oldest removed first).",
                                      group="logging")
    resume_from_checkpoint: str | None = _f(
        None, "'latest' (newest checkpoint in output_dir) or a checkpoint folder to continue from.", group="logging"
    )
    report_to: list[str] = _f(
        ["none"], "Trackers: wandb, tensorboard, mlflow (needs the mlflow package), or none. metrics.jsonl is "
        "always written.", group="logging"
    )
    project_name: str = _f("hftrain", "Tracker project (W&B project).", group="logging")
    run_name: str | None = _f(None, "Tracker run name; defaults to the output_dir name.", group="logging")


def problems(r) -> list[str]:
    """The trackers and the cadences."""
    problems = []
    bad_trackers = [t for t in r.report_to if t not in TRACKERS]
    if bad_trackers:
        problems.append(f"report_to has unknown tracker(s) {bad_trackers}; use {', '.join(TRACKERS)}")
    if "none" in r.report_to and len(r.report_to) > 1:
        problems.append("report_to mixes 'none' with trackers")
    if r.logging_steps < 1:
        problems.append(f"logging_steps must be >= 1, got {r.logging_steps}")
    for kind in ("eval", "save"):  # `no` turns the cadence off whatever its steps say (config.unused_settings)
        strategy, steps = getattr(r, f"{kind}_strategy"), getattr(r, f"{kind}_steps")
        if steps is not None and strategy == "epoch":
            problems.append(f"{kind}_steps={steps} applies to {kind}_strategy=steps, but {kind}_strategy=epoch; "
                            f"remove {kind}_steps (on the command line: --{kind}_steps null) or set "
                            f"{kind}_strategy: steps")
    for name in ("eval_steps", "save_steps", "save_total_limit"):
        value = getattr(r, name)
        if value is not None and value < 1:
            problems.append(f"{name} must be >= 1 or unset, got {value}")
    return problems
