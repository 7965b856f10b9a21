"""Checkpoints: `output_dir/checkpoint-N` (state after N optimizer steps) and the final model.

A checkpoint holds `accelerator.save_state` (model, optimizer, scheduler, RNG states) plus
`hftrain_state.json` (progress, world size, versions) and `hftrain_config.yaml` (the resolved
recipe). It is written to a temporary folder and renamed when every rank has finished, so a
`checkpoint-N` folder is always complete. Its model file holds the trained parameters (and
buffers) only: frozen weights (a LoRA/QLoRA base, possibly quantized) are rebuilt from the base
model by the builder on resume, so an adapter run's checkpoint is adapter-sized. For full
fine-tuning that is every weight.

The final folder is what the builder's product saves: `save_pretrained` of the causal LM
(safetensors + config) or, for a peft model, of the adapter only (`adapter_model.safetensors` +
`adapter_config.json`); both from the gathered state dict, so sharded runs save complete weights.
"""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from hftrain.config import Recipe, dump_recipe
from hftrain.errors import HftrainError

STATE_FILE = "hftrain_state.json"
CONFIG_FILE = "hftrain_config.yaml"
PREFIX = "checkpoint-"


@dataclass
class Progress:
    """Where training stands after `step` optimizer steps."""

    step: int = 0
    epoch: int = 0  # epoch the next step belongs to
    step_in_epoch: int = 0  # optimizer steps of that epoch already done
    trained_tokens: int = 0  # global count of trained (label != -100) tokens so far
    world_size: int = 1


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {"python": platform.python_version()}
    for package in ("hftrain", "torch", "transformers", "accelerate", "datasets", "tokenizers", "peft",
                    "bitsandbytes", "deepspeed", "wandb"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    return found


def write_run_files(folder: Path, recipe: Recipe, progress: Progress, extra: dict | None = None) -> None:
    dump_recipe(recipe, folder / CONFIG_FILE)
    state = {"progress": asdict(progress), "versions": versions(), **(extra or {})}
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in output_dir.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit() and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save_checkpoint(accelerator, output_dir: Path, recipe: Recipe, progress: Progress, extra: dict) -> Path:
    """Save the full training state after `progress.step` steps; every rank must call this."""
    final = output_dir / f"{PREFIX}{progress.step}"
    tmp = output_dir / f".tmp-{PREFIX}{progress.step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    handle = accelerator.register_save_state_pre_hook(_keep_trained_weights)
    try:
        accelerator.save_state(str(tmp))
    finally:
        handle.remove()
    if accelerator.is_main_process:
        write_run_files(tmp, recipe, progress, extra)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if recipe.save_total_limit is not None:
            for old in checkpoints(output_dir)[: -recipe.save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def clear_run(output_dir: Path) -> None:
    """Remove a previous run's checkpoints, final model and metrics (overwrite_output_dir)."""
    for old in [*output_dir.glob(f"{PREFIX}*"), *output_dir.glob(f".tmp-{PREFIX}*"), output_dir / "final"]:
        shutil.rmtree(old, ignore_errors=True)
    (output_dir / "metrics.jsonl").unlink(missing_ok=True)


def resolve_resume(recipe: Recipe) -> Path | None:
    """The checkpoint folder to resume from, or None to start fresh."""
    if recipe.resume_from_checkpoint is None:
        return None
    if recipe.resume_from_checkpoint == "latest":
        found = checkpoints(Path(recipe.output_dir))
        if not found:
            raise HftrainError(f"resume_from_checkpoint=latest but {recipe.output_dir!r} holds no complete checkpoint; "
                               "drop resume_from_checkpoint to start fresh")
        return found[-1]
    path = Path(recipe.resume_from_checkpoint)
    if not (path / STATE_FILE).exists():
        raise HftrainError(f"resume_from_checkpoint {str(path)!r} has no {STATE_FILE}; it is not a complete "
                           "hftrain checkpoint")
    return path


def _trained_names(model) -> set[str]:
    """State-dict keys of trainable parameters (tied aliases included) and buffers."""
    return ({n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
            | {n for n, _ in model.named_buffers(remove_duplicate=False)})


def _keep_trained_weights(models, weights, output_dir) -> None:
    """save_state pre-hook: drop frozen weights (and bitsandbytes quantization state) from the model files.

    `weights` is empty for FSDP and DeepSpeed, which save their own (sharded) files.
    """
    for model, state_dict in zip(models, weights, strict=False):  # no weights under FSDP / DeepSpeed
        keep = _trained_names(model)
        for key in [k for k in state_dict if k not in keep]:
            del state_dict[key]


def _check_saved_weights(model, path: Path) -> None:
    """The checkpoint's model file must hold exactly what this run trains (frozen weights come from the base)."""
    from safetensors import safe_open

    model_file = path / "model.safetensors"
    if not model_file.exists():  # FSDP / DeepSpeed layouts are checked by their own loaders
        return
    with safe_open(str(model_file), framework="pt") as f:
        saved = set(f.keys())
    keys = set(model.state_dict())
    missing = sorted((_trained_names(model) & keys) - saved)
    unknown = sorted(saved - keys)
    unwrapped = {k.removeprefix("module.") for k in saved}
    if (missing or unknown) and unwrapped == {k.removeprefix("module.") for k in _trained_names(model) & keys}:
        raise HftrainError(
            f"checkpoint {str(path)!r} was saved by a run with another process layout (DDP-wrapped weight names "
            "differ from this launch's); accelerate cannot load it across that change: resume with the launch "
            "preset it was made with"
        )
    if missing or unknown:
        raise HftrainError(
            f"checkpoint {str(path)!r} does not match this run's trained weights ({len(missing)} missing, e.g. "
            f"{missing[:2]}; {len(unknown)} unknown, e.g. {unknown[:2]}); it was made with another model or "
            "fine-tuning method (use_peft, lora_*, load_in_*): resume with the recipe it was made with"
        )


def load_checkpoint(accelerator, model, path: Path) -> tuple[Progress, dict]:
    """Restore the prepared `model`, optimizer, scheduler and RNG from `path`; returns its progress and extra state."""
    from accelerate.utils import DistributedType

    _check_saved_weights(model, path)
    # The model file holds the trained weights only (see _keep_trained_weights), hence strict=False; its keys were
    # just checked. DeepSpeed loads its own files and takes no `strict`.
    non_strict = {} if accelerator.distributed_type == DistributedType.DEEPSPEED else {"strict": False}
    accelerator.load_state(str(path), **non_strict)
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    return Progress(**state["progress"]), {k: v for k, v in state.items() if k not in ("progress", "versions")}


def save_final(accelerator, model, tokenizer, folder: Path) -> None:
    """A standard folder from the wrapped model, + tokenizer: `AutoModelForCausalLM.from_pretrained` loads a full
    fine-tune, `PeftModel.from_pretrained(base, folder)` an adapter (peft's save_pretrained keeps only the adapter
    weights of the state dict it is given)."""
    state_dict = accelerator.get_state_dict(model)  # full (gathered) weights on the main process
    lm = accelerator.unwrap_model(model).lm
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("lm."): v for k, v in state_dict.items()}
        lm.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    accelerator.wait_for_everyone()
