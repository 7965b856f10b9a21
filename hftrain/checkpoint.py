"""Checkpoints: `output_dir/checkpoint-N` (state after N optimizer steps) and the final model.

A checkpoint holds `accelerator.save_state` (model, optimizer, RNG states) plus
`hftrain_state.json` (progress, learning-rate scheduler state, world size, versions) and
`hftrain_config.yaml` (the resolved recipe). Nothing in it needs unpickling arbitrary objects to
resume: weights are safetensors, optimizer and RNG states are read weights-only (tensors and plain
values), the scheduler state is JSON (DeepSpeed's own files are the exception: its engine loads them).

Crash safety: everything is written to `.tmp-checkpoint-N`, fsynced, then a manifest of every file and its
size (`hftrain_complete.json`, the completion marker) is written last, and the folder is renamed. With
`async_checkpointing` (`BackgroundSaves`) the loop waits only while the state is copied to CPU memory; the copy is
written, sealed and renamed by a background thread, at most one save is in flight (the next save, a preemption, the
end of training and the checkpoint preflight wait for it), so `checkpoint-N` appears only once complete. Only folders
with a manifest count as checkpoints; on resume the manifest is checked and a damaged newest checkpoint falls
back to the previous complete one, with a warning. Its model file holds the trained parameters (and buffers)
only: frozen weights (a LoRA/QLoRA base, possibly quantized) are rebuilt from the base model by the builder on
resume, so an adapter run's checkpoint is adapter-sized. For full fine-tuning that is every weight. How each
layout writes and reads its files is its backend's checkpoint component (`backend.checkpoints`,
hftrain/parallel/checkpoint_io.py): under DeepSpeed the engine writes the model file itself, without frozen
parameters; FSDP2 writes sharded DCP files of the whole model. Every file name a checkpoint holds is defined here.

The final folder is what the builder's product saves: `save_pretrained` of the causal LM
(safetensors + config) or, for a peft model, of the adapter only (`adapter_model.safetensors` +
`adapter_config.json`); both from the gathered state dict, so sharded runs save complete weights.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from hftrain.config import Recipe
from hftrain.errors import HftrainError, first_line
from hftrain.paths import (
    COMPLETE_FILE,
    COMPLETIONS_FILE,
    CONFIG_FILE,
    DS_CONFIG_FILE,
    FINAL_DIR,
    HUB_UPLOAD_DIR,
    METRICS_FILE,
    PREFIX,
    PREFLIGHT_DIR,
    PROFILE_DIR,
    REFERENCE_FILE,
    REPORT_DIR,
    STATE_FILE,
    STREAM_STATE,
    TMP_PREFIX,
    UNIVERSAL_PREFIX,
    complete_checkpoints,
    holds_a_run,
)
from hftrain.ties import check_ties, tied_groups


@dataclass
class Progress:
    """Where training stands after `step` optimizer steps."""

    step: int = 0
    # map-style: the epoch the next step belongs to (int); a stream (one endless epoch): its passes so far as the log
    # counts them (StreamFeed.recorded_progress: completed passes + the part of the current one drawn, a float, as
    # Trainer's trainer_state.json `epoch`)
    epoch: int | float = 0
    step_in_epoch: int = 0  # optimizer steps of that epoch already done (a stream: every step of the run)
    trained_tokens: int = 0  # global count of trained (label != -100) tokens so far
    world_size: int = 1
    nan_skipped_steps: int = 0  # steps without an update because the gradient norm was NaN/inf


def versions() -> dict[str, str]:
    """The versions this run used. torch's is the build's own (`torch.__version__`: 2.14.1+cu130, 2.13.0+cpu), which
    names the CUDA or CPU build that its package metadata leaves out for PyPI's default CUDA wheel (2.14.1)."""
    found = {"python": platform.python_version()}
    for package in ("hftrain", "torch", "torchvision", "transformers", "accelerate", "datasets", "tokenizers", "peft",
                    "bitsandbytes", "deepspeed", "wandb"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    found["torch"] = torch.__version__
    return found


def write_run_files(folder: Path, recipe: Recipe, progress: Progress, run_info: dict) -> None:
    """The resolved recipe, progress + versions + run facts, and the DeepSpeed config used (if any)."""
    recipe.dump(folder / CONFIG_FILE)
    state = {"progress": asdict(progress), "versions": versions(), **run_info}
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    if run_info["launch"]["deepspeed_config"] is not None:
        (folder / DS_CONFIG_FILE).write_text(json.dumps(run_info["launch"]["deepspeed_config"], indent=2)
                                                      + "\n", encoding="utf-8")


def never_world_writable() -> None:
    """Files and folders this process creates are never writable by other users, whatever umask it started
    with (checkpoints are loaded back, DeepSpeed's with pickle). Group permissions stay as the umask sets
    them: shared project folders often rely on group write."""
    os.umask(os.umask(0o022) | 0o002)


def checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints whose completion marker exists, oldest first."""
    return complete_checkpoints(output_dir)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(folder: Path) -> None:
    """fsync every file, then write the manifest (file -> size) as the completion marker, fsynced too."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        _fsync(path)
    manifest = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    (folder / COMPLETE_FILE).write_text(json.dumps({"files": manifest}, indent=1) + "\n", encoding="utf-8")
    _fsync(folder / COMPLETE_FILE)
    _fsync(folder)


def verify(folder: Path) -> list[str]:
    """What is wrong with a checkpoint folder: no marker, missing or truncated files ([] when intact)."""
    marker = folder / COMPLETE_FILE
    if not marker.exists():
        return [f"{folder} has no {COMPLETE_FILE} (it was never completed)"]
    try:
        manifest = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError):
        return [f"{marker} is unreadable"]
    problems = []
    for name, size in manifest.items():
        path = folder / name
        if not path.exists():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, {size} were written")
    return problems


class BackgroundSaves:
    """async_checkpointing: checkpoints written by a background thread, at most one at a time.

    `stage(folder)` runs on every rank while the loop waits: the backend writes the small files (RNG states), copies
    the model and optimizer state to CPU memory with torch.distributed.checkpoint's `DefaultStager` (pinned on a GPU;
    its buffers are reused by the next save) and returns the function that writes that copy. `submit` hands it to the
    thread; `wait` (every rank, at the same points) blocks until it is done and raises on every rank if any rank's
    write failed. Layouts that cannot save in the background (`backend.checkpoints.synchronous()`) get None from
    `stage` and save synchronously.
    """

    def __init__(self, backend, model, optimizer, requested: bool | None):
        """`requested`: the recipe's async_checkpointing; None takes the backend's default."""
        self.backend, self.model, self.optimizer = backend, model, optimizer
        wanted = backend.checkpoints.async_by_default if requested is None else requested
        self.enabled = wanted and backend.checkpoints.synchronous() is None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hftrain-checkpoint") if self.enabled \
            else None
        self.stager: DefaultStager | None = None
        self.pending: tuple[Path, Future] | None = None

    def stage(self, folder: Path) -> Callable[[], None] | None:
        """Write what is small and copy the rest to CPU memory now; return the writer of the copy (None: save
        synchronously)."""
        if not self.enabled:
            return None
        if self.stager is None:
            cuda = self.backend.accelerator.device.type == "cuda"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=cuda))
        return self.backend.checkpoints.background_save(self.model, self.optimizer, folder, self.stager)

    def submit(self, folder: Path, finish: Callable[[], None]) -> None:
        self.pending = (folder, self.executor.submit(finish))

    def wait(self) -> None:
        """Block until the save in flight is written and sealed; every rank calls this at the same points."""
        if self.pending is None:
            return
        (folder, future), self.pending = self.pending, None
        try:
            future.result()
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not only the one that failed
            error = exc
        accelerator = self.backend.accelerator
        failed = accelerator.reduce(torch.tensor(float(error is not None), device=accelerator.device), reduction="sum")
        if failed.item():
            cause = first_line(error) if error is not None else "on another rank"
            raise HftrainError(f"writing checkpoint {folder} in the background failed ({cause}); it was not completed "
                               "and the previous checkpoint is intact (async_checkpointing: false saves in the "
                               "training loop)") from error


def save_checkpoint(backend, output_dir: Path, recipe: Recipe, progress: Progress, extra: dict,
                    tensors: dict | None = None, saves: BackgroundSaves | None = None,
                    background: bool = False, data_state: dict | None = None) -> Path:
    """Save the full training state after `progress.step` steps; every rank must call this. `tensors`: run data
    that a resume needs besides the training state (precomputed reference log-probs), in REFERENCE_FILE.
    `data_state`: this process's position in a streamed training set (JSON), in STREAM_STATE, written before the
    manifest so that it is part of the checkpoint.

    `saves`: the run's background saves; the one in flight is waited for first. With `background`, the state is
    staged and the returned folder appears when the background write has finished (`saves.wait()`)."""
    accelerator = backend.accelerator
    final = output_dir / f"{PREFIX}{progress.step}"
    tmp = output_dir / f"{TMP_PREFIX}{PREFIX}{progress.step}"
    if saves is not None:
        saves.wait()  # at most one save in flight: its staging buffers are about to be reused
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    write = saves.stage(tmp) if saves is not None and background else None
    if write is None:
        handle = accelerator.register_save_state_pre_hook(keep_trained_weights)
        try:
            accelerator.save_state(str(tmp), **backend.checkpoints.save_kwargs())
        finally:
            handle.remove()
    if data_state is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / STREAM_STATE.format(index=accelerator.process_index)
        path.write_text(json.dumps(data_state), encoding="utf-8")
    accelerator.wait_for_everyone()  # every rank's files are written (or staged) before the manifest is made
    if accelerator.is_main_process:
        write_run_files(tmp, recipe, progress, extra)
        if tensors:
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / REFERENCE_FILE))

    def finish() -> None:
        if write is not None:
            write()  # the main process's write returns once every rank's files are written (see background_save)
        if accelerator.is_main_process:
            _complete(tmp, final, recipe.save_total_limit)

    if write is None:
        finish()
        accelerator.wait_for_everyone()
    else:
        saves.submit(final, finish)
    return final


def _complete(tmp: Path, final: Path, save_total_limit: int | None) -> None:
    """Seal `tmp` with its manifest, rename it to `final`, then drop the oldest checkpoints beyond the limit."""
    _seal(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(final.parent)
    if save_total_limit is not None:
        for old in checkpoints(final.parent)[: -save_total_limit]:  # the newest complete one stays
            shutil.rmtree(old)


def load_run_tensors(folder: Path) -> dict | None:
    """The run tensors a checkpoint saved with `save_checkpoint(..., tensors=...)`, or None."""
    path = folder / REFERENCE_FILE
    return load_file(str(path)) if path.exists() else None


def clear_run(output_dir: Path) -> None:
    """Remove a previous run's checkpoints, final model, metrics, completions, profiler traces and report
    (overwrite_output_dir)."""
    for old in [*output_dir.glob(f"{PREFIX}*"), *output_dir.glob(f"{TMP_PREFIX}{PREFIX}*"),
                output_dir / f"{TMP_PREFIX}{FINAL_DIR}", *output_dir.glob(f"{UNIVERSAL_PREFIX}{PREFIX}*"),
                output_dir / FINAL_DIR, output_dir / PROFILE_DIR, output_dir / REPORT_DIR, output_dir / PREFLIGHT_DIR,
                output_dir / HUB_UPLOAD_DIR, output_dir / f"{TMP_PREFIX}{HUB_UPLOAD_DIR}"]:
        shutil.rmtree(old, ignore_errors=True)
    (output_dir / METRICS_FILE).unlink(missing_ok=True)
    (output_dir / COMPLETIONS_FILE).unlink(missing_ok=True)


def newest_intact(output_dir: Path, warn: bool = False) -> Path | None:
    """The newest checkpoint in `output_dir` that passes `verify` (what `resume_from_checkpoint: latest` resumes), or
    None; with `warn`, a warning about each damaged newer one."""
    for candidate in reversed(checkpoints(output_dir)):
        problems = verify(candidate)
        if not problems:
            return candidate
        if warn:
            warnings.warn(f"hftrain: skipping damaged checkpoint {candidate}: {'; '.join(problems)}", stacklevel=3)
    return None


def resolve_resume(recipe: Recipe) -> Path | None:
    """The checkpoint folder to resume from, or None to start fresh.

    `latest` takes the newest checkpoint that passes `verify`, warning about each damaged newer one.
    """
    if recipe.resume_from_checkpoint is None:
        return None
    if recipe.resume_from_checkpoint == "latest":
        if (newest := newest_intact(Path(recipe.output_dir), warn=True)) is not None:
            return newest
        out = Path(recipe.output_dir)
        # a folder that holds a run (a final model, checkpoints never completed) refuses a fresh start without
        # overwrite_output_dir (config.check_output_dir): dropping resume_from_checkpoint alone would lead there
        fresh = ("drop resume_from_checkpoint and set overwrite_output_dir=true to start over in it (its files are "
                 "replaced), or pick another output_dir" if holds_a_run(out) else
                 "drop resume_from_checkpoint to start fresh")
        raise HftrainError(f"resume_from_checkpoint=latest but {recipe.output_dir!r} holds no complete, intact "
                           f"checkpoint; {fresh}")
    path = Path(recipe.resume_from_checkpoint)
    problems = verify(path)
    if problems:
        raise HftrainError(f"resume_from_checkpoint {str(path)!r} is not a complete hftrain checkpoint: "
                           f"{'; '.join(problems)}")
    return path


def trained_names(model) -> set[str]:
    """State-dict keys of trainable parameters (tied aliases included) and buffers."""
    return ({n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
            | {n for n, _ in model.named_buffers(remove_duplicate=False)})










def keep_trained_weights(models, weights, output_dir) -> None:
    """save_state pre-hook: drop frozen weights (and bitsandbytes quantization state) from the model files.

    `weights` is empty for FSDP and DeepSpeed, which save their own (sharded) files.
    """
    for model, state_dict in zip(models, weights, strict=False):  # no weights under FSDP / DeepSpeed
        keep = trained_names(model)
        for key in [k for k in state_dict if k not in keep]:
            del state_dict[key]




def _check_saved_weights(backend, model, path: Path) -> None:
    """The checkpoint's model file must hold what this run trains (frozen weights come from the base).

    `model` is the unwrapped model: accelerate saves (and loads) DDP weights without the `module.` prefix,
    which is what lets a checkpoint resume on another number of processes."""
    saved = backend.checkpoints.saved_model_keys(path)
    if saved is None:  # FSDP2's sharded layout is checked by its own loader
        return
    keys = set(model.state_dict())
    # a tied tensor is saved once, under one of its names: the others count as saved with it
    saved_with_aliases = saved.union(*(group for group in tied_groups(model) if group & saved))
    missing = sorted((trained_names(model) & keys) - saved_with_aliases)
    unknown = sorted(saved - keys)
    if missing or unknown:
        raise HftrainError(
            f"checkpoint {str(path)!r} does not match this run's trained weights ({len(missing)} missing, e.g. "
            f"{missing[:2]}; {len(unknown)} unknown, e.g. {unknown[:2]}); it was made with another model or "
            "fine-tuning method (use_peft, lora_*, load_in_*): resume with the recipe it was made with"
        )


def _check_optimizer_groups(scheduler, saved: dict, path: Path) -> None:
    """The checkpoint's optimizer must have this run's parameter groups (the schedule's state holds one learning
    rate per group): the libraries' loaders fail deep inside on another count."""
    saved_groups, groups = len(saved["base_lrs"]), len(scheduler.base_lrs)
    if saved_groups != groups:
        raise HftrainError(
            f"checkpoint {str(path)!r} holds an optimizer of {saved_groups} parameter group(s) and this run builds "
            f"{groups} (the weight-decayed matrices apart from the biases and norm weights). A DeepSpeed ZeRO-3 "
            "checkpoint of an earlier hftrain, which judged ZeRO-3's partitioned parameters by their local 1-D shape, "
            "holds every parameter in one undecayed group (its run applied no weight decay) and cannot continue: "
            "start the run again; otherwise resume with the recipe (optim, model, use_peft) it was made with"
        )


def load_checkpoint(backend, model, scheduler, path: Path, plan) -> tuple[Progress, dict]:
    """Restore model/optimizer/scheduler/RNG from `path`; return where training stands for this run and the
    checkpoint's other run facts (tracker run ids, device-hours so far).

    A checkpoint can resume with another number of processes (DDP, FSDP2, tensor parallel; DeepSpeed ZeRO through
    a universal checkpoint converted on the fly, AdamW only, see `DeepSpeedCheckpoints.resume_folder`). The data
    position is kept in examples of the epoch's order, which does not depend on the world size: if the effective batch
    changed, training continues at the last step boundary of the new batch at or before that position (at most
    one new global batch minus one example is seen again). RNG states are restored per rank index; a rank without
    a saved state (1 -> 2 processes) keeps the state from `seed`. Data order never uses them (BatchPlan is seeded
    by seed and epoch): they only matter for dropout.
    """
    accelerator = backend.accelerator
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    backend.checkpoints.check_resumable(state["launch"])
    _check_optimizer_groups(scheduler, state["scheduler"], path)
    _check_saved_weights(backend, backend.unwrap(model), path)  # saved names carry no DDP `module.` prefix
    # The model file holds the trained weights only, hence a non-strict load; its keys were just checked.
    with backend.checkpoints.resume_folder(model, path, state["launch"]) as folder:  # ZeRO: maybe converted
        accelerator.load_state(str(folder), **backend.checkpoints.load_kwargs())
    check_ties(backend.unwrap(model), f"loading checkpoint {str(path)!r}")  # aliases come back through one name
    scheduler.load_state_dict(state["scheduler"])
    progress = realign(Progress(**state["progress"]), state["effective_batch_size"], plan)
    # load_state also restores accelerate's micro-batch counter, which decides when gradients sync. Saved by
    # a run with another accumulation it would misalign every step (sync after 1 of 2 micro-batches): set it
    # from this run's layout, in which every optimizer step is exactly `accum` micro-batches.
    accelerator.step = progress.step * plan.accum
    return progress, {k: v for k, v in state.items() if k not in ("progress", "versions", "scheduler")}


def _checksums(tensors) -> torch.Tensor:
    """(sum, sum of squares, elements) of each tensor (a DTensor's local shard), in float64: equal tensors give equal
    rows."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    rows = [torch.stack([t.double().sum(), t.double().square().sum(), torch.tensor(float(t.numel()),
                         dtype=torch.float64, device=t.device)]) for t in local]
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 3, dtype=torch.float64)


def _optimizer_checksums(optimizer) -> torch.Tensor:
    """Checksums of the optimizer state's non-zero tensors (a state created as zeros holds nothing yet)."""
    state = getattr(optimizer, "state", {}) or {}
    rows = _checksums([v for per_param in state.values() if isinstance(per_param, dict) for v in per_param.values()
                       if isinstance(v, torch.Tensor) and v.numel()])
    return rows[rows[:, 1] != 0]


def round_trip(backend, model, optimizer, scheduler, output_dir: Path, recipe: Recipe, progress: Progress,
               run_info: dict, plan, tensors: dict | None = None, saves: BackgroundSaves | None = None) -> dict:
    """checkpoint_preflight: save the current state as a checkpoint under output_dir/.tmp-preflight with the run's
    strategy and process count (through `saves`, in the background and waited for, where the run saves so), change
    every trained weight this process holds, load the checkpoint back, and check that the weights and the optimizer
    state are what they were; then check that the disk holds another checkpoint of the measured size, and remove the
    probe. Raises HftrainError naming what failed; returns {save_seconds, load_seconds, megabytes}."""
    accelerator = backend.accelerator
    probe = output_dir / PREFLIGHT_DIR
    trained = backend.local_trained_tensors(model)
    before = (_checksums(trained), _optimizer_checksums(optimizer))
    try:
        started = time.perf_counter()
        saved = save_checkpoint(backend, probe, recipe, progress, run_info, tensors, saves, background=True)
        if saves is not None:
            saves.wait()
        saved_at = time.perf_counter()
        with torch.no_grad():
            for t in trained:  # a load that restores nothing must not pass
                t.add_(1.0)
        load_checkpoint(backend, model, scheduler, saved, plan)
        loaded_at = time.perf_counter()
    except Exception as exc:
        if accelerator.is_main_process:
            shutil.rmtree(probe, ignore_errors=True)
        if isinstance(exc, HftrainError):
            raise HftrainError(f"checkpoint preflight: {exc}") from exc
        raise HftrainError(f"checkpoint preflight: saving or loading a checkpoint of the initial state under "
                           f"{probe} failed ({first_line(exc)}); "
                           "the run would fail the same way at its first save. Nothing was trained") from exc
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper around the torch optimizer
    if not len(before[1]) and isinstance(inner, torch.optim.Optimizer):
        # Before the first step the state is empty, and stays empty in the checkpoint; but torch.distributed's
        # optimizer state dict (FSDP2's save and load) first creates it by a zero-gradient step, leaving step=1:
        # AdamW's first update would then be bias-corrected as its second. A fresh run starts from no state.
        inner.state.clear()
    after = (_checksums(backend.local_trained_tensors(model)), _optimizer_checksums(optimizer))
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) if accelerator.is_main_process else 0
    free = shutil.disk_usage(output_dir).free
    # one collective: [ranks whose state came back unchanged, ranks that see room for another checkpoint]
    votes = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(before, after))), float(free >= size)],
                         device=accelerator.device)
    same, room = (int(v) == accelerator.num_processes for v in accelerator.reduce(votes, reduction="sum").tolist())
    if accelerator.is_main_process:
        shutil.rmtree(probe, ignore_errors=True)
    accelerator.wait_for_everyone()
    if not same:
        raise HftrainError("checkpoint preflight: a checkpoint of the initial state loaded back with other weights or "
                           "optimizer state than were saved; the run's checkpoints would not resume it. Nothing was "
                           "trained")
    if not room:
        raise HftrainError(f"checkpoint preflight: a checkpoint of this run takes {size / 2**20:,.0f} MiB and "
                           f"{output_dir} has {free / 2**20:,.0f} MiB free; free disk space or set output_dir "
                           "elsewhere. Nothing was trained")
    return {"save_seconds": saved_at - started, "load_seconds": loaded_at - saved_at, "megabytes": size / 2**20}


def realign(progress: Progress, saved_global_batch: int, plan) -> Progress:
    """`progress` of a run with `saved_global_batch`, expressed for this run's BatchPlan.

    Steps (and the schedule) continue from `progress.step`; the position in the epoch is kept in examples,
    rounded down to a whole step of the new global batch (a finished epoch stays finished).
    """
    examples_done = progress.step_in_epoch * saved_global_batch
    step_in_epoch = plan.steps_per_epoch if examples_done >= plan.num_examples else examples_done // plan.global_batch
    return replace(progress, step_in_epoch=step_in_epoch, world_size=plan.world)


def save_final(backend, model, tokenizer, folder: Path, recipe: Recipe, progress: Progress, run_info: dict,
               describe: Callable[[Path], object] | None = None) -> None:
    """A standard folder from the wrapped model, + tokenizer and run files: `AutoModelForCausalLM.from_pretrained`
    loads a full fine-tune, `PeftModel.from_pretrained(base, folder)` an adapter (peft's save_pretrained keeps only
    the adapter weights of the state dict it is given). Written to `.tmp-final` and renamed when complete: a save that
    fails midway leaves no `final/` that looks valid. `describe(tmp)`: the main process adds the model card before
    the rename (it replaces peft's empty template)."""
    accelerator = backend.accelerator
    tmp = folder.with_name(f"{TMP_PREFIX}{folder.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    backend.checkpoints.save_pretrained(model, tmp)  # gathered from DDP / FSDP2 / ZeRO-3 / TP shards
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp)
        write_run_files(tmp, recipe, progress, run_info)
        if describe is not None:
            describe(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        _fsync(folder.parent)
    accelerator.wait_for_everyone()
