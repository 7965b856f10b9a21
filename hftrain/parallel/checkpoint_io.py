"""Checkpoint I/O: how a layout writes and reads its training state, one component per way of holding it.

A backend holds one (`backend.checkpoints`, chosen by its layout); `hftrain.checkpoint` (save, load, round trip,
the final folder) calls it and never asks which layout runs:

    io = backend.checkpoints
    io.attach(model, optimizer)          # after the model is prepared: hooks into accelerate's save_state / load_state
    accelerator.save_state(folder, **io.save_kwargs())            # or io.background_save(...) (async_checkpointing)
    io.check_resumable(saved_launch); with io.resume_folder(model, path, saved_launch) as folder: load_state(folder)
    io.save_pretrained(model, folder)    # the final from_pretrained folder, gathered from whatever shards

- `AccelerateCheckpoints` (one process, DDP): accelerate's model.safetensors (trained weights only), optimizer.bin;
- `FSDP2Checkpoints` (FSDP2, FSDP2 + cp): accelerate's sharded DCP folders, written in the background by default;
- `DeepSpeedCheckpoints` (ZeRO 1-3, ZeRO + sp): the engine's files, on another process count through a universal
  checkpoint;
- `FullStateCheckpoints` (tp, FSDP2 x tp, tp x cp): one full-state file, gathered and re-sharded;
- `PipelineCheckpoints` (pp, pp x tp, pp x FSDP2): a DCP folder under HF names, readable by any pp layout and
  without pp.

Every layout reads a checkpoint of another layout where the files allow (`check_resumable` refuses the rest in one
paragraph before anything loads).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from argparse import Namespace
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from accelerate.utils.other import save
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType
from torch.distributed.tensor import DTensor, Replicate

from hftrain.checkpoint import keep_trained_weights, trained_names
from hftrain.compat.accelerate import fsdp_state_dict_options
from hftrain.compat.deepspeed import loading_universal_checkpoint
from hftrain.compat.torch import local_block, persistent_buffers
from hftrain.config import TORCH_ADAMW
from hftrain.errors import HftrainError
from hftrain.paths import FULL_STATE_FILE, MODEL_FILE, UNIVERSAL_PREFIX
from hftrain.stages import PIPELINE_STATE_DIR, pipelined_state, resume_layout_problem, unpipelined


class AccelerateCheckpoints:
    """One process or DDP: accelerate's own files (model.safetensors with the trained weights only, optimizer.bin,
    the RNG states), written by the main process. The base of the other components: what they do not override is
    this. `backend`: the layout's backend (its accelerator, recipe, record and `unwrap`)."""

    # async_checkpointing unset: whether checkpoints are written in the background. Off where the staged copy would
    # be the whole state on one rank (one process, DDP); components whose ranks each stage a shard turn it on.
    async_by_default = False

    def __init__(self, backend):
        self.backend = backend

    @property
    def accelerator(self) -> Any:
        return self.backend.accelerator

    @property
    def recipe(self):
        return self.backend.recipe

    def attach(self, model, optimizer) -> None:
        """Hook this layout's files into `accelerator.save_state` / `load_state` for the prepared model (nothing:
        accelerate writes them itself)."""

    # ------------------------------------------------------------------ saving
    def save_kwargs(self) -> dict:
        """Arguments for `accelerator.save_state`."""
        return {}

    def synchronous(self) -> str | None:
        """Why this layout writes its checkpoints inside the training loop even with async_checkpointing; None: it
        writes them in the background (`background_save`)."""
        return None

    def save_rng_states(self, folder: Path) -> None:
        """The RNG state files of `accelerator.save_state`, by accelerate's own writer (no model or optimizer)."""
        accelerator = self.accelerator
        folder.mkdir(parents=True, exist_ok=True)
        save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step,
                               accelerator.scaler,
                               save_on_each_node=accelerator.project_configuration.save_on_each_node)

    def background_save(self, model, optimizer, folder: Path, stager) -> Callable[[], None]:
        """async_checkpointing: `accelerator.save_state`'s files in two parts. Now, while the loop waits: the RNG states
        and, on the main process (which alone writes them under DDP), a CPU copy of the trained weights and the
        optimizer state (`stager`). Returned, for the background thread: the writer of that copy, which writes the
        files save_state would (model.safetensors, optimizer.bin) with accelerate's `save`."""
        self.save_rng_states(folder)
        if not self.accelerator.is_main_process:
            return lambda: None
        unwrapped = self.backend.unwrap(model)
        weights = [unwrapped.state_dict()]  # what save_state saves: no DDP `module.` prefix
        keep_trained_weights([unwrapped], weights, folder)
        staged = stager.stage({"model": weights[0], "optimizer": optimizer.state_dict()})

        def write() -> None:
            save(staged["model"], folder / MODEL_FILE, safe_serialization=True)
            save(staged["optimizer"], folder / f"{OPTIMIZER_NAME}.bin")

        return write

    # ----------------------------------------------------------------- loading
    def load_kwargs(self) -> dict:
        """Arguments for `accelerator.load_state` of a checkpoint holding the trained weights only (the frozen base
        comes from the builder): non-strict, so absent frozen weights are not an error; which keys the file holds is
        checked beforehand (`checkpoint._check_saved_weights`), so non-strict hides nothing."""
        return {"strict": False}

    def saved_model_keys(self, folder: Path) -> set[str] | None:
        """State-dict keys of a checkpoint's model file, or None for a layout checked by its own loader."""
        model_file = folder / MODEL_FILE
        if not model_file.exists():
            return None
        with safe_open(str(model_file), framework="pt") as f:
            return set(f.keys())

    def check_resumable(self, saved_launch: dict) -> None:
        """Refuse a checkpoint this layout cannot load: a full-state one (tensor or expert parallel) or a pipeline
        one under FSDP2 / ZeRO, whose sharded loaders read only their own files. One process and DDP read both,
        converted (`resume_folder`)."""
        sharded_by = {DistributedType.FSDP: "FSDP2", DistributedType.DEEPSPEED: "DeepSpeed"}.get(
            self.accelerator.distributed_type)
        if sharded_by and (layout := full_state_layout(saved_launch)):
            raise HftrainError(f"this checkpoint was written with {layout} and this run shards the model with "
                               f"{sharded_by}; a tensor- or expert-parallel checkpoint (one full-state file) resumes "
                               "under tensor or expert parallelism (any sizes), on one process or under DDP: resume "
                               "with one of those")
        if problem := resume_layout_problem(saved_launch, 1, sharded_by):  # a pp checkpoint under FSDP2 / ZeRO
            raise HftrainError(problem)

    @contextmanager
    def resume_folder(self, model, path: Path, saved_launch: dict):
        """The folder `accelerator.load_state` reads checkpoint `path` from: `path` itself, unless it must be
        converted for this layout first: a pipeline checkpoint (pp_size > 1), or the full state of a tensor- or
        expert-parallel one, becomes one process's files (`stages.unpipelined`)."""
        if saved_launch.get("pp_size", 1) > 1 or full_state_layout(saved_launch):
            with unpipelined(self.backend, model, path, full_state=saved_launch.get("pp_size", 1) <= 1) as folder:
                yield folder
            return
        yield path

    # ------------------------------------------------------------ final folder
    def full_state_dict(self, model) -> dict | None:
        """The full weights, on the main process, for the final save; every rank calls. None: the model's own state
        dict is already complete (one process, DDP)."""
        return None

    def save_pretrained(self, model, folder: Path) -> None:
        """Full weights as one from_pretrained folder (model files and config; the caller adds the tokenizer)."""
        state_dict = self.full_state_dict(model)
        if self.accelerator.is_main_process:
            self.backend.unwrap(model).save_pretrained(folder, state_dict=state_dict)


def full_state_layout(saved_launch: dict) -> str | None:
    """The layout that wrote a full-state checkpoint (`FullTrainingState`: tensor or expert parallelism without pp),
    in words; None for any other checkpoint."""
    if saved_launch.get("pp_size", 1) > 1:
        return None
    sizes = [f"{axis}={saved_launch.get(axis, 1)}" for axis in ("tp_size", "ep_size") if saved_launch.get(axis, 1) > 1]
    return " x ".join(sizes) or None


# ----------------------------------------------------------------------------------------------------------- FSDP2
class FSDP2Checkpoints(AccelerateCheckpoints):
    """Sharded `torch.distributed.checkpoint` folders (one file per rank), checked by their own loader; with
    async_checkpointing the same folders are written by `dcp.save` from a background thread, on a gloo group of its
    own. The final folder: the full state dict gathered on the main process."""

    async_by_default = True  # each rank stages and writes only its shard

    def synchronous(self) -> str | None:
        if self.accelerator.state.fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
            return ("the preset's fsdp_state_dict_type gathers full state dicts on rank 0 inside save_state; "
                    "SHARDED_STATE_DICT checkpoints are written in the background")
        return None

    @cached_property
    def checkpoint_group(self):
        """A gloo group for the background writes' collectives: the training collectives keep the default group, and
        two threads must not interleave collectives on one group. Made at the first background save (every rank)."""
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.recipe.ddp_timeout))

    def background_save(self, model, optimizer, folder: Path, stager) -> Callable[[], None]:
        """The sharded folders accelerate's save_fsdp_model / save_fsdp_optimizer write (`pytorch_model_fsdp_0`,
        `optimizer_0`, the same state dict options), staged now and written by `dcp.save` in the background: what
        `dcp.async_save` does, with both saves in one thread because they share one process group. On the main
        process (DCP's coordinator) the writer returns after DCP has gathered every rank's write results and written
        the metadata, so every rank's files are on disk when the checkpoint is sealed."""
        self.save_rng_states(folder)
        options = fsdp_state_dict_options(self.accelerator.state.fsdp_plugin)  # accelerate's own, for equal files
        staged = stager.stage({"model": get_model_state_dict(model, options=options),
                               "optimizer": get_optimizer_state_dict(model, optimizer, options=options)})
        folders = {"model": folder / f"{FSDP_MODEL_NAME}_0", "optimizer": folder / f"{OPTIMIZER_NAME}_0"}
        for path in folders.values():
            path.mkdir(parents=True, exist_ok=True)
        group = self.checkpoint_group

        def write() -> None:
            for key, path in folders.items():
                dcp.save({key: staged[key]}, storage_writer=dcp.FileSystemWriter(str(path)),
                         planner=DefaultSavePlanner(), process_group=group)

        return write

    def full_state_dict(self, model) -> dict | None:
        return self.accelerator.get_state_dict(model)  # the full state dict, gathered on the main process


# ------------------------------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedCheckpoints(AccelerateCheckpoints):
    """The engine's files (model states, one optimizer partition per rank), written by `engine.save_checkpoint`
    inside accelerate's save_state; on another number of processes converted to a DeepSpeed universal checkpoint
    first (`resume_folder`). The final folder: ZeRO-3's 16-bit weights gathered on the main process."""

    def save_kwargs(self) -> dict:
        """The engine writes the model file itself; `exclude_frozen_parameters` keeps a frozen base (LoRA / QLoRA)
        out of it. What stays besides the trained weights is bitsandbytes' small quantization state of 4-bit
        layers (absmax, quant_map, ...), which `Linear4bit` adds to every state dict."""
        return {"exclude_frozen_parameters": True}

    def synchronous(self) -> str | None:
        """DeepSpeed 0.19.8's own background writers: the decoupled and fast checkpoint engines write through its
        async_io op, which needs libaio (absent on the CPU machines hftrain is tested on, so untested), the DataStates
        engine needs a package outside DeepSpeed; the engine's files (one optimizer partition per rank) are written by
        `engine.save_checkpoint` inside accelerate's save_state."""
        return ("DeepSpeed 0.19.8 writes in the background only through its decoupled/fast checkpoint engines, which "
                "need its async_io op (libaio) or the DataStates package; hftrain does not use them")

    def load_kwargs(self) -> dict:
        return {"load_module_strict": False}  # trained weights come back from the ZeRO partitions in any case

    def saved_model_keys(self, folder: Path) -> set[str] | None:
        """Keys of the engine's `*model_states.pt` (rank 0's; under ZeRO-3 every rank's file names every key)."""
        files = sorted((folder / "pytorch_model").glob("*model_states.pt"))
        if not files:
            return super().saved_model_keys(folder)
        # DeepSpeed's own loader reads this file the same way (it pickles its config objects next to the tensors)
        return set(torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["module"])

    def _other_world(self, saved_launch: dict) -> bool:
        return saved_launch["num_processes"] != self.accelerator.num_processes

    def check_resumable(self, saved_launch: dict) -> None:
        """On another number of processes a ZeRO checkpoint resumes through DeepSpeed's universal checkpoint, whose
        converter knows Adam's state only."""
        super().check_resumable(saved_launch)
        saved, world = saved_launch["num_processes"], self.accelerator.num_processes
        if self._other_world(saved_launch) and self.recipe.optim not in TORCH_ADAMW:
            raise HftrainError(
                f"this DeepSpeed checkpoint was written by {saved} processes and this run has {world}; hftrain resumes "
                "a ZeRO checkpoint on another process count by converting it to a DeepSpeed universal checkpoint, "
                "whose converter (deepspeed/checkpoint/ds_to_universal.py) reads only Adam's optimizer state "
                f"(exp_avg, exp_avg_sq): with optim={self.recipe.optim}, resume with {saved} processes"
            )

    @contextmanager
    def resume_folder(self, model, path: Path, saved_launch: dict):
        """`path`, or for a checkpoint written by another number of processes its universal conversion.

        ZeRO keeps one optimizer partition per rank, and DeepSpeed 0.19 refuses to re-partition it. The main process
        converts the engine's files with DeepSpeed's ds_to_universal (one file per parameter and state: fp32 weights,
        exp_avg, exp_avg_sq) into `.universal-checkpoint-N` next to the checkpoint, beside links to its other files
        (scheduler, RNG states), and every rank loads that with `load_universal` (which DeepSpeed reads from the
        engine's config at load time). The folder is removed once every rank has loaded it.
        """
        if not self._other_world(saved_launch):
            yield path
            return
        folder = path.parent / f"{UNIVERSAL_PREFIX}{path.name}"
        saved, world = saved_launch["num_processes"], self.accelerator.num_processes
        error = None
        if self.accelerator.is_main_process:
            print(f"hftrain: {path.name} was written by {saved} DeepSpeed processes; converting it to a universal "
                  f"checkpoint in {folder} to resume on {world}", flush=True)
            try:
                _convert_folder(path, folder)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it rather than wait at a barrier
                error = f"{type(exc).__name__}: {exc}"
        error = broadcast_object_list([error])[0]
        if error is not None:
            raise HftrainError(f"cannot convert the DeepSpeed checkpoint {str(path)!r} (written by {saved} processes) "
                               f"into a universal checkpoint for {world}: {error}; resume with {saved} processes")
        with loading_universal_checkpoint(model):
            yield folder
        self.accelerator.wait_for_everyone()  # every rank has loaded: the converted copy can go
        if self.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)

    def full_state_dict(self, model) -> dict | None:
        return self.accelerator.get_state_dict(model)  # ZeRO-3: the 16-bit weights gathered on the main process


def _convert_folder(path: Path, folder: Path) -> None:
    """The engine's folder of checkpoint `path` converted into `folder`, the checkpoint's other files linked."""
    engine_dir = next(p for p in sorted(path.iterdir()) if p.is_dir() and any(p.glob("*optim_states.pt")))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    _convert_to_universal(engine_dir, folder / engine_dir.name)
    for item in path.iterdir():
        if item != engine_dir:
            (folder / item.name).symlink_to(item.resolve())


def _convert_to_universal(engine_dir: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal.py in this process (no worker pool). `inject_missing_state`: transformers models
    carry no `universal_checkpoint_info`, which the converter otherwise requires (it only names TP/PP patterns)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # optional: only under DeepSpeed

    args = Namespace(input_folder=str(engine_dir), output_folder=str(out), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress; errors raise
        ds_to_universal(args)


# ------------------------------------------------------------------------------------------------- tensor parallel
class FullTrainingState:
    """Model and optimizer state as full tensors, hooked into `accelerator.save_state` / `load_state` (both run on
    every rank): saving gathers the shards and the main process writes `FULL_STATE_FILE`; loading reads it
    weights-only (tensors and plain values, no pickled objects) and re-shards it, or cuts a checkpoint of one process
    or DDP into this rank's blocks (`load_whole`)."""

    def __init__(self, accelerator, model, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def save(self, folder: str) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.accelerator.is_main_process:
            torch.save({"model": model_state, "optimizer": optimizer_state}, os.path.join(folder, FULL_STATE_FILE))

    def load(self, folder: str) -> None:
        path = os.path.join(folder, FULL_STATE_FILE)
        if not os.path.exists(path):
            self.load_whole(Path(folder))
            return
        self.load_full(torch.load(path, map_location="cpu", weights_only=True))

    def load_full(self, state: dict) -> None:
        """The full-state file's {"model", "optimizer"}, re-sharded by torch's full-state loading."""
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))

    def load_whole(self, folder: Path) -> None:
        """A checkpoint of one process or DDP (accelerate's model.safetensors with the trained weights, optimizer.bin
        numbered in the order of the optimizer's parameters, which `build_optimizer` gives every layout), read by
        name (`stages.pipelined_state`) and cut into this rank's blocks like the full-state file: the trained weights
        and their optimizer state; frozen weights (a LoRA base) keep what the builder loaded."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        number = {id(p): k for k, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
        weights, moments = pipelined_state(folder, self.model,
                                           {name: number[id(p)] for name, p in named.items() if id(p) in number})
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)  # strict: the keys below
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        trained = trained_names(self.model)
        model_state = {k: v for k, v in model_state.items() if k in trained}  # every one in `weights`, or refused
        set_state_dict(self.model, self.optimizer, model_state_dict=_local_blocks(model_state, weights),
                       optim_state_dict=_local_blocks(optimizer_state, moments), options=options)


class FullStateSlices(FullTrainingState):
    """`FullTrainingState` for FSDP2 x TP: the same file, loaded by each rank copying its own block of every full
    tensor into its shards (no collective). torch's full-state loading (`set_state_dict(full_state_dict=True)`)
    scatters each tensor with `distribute_tensor`, which refuses a dimension that the 2D mesh does not split evenly
    (an AssertionError in `_StridedShard._shard_tensor`; the tiny model's 753-token vocabulary over 4 ranks)."""

    def load_full(self, state: dict) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)  # this rank's shards (DTensors)
        set_state_dict(self.model, self.optimizer, model_state_dict=_local_blocks(model_state, state["model"]),
                       optim_state_dict=_local_blocks(optimizer_state, state["optimizer"]))


def _local_blocks(local, full, path: str = ""):
    """`full` (a state dict of full tensors) with each value that `local` holds as a DTensor cut to this rank's block
    of it (its offset and shape on the mesh); everything else (plain tensors, steps, param_groups) as in `full`."""
    if isinstance(local, dict):
        if local.keys() - full.keys():
            missing = sorted(local.keys() - full.keys())[:3]
            raise HftrainError(f"the checkpoint lacks {missing} under {path or 'the top'}")
        return {key: _local_blocks(local[key], full[key], f"{path}.{key}") if key in local else full[key]
                for key in full}
    if not isinstance(local, DTensor):
        return full
    shape, offset = local_block(full.shape, local.device_mesh, local.placements)
    if tuple(full.shape) != tuple(local.shape) or tuple(shape) != tuple(local.to_local().shape):
        raise HftrainError(f"{path}: the checkpoint's {tuple(full.shape)} does not fit this layout's "
                           f"{tuple(local.shape)} (local block {tuple(local.to_local().shape)})")
    block = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return DTensor.from_local(block.to(local.dtype).contiguous(), local.device_mesh, local.placements,
                              shape=local.shape, stride=local.stride())


class FullStateCheckpoints(AccelerateCheckpoints):
    """Tensor parallelism (with data-parallel copies, FSDP2 x tp, tp x cp) and expert parallelism: the full training
    state in one file (`FullTrainingState`), gathered and re-sharded, so it does not depend on the layout; `slices`:
    each rank loads its own blocks of the full tensors (`FullStateSlices`: the FSDP2 x tp mesh, which torch's scatter
    refuses for uneven splits). A checkpoint of one process or DDP resumes too: `FullTrainingState.load_whole` cuts
    its whole tensors the same way. The final folder: transformers gathers the shards."""

    def __init__(self, backend, slices: bool = False):
        super().__init__(backend)
        self.state_class = FullStateSlices if slices else FullTrainingState

    def attach(self, model, optimizer) -> None:
        state = self.state_class(self.accelerator, model, optimizer)
        self.accelerator.register_save_state_pre_hook(lambda models, weights, folder: state.save(folder))
        self.accelerator.register_load_state_pre_hook(lambda models, folder: state.load(folder))

    def synchronous(self) -> str | None:
        return ("a tensor-parallel checkpoint gathers the full model and optimizer state with collectives inside "
                "save_state (FullTrainingState), which a background thread cannot run beside training")

    def check_resumable(self, saved_launch: dict) -> None:
        """Full-state checkpoints (tensor or expert parallel, any sizes), those of one process or DDP (accelerate's
        whole files, cut by `FullTrainingState.load_whole`) and a pipeline's (converted to those, `resume_folder`);
        not the sharded files of FSDP2 or ZeRO."""
        if full_state_layout(saved_launch) or saved_launch.get("pp_size", 1) > 1:
            return
        sharded = ("DeepSpeed" if saved_launch.get("deepspeed_config") is not None else
                   "FSDP2" if saved_launch.get("sharded_modules") else None)
        if sharded:
            now = " x ".join(f"{axis}={getattr(self.recipe, axis)}" for axis in ("tp_size", "ep_size")
                             if getattr(self.recipe, axis) > 1)
            raise HftrainError(f"this checkpoint was written with {sharded} and this run has {now}; tensor- and "
                               "expert-parallel runs resume checkpoints of one process, DDP, a pipeline, tensor or "
                               "expert parallelism: resume with the layout that wrote it, or from one of those")

    @contextmanager
    def resume_folder(self, model, path: Path, saved_launch: dict):
        """A full-state checkpoint (tensor or expert parallel) as it is: `FullTrainingState` re-shards it; a
        pipeline's converted to one process's files, which it cuts into this rank's blocks."""
        if saved_launch.get("pp_size", 1) > 1:
            with super().resume_folder(model, path, saved_launch) as folder:
                yield folder
            return
        yield path

    def save_pretrained(self, model, folder: Path) -> None:
        """Every rank: transformers gathers the shards, the main process writes."""
        model.save_pretrained(folder, is_main_process=self.accelerator.is_main_process)


# ------------------------------------------------------------------------------------------------------- pipelines
def placed_like(module: nn.Module, weights: dict, moments: dict) -> tuple[dict, dict]:
    """Whole tensors (a checkpoint written without tp) laid out as `module`'s tensor-parallel parameters: each
    weight, and each optimizer value of a parameter's shape, becomes a DTensor with its parameter's placements (this
    rank's slice; no communication). Plain parameters keep plain values."""
    params = dict(module.state_dict(keep_vars=True))

    def like(value, param):
        if not isinstance(param, DTensor) or isinstance(value, DTensor) or value.shape != param.shape:
            return value
        whole = DTensor.from_local(value.to(param.device), param.device_mesh,
                                   [Replicate()] * param.device_mesh.ndim, run_check=False)
        return whole.redistribute(param.device_mesh, param.placements)

    weights = {name: like(value, params[name]) for name, value in weights.items()}
    out = {}
    for key, value in moments.items():
        section, _, rest = key.partition(".")
        name = rest.rpartition(".")[0]
        out[key] = like(value, params[name]) if section == "state" and name in params else value
    return weights, out


class PipelineCheckpoints(AccelerateCheckpoints):
    """Pipeline stages (`backend`: a `PipelineBackend`; `sharded_stages`: each stage sharded by FSDP2 over its
    data-parallel ranks): accelerate's save_state / load_state write and read the RNG states; the model and optimizer
    state of every stage go through torch.distributed.checkpoint into PIPELINE_STATE_DIR, keyed by the HF parameter
    names, so each rank reads what its stages hold whatever the layout that wrote them (another pp_size, schedule or
    number of copies, or a run without pp)."""

    def __init__(self, backend, sharded_stages: bool = False):
        super().__init__(backend)
        self.sharded_stages = sharded_stages

    def attach(self, model, optimizer) -> None:
        # one key per parameter and value (DCP); frozen weights (a LoRA / QLoRA base, its quantization state) are
        # not saved, as in every hftrain checkpoint: the builder rebuilds them from the base model on resume
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        trained = trained_names(model.module)
        # a stage that trains nothing (adapters only on other stages) has an optimizer without parameters, whose
        # state torch's state-dict functions refuse as empty: it saves and loads no optimizer state
        steps = any(group["params"] for group in optimizer.param_groups)
        unsplit_ids = self.backend.unsplit_ids

        def state():
            # the trained tensors by name, read from the parameters and persistent buffers rather than through
            # state_dict(), which would also serialise the frozen base: bitsandbytes' 8-bit layers fail there on CPU
            # ('Linear8bitLt' object has no attribute 'SCB')
            tensors = {n: p.detach() for n, p in model.module.named_parameters(remove_duplicate=False)}
            for prefix, module in model.module.named_modules(remove_duplicate=False):
                tensors.update({f"{prefix}.{n}" if prefix else n: b for n, b in persistent_buffers(module).items()})
            return {"model": {k: v for k, v in tensors.items() if k in trained},
                    "optimizer": get_optimizer_state_dict(model.module, optimizer, options=options) if steps else {}}

        def set_state(weights: dict, moments: dict) -> None:
            set_model_state_dict(model.module, weights, options=options)
            if steps:
                set_optimizer_state_dict(model.module, optimizer, moments, options=options)

        def save(models, weights, folder) -> None:
            dcp.save(state(), checkpoint_id=str(Path(folder) / PIPELINE_STATE_DIR))

        def load(models, folder) -> None:
            if not (Path(folder) / PIPELINE_STATE_DIR).exists():  # written without pp: accelerate's files
                set_state(*placed_like(model.module, *pipelined_state(Path(folder), model.module, unsplit_ids)))
                return
            loaded = state()
            dcp.load(loaded, checkpoint_id=str(Path(folder) / PIPELINE_STATE_DIR))
            set_state(loaded["model"], loaded["optimizer"])

        self.accelerator.register_save_state_pre_hook(save)
        self.accelerator.register_load_state_pre_hook(load)

    def synchronous(self) -> str | None:
        return ("pipeline checkpoints are written by torch.distributed.checkpoint with collectives over every stage, "
                "which a background thread cannot run beside the pipeline's own communication")

    def saved_model_keys(self, folder: Path) -> set[str] | None:
        return None  # DCP's own loader checks that every key this rank needs is in the checkpoint

    def check_resumable(self, saved_launch: dict) -> None:
        """Any pp checkpoint (another pp_size, schedule or number of copies: DCP reads each rank's names), and one
        written by one process or DDP (accelerate's files, `pipelined_state`); not FSDP2's, ZeRO's or tensor-parallel
        sharded files (`resume_layout_problem`, also checked in the preflight for a named folder)."""
        if problem := resume_layout_problem(saved_launch, self.recipe.pp_size, None):
            raise HftrainError(problem)

    @contextmanager
    def resume_folder(self, model, path: Path, saved_launch: dict):
        yield path  # pp checkpoints and those without pp: the load hook reads either (`attach`)

    def full_state_dict(self, model) -> dict | None:
        """Every stage's weights gathered on the main process (the first copy's; the others hold the same); under tp
        each tensor's shards are gathered first, inside its tp group (every rank of the first copy calls). A tied
        head is left to the embedding's key, as transformers saves a tied model."""
        tied = self.backend.tied_parameter(model) if not model.has_first else None
        mine = self.first_copy_whole({k: v for k, v in model.module.state_dict(keep_vars=True).items()
                                      if v is not tied})
        merged = {}
        for part in gather_object([mine if self.backend.tp_rank == 0 else {}]):
            merged.update(part)
        return merged

    def first_copy_whole(self, tensors: dict) -> dict:
        """`tensors` whole, on the CPU, on the first data-parallel copy ({} on the others): a tp-sharded DTensor
        gathered inside its tp group (every rank of the first copy calls); with sharded stages each tensor gathered
        over its stage's data-parallel ranks, every copy taking part in each gather (in the same order: the same names
        on every copy of a stage), the first keeping them."""
        if self.backend.copy != 0 and not self.sharded_stages:
            return {}
        whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous()
                 for k, v in tensors.items()}
        return whole if self.backend.copy == 0 else {}

    def save_pretrained(self, model, folder: Path) -> None:
        """The full model (`full_state_dict`; the main process writes it, and under tp every rank calls
        save_pretrained, since a model loaded with transformers' tp plan ends it with a barrier over every rank), or
        for a peft model the adapter of every stage: peft finds adapter weights by walking the model's LoRA layers
        (`get_peft_model_state_dict`), and the main process's tree holds placeholders for the other stages' layers, so
        each rank takes its own stages' adapter weights under peft's names with peft's function, and the main process
        writes their union in place of the file peft's save_pretrained wrote from its own stages (config and model
        card are peft's)."""
        lm = model.module.lm
        if hasattr(lm, "peft_config"):  # LoRA with tp_size > 1 is refused (fields/peft.py)
            from peft import get_peft_model_state_dict
            from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME

            mine = self.first_copy_whole(get_peft_model_state_dict(lm))
            merged = {}
            for part in gather_object([mine]):
                merged.update(part)
            if self.accelerator.is_main_process:  # peft's config and model card; its weights file is ours
                lm.save_pretrained(folder, state_dict={})  # (its own would be this stage's tensors, maybe shards)
                save_file(merged, Path(folder) / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
            return
        state_dict = self.full_state_dict(model)
        if self.accelerator.is_main_process or self.recipe.tp_size > 1:
            main = self.accelerator.is_main_process
            self.backend.unwrap(model).save_pretrained(folder, state_dict=state_dict if main else {},
                                                       is_main_process=main)
