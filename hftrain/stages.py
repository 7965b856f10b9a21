"""Pipeline parallelism's parts that need no process group: how the layers split into stages, which process runs
which stage, and how a pipeline checkpoint maps to and from the files of a run without pp.

A pp checkpoint is a DCP folder keyed by HF names ("model": {name: tensor}; "optimizer": torch's flattened optimizer
state, "state.<name>.<key>" and "param_groups.<name>.<key>"); a checkpoint without pp is accelerate's files
(model.safetensors by name, optimizer.bin numbered by torch: parameter k of the optimizer's groups in order). The
numbering is that of `build_optimizer` over the whole model, which both conversions rebuild (`optimizer_layout`).
Used by `hftrain.parallel.pipeline` (the backend), `hftrain.parallel.checkpoint_io` (a pp checkpoint resumed
without pp, and one without pp resumed with pp) and `hftrain.estimate` (memory per stage).
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from accelerate.utils.constants import OPTIMIZER_NAME
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hftrain.checkpoint import trained_names
from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.optim import build_optimizer
from hftrain.paths import FULL_STATE_FILE, MODEL_FILE, PIPELINE_CONVERTED_PREFIX
from hftrain.ties import held_ties

STAGES_PER_PROCESS = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}
PIPELINE_STATE_DIR = "pipeline_state"  # the checkpoint's DCP folder: model and optimizer state under HF names


def split_layers(layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, balanced with the embedding (first stage) and the head (last stage)
    each counted as one layer; every stage gets at least one layer and every layer exactly one stage."""
    if layers < stages:
        raise HftrainError(f"{layers} layers cannot fill {stages} pipeline stages")
    units = layers + 2  # [embedding, layer 0 .. layer L-1, head]
    bounds = [round(k * units / stages) for k in range(stages + 1)]
    ranges = [range(max(lo - 1, 0), min(hi - 1, layers)) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    if any(len(r) == 0 for r in ranges):  # few layers per stage: even split, the remainder to the middle stages
        base, extra = divmod(layers, stages)
        sizes = [base + (1 if 0 < k <= extra else 0) for k in range(stages)]
        if sum(sizes) < layers:
            sizes[0] += layers - sum(sizes)
        starts = [sum(sizes[:k]) for k in range(stages)]
        ranges = [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]
    owners = [k for k, r in enumerate(ranges) for _ in r]
    assert owners == sorted(owners) and len(owners) == layers and all(len(r) for r in ranges), \
        f"pipeline split lost or repeated a layer: {ranges}"
    return ranges


def stage_indices(rank: int, pp: int, per_process: int, v: bool = False) -> list[int]:
    """The stages of pipeline rank `rank`: torch's loop placement (stage s on rank s % pp), or with `v` its V
    placement for ZBVZeroBubble / DualPipeV (rank r holds stages r and 2 pp - 1 - r: down the ranks and back)."""
    if v:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_process)]


def stage_layout(num_layers: int, pp: int, schedule: str, rank: int) -> tuple[list[range], list[int]]:
    """(each stage's decoder layers, the stages pipeline rank `rank` runs) for `pp` ranks under torch's `schedule`."""
    per_process = STAGES_PER_PROCESS[schedule]
    return split_layers(num_layers, pp * per_process), stage_indices(rank, pp, per_process, v=schedule in V_SCHEDULES)


# ------------------------------------------------------ resume across layouts
def resume_layout_problem(saved_launch: dict, pp_size: int, sharded_by: str | None) -> str | None:
    """Why a checkpoint with launch record `saved_launch` cannot resume in a run with `pp_size` whose model is sharded
    by `sharded_by` ("FSDP2", "DeepSpeed", None), as far as pipelines go; None if it can. A pp checkpoint (DCP under
    HF names, also one of pp x FSDP2) resumes under any pp layout (with FSDP2 per stage too), on one process and under
    DDP; a pp run reads pp checkpoints and those of one process or DDP. The sharded files of FSDP2 without pp, ZeRO
    and tensor parallelism are not converted (checked at resume, and in the preflight for a named checkpoint
    folder)."""
    saved_pp = saved_launch.get("pp_size", 1)  # checkpoints older than pp carry no pp_size
    if saved_pp > 1 and sharded_by and pp_size <= 1:
        return (f"this checkpoint was written with pp_size={saved_pp} and this run shards the model with "
                f"{sharded_by}; a pipeline checkpoint resumes under pp (any pp_size), on one process or under DDP: "
                "resume with one of those (docs/pipeline.md)")
    if pp_size > 1 and saved_pp <= 1:
        other = ("tensor parallelism" if saved_launch["tp_size"] > 1 else
                 "DeepSpeed" if saved_launch["deepspeed_config"] is not None else
                 "FSDP2" if saved_launch["sharded_modules"] else None)
        if other:
            return (f"this checkpoint was written with {other} and this run has pp_size={pp_size}; a pipeline run "
                    "resumes pp checkpoints and those of one process or DDP only: resume with the layout that wrote "
                    "it (docs/pipeline.md)")
    return None


def optimizer_layout(recipe: Recipe, model: nn.Module) -> tuple[list[list[str]], dict[str, int]]:
    """For the optimizer hftrain builds over the whole `model` without pp (`build_optimizer`): the parameter names of
    each group in order (one name per tensor, a tied pair under its first name), and the number torch's state dict
    gives each trained parameter name (both names of a tied pair: one number)."""
    groups = build_optimizer(recipe, model).param_groups  # no state is allocated before the first step
    number = {id(p): k for k, p in enumerate(p for group in groups for p in group["params"])}
    first_name = {id(p): name for name, p in model.named_parameters()}
    names = [[first_name[id(p)] for p in group["params"]] for group in groups]
    ids = {name: number[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in number}
    return names, ids


def _by_name(flat: dict, section: str) -> dict[str, dict]:
    """torch's flattened optimizer entries of one section ("state" / "param_groups") as {name: {key: value}} (AdamW's
    and SGD's per-parameter values are not nested)."""
    out: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith(f"{section}."):
            name, _, field = key[len(section) + 1:].rpartition(".")
            out.setdefault(name, {})[field] = value
    return out


def write_unpipelined(path: Path, folder: Path, module: nn.Module, recipe: Recipe) -> None:
    """Checkpoint `path` written under pp, as the files one process (or DDP) reads, in `folder`: model.safetensors
    (each trained tensor once, under the names `module`'s state dict has; a tied pair under one name) and optimizer.bin
    numbered as `build_optimizer` numbers `module`'s parameters, beside links to the checkpoint's other files (RNG
    states, run files)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    whole = folder / "pipeline_state.pt"
    dcp_to_torch_save(path / PIPELINE_STATE_DIR, whole)  # every stage's state, read on this process
    saved = torch.load(whole, weights_only=True)
    whole.unlink()
    flat = saved["optimizer"]
    _write_by_name(path, folder, module, recipe, saved["model"], _by_name(flat, "param_groups"),
                   _by_name(flat, "state"), PIPELINE_STATE_DIR, "pipeline state")


def _write_by_name(path: Path, folder: Path, module: nn.Module, recipe: Recipe, weights: dict[str, torch.Tensor],
                   hyper: dict[str, dict], state: dict[str, dict], converted: str, what: str) -> None:
    """`folder`'s files of a run without pp from a checkpoint's state by HF name (`weights`, each parameter's
    optimizer `hyper`parameters and `state`): model.safetensors (each trained tensor once, under the names `module`'s
    state dict has; a tied pair under one name), optimizer.bin (`_save_numbered_optimizer`), and links to `path`'s
    other files than the `converted` one (RNG states, run files)."""
    aliases, trained = set(held_ties(module)), trained_names(module)  # frozen weights come from the base model
    wanted = [k for k in module.state_dict() if k not in aliases and k in trained]
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise HftrainError(f"its {what} lacks {len(missing)} of this model's weights (e.g. {missing[:2]}): it was "
                           "written for another model or fine-tuning method")
    save_file({k: weights[k].contiguous() for k in wanted}, folder / MODEL_FILE, metadata={"format": "pt"})
    _save_numbered_optimizer(folder, module, recipe, hyper, state)
    for item in path.iterdir():
        if item.name != converted:
            (folder / item.name).symlink_to(item.resolve())


def _save_numbered_optimizer(folder: Path, module: nn.Module, recipe: Recipe, hyper: dict[str, dict],
                             state: dict[str, dict]) -> None:
    """optimizer.bin from each parameter's hyperparameters and state by name, numbered as `build_optimizer` numbers
    `module`'s parameters (the state dict torch's `load_state_dict` reads)."""
    groups, _ = optimizer_layout(recipe, module)
    optimizer = {"state": {}, "param_groups": []}
    number = 0
    for names in groups:
        optimizer["param_groups"].append({**hyper[names[0]], "params": list(range(number, number + len(names)))})
        for name in names:
            if name in state:
                optimizer["state"][number] = state[name]
            number += 1
    torch.save(optimizer, folder / f"{OPTIMIZER_NAME}.bin")


def write_unsharded(path: Path, folder: Path, module: nn.Module, recipe: Recipe) -> None:
    """A full-state checkpoint (`FULL_STATE_FILE`, written by a tensor- or expert-parallel run: every weight and its
    optimizer state gathered, by name) as the files one process (or DDP) reads, in `folder`, as `write_unpipelined`
    does."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    saved = torch.load(path / FULL_STATE_FILE, weights_only=True, map_location="cpu")
    optimizer = saved["optimizer"]
    hyper = {name: {k: v for k, v in group.items() if k != "params"}
             for group in optimizer["param_groups"] for name in group["params"]}
    _write_by_name(path, folder, module, recipe, saved["model"], hyper, optimizer["state"], FULL_STATE_FILE,
                   "full state")


@contextmanager
def unpipelined(backend, model, path: Path, full_state: bool = False):
    """A pp checkpoint for a run without pp (one process, DDP; `backend` its Backend): converted by the main process
    into `.unpipelined-checkpoint-N` next to it (`write_unpipelined`), loaded by every rank, then removed. With
    `full_state`: a tensor- or expert-parallel checkpoint's full state, the same way (`write_unsharded`)."""
    accelerator = backend.accelerator
    folder = path.parent / f"{PIPELINE_CONVERTED_PREFIX}{path.name}"
    error = None
    if accelerator.is_main_process:
        try:
            write = write_unsharded if full_state else write_unpipelined
            write(path, folder, backend.unwrap(model), backend.recipe)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it rather than wait at a barrier
            error = str(exc) if isinstance(exc, HftrainError) else f"{type(exc).__name__}: {exc}"
    error = broadcast_object_list([error])[0]
    if error is not None:
        layout = "tp_size / ep_size" if full_state else "pp_size"
        raise HftrainError(f"cannot read the {'full-state' if full_state else 'pipeline'} checkpoint "
                           f"{str(path)!r} on this layout: {error}; resume with the {layout} that wrote it")
    yield folder
    accelerator.wait_for_everyone()  # every rank has loaded: the converted copy can go
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)


def pipelined_state(folder: Path, module: nn.Module, ids: dict[str, int]) -> tuple[dict, dict]:
    """A checkpoint without pp (`folder`: accelerate's model.safetensors and optimizer.bin) as the flattened, HF-named
    model and optimizer state of what this rank's stages hold (`module`, its placeholders in place); `ids`: the
    optimizer numbering of the whole model (`optimizer_layout`). A tied head takes the embedding's tensor and state."""
    weights = load_file(folder / MODEL_FILE)  # on the CPU: loading the state copies it to the device
    saved = torch.load(folder / f"{OPTIMIZER_NAME}.bin", weights_only=True, map_location="cpu")
    group_of = {k: group for group in saved["param_groups"] for k in group["params"]}
    names_of: dict[int, list[str]] = {}
    for name, k in ids.items():
        names_of.setdefault(k, []).append(name)

    def saved_name(name: str) -> str:
        found = [n for n in ([name] + names_of.get(ids.get(name), [])) if n in weights]
        if not found:
            raise HftrainError(f"checkpoint {str(folder)!r} holds no weight {name!r}: it was written for another "
                               "model or fine-tuning method")
        return found[0]

    trained = trained_names(module)  # frozen weights (a LoRA base) are not in checkpoints: the builder loaded them
    model_state = {name: weights[saved_name(name)] for name in module.state_dict() if name in trained}
    optimizer_state = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        k = ids[name]
        for key, value in saved["state"].get(k, {}).items():
            optimizer_state[f"state.{name}.{key}"] = value
        for key, value in group_of[k].items():
            if key != "params":
                optimizer_state[f"param_groups.{name}.{key}"] = value
    return model_state, optimizer_state
