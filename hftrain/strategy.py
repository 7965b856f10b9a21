"""Strategy specifics: what differs between DDP, FSDP2, DeepSpeed ZeRO and tensor parallel, in one place.

The launch preset picks the strategy (accelerate reads it into `ACCELERATE_USE_DEEPSPEED` /
`ACCELERATE_USE_FSDP` and plugin settings); the loop calls the functions below and never
branches on the strategy itself:

- `launch_problems`  recipe/preset contradictions, found before any model loads (DeepSpeed JSON
                     values that disagree with the recipe, optimizer blocks, ZeRO-3 without a
                     consolidated save, ...).
- `fill_deepspeed_config`  the DeepSpeed config's `"auto"` values from the recipe, so the recipe
                     stays the single source of truth (micro batch, accumulation, clipping; precision
                     is filled by accelerate from the recipe's bf16/fp16).
- `prepare`          model-dependent settings (ZeRO bucket sizes from the hidden size, FSDP2
                     transformer-layer wrapping from the model's `_no_split_modules`), then
                     `accelerator.prepare`. The client optimizer is used under DeepSpeed (no DS
                     optimizer or scheduler): the loop steps the schedule once per optimizer step.
                     A tensor-parallel model stays unwrapped; its data-parallel copies (more
                     processes than tp_size) average their gradients through `ReplicaGradients`.
- `clip_grad_norm`   the clipped global norm as a float: DeepSpeed clips inside its engine
                     (`gradient_clipping`) and reports the norm; FSDP2 returns a DTensor.
- `parameter_counts` counts that stay right when ZeRO-3 has partitioned the parameters.
- `check_resumable`  whether a checkpoint written by another number of processes can be loaded;
                     `resume_folder` converts a ZeRO checkpoint for another number.
- `checkpoint_save_kwargs` / `checkpoint_load_kwargs` / `saved_model_keys`  checkpoints that hold the trained
                     weights only (a frozen base is rebuilt by the builder): how each strategy writes, reads
                     and names them.
- `data_parallel`    which share of the data a rank trains on: with tensor parallelism (recipe tp_size,
                     transformers' DistributedConfig) the ranks of one TP group see the same batches,
                     and `DataParallel.sum` adds over the data-parallel ranks only.
- `save_pretrained`  the final model as one from_pretrained folder, gathered from whatever shards it.
"""

from __future__ import annotations

import functools
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.config import TORCH_ADAMW, Recipe
from hftrain.errors import ConfigError, HftrainError

FULL_STATE_FILE = "full_training_state.pt"  # tensor parallel: gathered model + optimizer state
DS_CONFIG_FILE = "ds_config.json"  # the DeepSpeed config actually used, next to every checkpoint and final model
# "auto" entries hftrain fills: from the recipe (and world size) at start-up, or from the model's hidden size
RECIPE_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                    "gradient_clipping", "bf16.enabled", "fp16.enabled")
HIDDEN_SIZE_AUTO_KEYS = {  # the sizes HF Trainer and accelerate use
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _selected(accelerator) -> str:
    """The strategy accelerate actually selected: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ..."""
    return str(accelerator.distributed_type).split(".")[-1]


def launched_with(strategy: str, environ=os.environ) -> bool:
    """True if the accelerate preset asked for `strategy` ('DEEPSPEED' or 'FSDP')."""
    return environ.get(f"ACCELERATE_USE_{strategy}", "false").lower() == "true"


# ----------------------------------------------------------------------------- DeepSpeed config
def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value


def _auto_keys(node, prefix: str = "") -> list[str]:
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            found += _auto_keys(value, path + ".")
        elif value == "auto":
            found.append(path)
    return found


def read_deepspeed_config(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"cannot read the DeepSpeed config {path!r} named by the preset: {exc.strerror}"],
                          "launch preset") from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"the DeepSpeed config {path!r} is not valid JSON: {exc}"], "launch preset") from None


def deepspeed_config_path() -> str | None:
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    return None if path == "none" else path


def recipe_values(recipe: Recipe, world: int) -> dict:
    """What the recipe says for each DeepSpeed key hftrain fills."""
    micro, accum = recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world, "gradient_clipping": float(recipe.max_grad_norm),
            "bf16.enabled": recipe.bf16, "fp16.enabled": recipe.fp16}


def deepspeed_problems(recipe: Recipe, config: dict, world: int) -> list[str]:
    """Every way a DeepSpeed config contradicts the recipe or cannot work with hftrain's loop."""
    problems = []
    for block in ("optimizer", "scheduler"):
        if block in config:
            problems.append(f"the DeepSpeed config has an {block!r} block; remove it: the recipe's optim / "
                            "learning-rate fields build the optimizer and schedule (the same ones under every preset)")
    for key, wanted in recipe_values(recipe, world).items():
        value = _get(config, key)
        if value is None or value == "auto":
            continue
        if key.endswith(".enabled"):
            value = str(value).lower() == "true"
        if value != wanted:
            problems.append(f"the DeepSpeed config sets {key}={value} but the recipe gives {wanted}; set it to "
                            "\"auto\" so hftrain fills it from the recipe")
    unknown = [k for k in _auto_keys(config) if k not in RECIPE_AUTO_KEYS and k not in HIDDEN_SIZE_AUTO_KEYS]
    if unknown:
        problems.append(f"the DeepSpeed config has \"auto\" values hftrain does not fill: {', '.join(unknown)}; "
                        "give them numbers")
    if "zero_optimization" not in config:
        problems.append("the DeepSpeed config has no zero_optimization block; give one with a stage (0-3)")
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        problems.append("ZeRO stage 3 without zero_optimization.stage3_gather_16bit_weights_on_model_save: true "
                        "cannot write a consolidated final model (every rank holds a shard); set it to true")
    if zero.get("stage") == 3 and recipe.use_liger_kernel:
        problems.append("use_liger_kernel under ZeRO-3 is refused: Liger's fused loss reads lm_head.weight without "
                        "calling lm_head, so ZeRO-3's gather hook never runs and the kernel gets an empty shard (TRL "
                        "issue #3368); use ZeRO-2, FSDP2 or DDP with Liger, or ZeRO-3 without it")
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if offloaded and recipe.optim not in TORCH_ADAMW:
        problems.append(f"optimizer offload runs DeepSpeedCPUAdam, but optim={recipe.optim}: accelerate would "
                        "silently replace it with Adam; use optim=adamw_torch or a DeepSpeed config without "
                        "offload_optimizer")
    return problems


def fill_deepspeed_config(config: dict, recipe: Recipe, world: int) -> None:
    """Fill the recipe-determined values that are "auto" or absent, in place.

    Absent counts as "auto": DeepSpeed's own defaults differ from the recipe's (gradient_clipping
    defaults to 1.0 there; max_grad_norm=0 must reach DeepSpeed as 0, which disables clipping).
    Precision (bf16/fp16.enabled) is filled by accelerate from the recipe's mixed precision.
    """
    for key, value in recipe_values(recipe, world).items():
        if not key.endswith(".enabled") and _get(config, key) in (None, "auto"):
            _set(config, key, value)


def launch_problems(recipe: Recipe) -> list[str]:
    """Contradictions between the launch preset's strategy files and the recipe (before anything loads)."""
    if not launched_with("DEEPSPEED"):
        return []
    path = deepspeed_config_path()
    if path is None:
        return ["the DeepSpeed preset names no deepspeed_config_file; hftrain's presets point at ds_configs/*.json "
                "so that every DeepSpeed setting is visible in one file"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return deepspeed_problems(recipe, read_deepspeed_config(path), world)


def check_selected(accelerator) -> None:
    """Refuse a launch where accelerate silently chose another strategy than the preset asked for."""
    for wanted in ("DEEPSPEED", "FSDP"):
        got = _selected(accelerator)
        if launched_with(wanted) and got != wanted:
            hint = (" accelerate selects FSDP only for GPU-like devices; on a CPU machine use cpu_ddp or a zero* "
                    "preset" if wanted == "FSDP" else " unset ACCELERATE_USE_CPU (it turns DeepSpeed into DDP)")
            raise HftrainError(f"the launch preset asks for {wanted} but accelerate selected {got} on this machine, "
                               f"which would train with another strategy than the one you chose;{hint}")


# --------------------------------------------------------------------------- tensor parallel
# Process layout with tensor parallelism (transformers' device mesh, TP innermost): rank = dp_rank * tp + tp_rank.
# With 4 processes and tp_size=2: TP groups {0,1} {2,3} hold the two halves of every linear layer; data-parallel
# groups {0,2} {1,3} hold the same half, train on different batches and average their gradients.
@functools.cache
def _tp_groups(world: int, tp: int) -> tuple[Any, Any]:
    """(data-parallel group, tensor-parallel group) of this rank; every rank creates every group, in order."""
    import torch.distributed as dist

    rank, mine = dist.get_rank(), {}
    for kind, groups in (("dp", [list(range(t, world, tp)) for t in range(tp)]),
                         ("tp", [list(range(d * tp, d * tp + tp)) for d in range(world // tp)])):
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["dp"], mine["tp"]


@dataclass(frozen=True)
class DataParallel:
    """This rank's share of the data: `world` data-parallel groups, this rank in group `rank`.

    The `replicas` (= tp_size) ranks of one tensor-parallel group train on the same batches. `sum` adds a value
    over the data-parallel ranks only (each batch once, so token counts and loss sums stay exact), then takes
    the max over the tensor-parallel group: its ranks hold equal values except a stop vote, which reaches them all.
    """

    world: int
    rank: int
    replicas: int
    accelerator: Any

    def sum(self, tensor):
        if self.replicas == 1:
            return self.accelerator.reduce(tensor, reduction="sum")
        import torch.distributed as dist

        dp_group, tp_group = _tp_groups(self.world * self.replicas, self.replicas)
        total = tensor.clone()
        if self.world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=tp_group)
        return total


TP_WITH_SHARDING_REFUSED = (
    "tensor parallelism combined with FSDP or DeepSpeed is not available in hftrain: accelerate 1.15 composes TP "
    "with data parallelism only through ParallelismConfig, which needs FSDP2 with a sharded data dimension "
    "(dp_shard_size > 1; it refuses TP with pure replication) and accepts only FSDP2, DeepSpeed or multi-GPU "
    "launches, while accelerate selects FSDP only for GPU-like devices. Use a DDP-type preset (tp, or cpu_ddp / "
    "multi_gpu with --num_processes a multiple of tp_size): hftrain then averages the gradients of the tp_size-way "
    "sharded copies itself"
)


def data_parallel(accelerator, recipe: Recipe) -> DataParallel:
    """Data-parallel layout for this launch; refuses tensor-parallel set-ups hftrain does not run."""
    tp, world, kind = recipe.tp_size, accelerator.num_processes, _selected(accelerator)
    if tp > 1 and kind not in ("MULTI_CPU", "MULTI_GPU"):
        if kind in ("FSDP", "DEEPSPEED"):
            raise HftrainError(f"tp_size={tp} with a {kind} preset: {TP_WITH_SHARDING_REFUSED}")
        raise HftrainError(f"tp_size={tp} needs tp_size (or a multiple of it) processes on a DDP-type preset (e.g. "
                           f"tp, or cpu_ddp with --num_processes {tp}); this launch is {kind} with {world} process(es)")
    if tp > 1 and world % tp:
        raise HftrainError(f"tp_size={tp} does not divide the {world} processes of this launch; use a multiple of "
                           f"tp_size processes (each group of tp_size consecutive ranks shards one copy of the model)")
    return DataParallel(world // tp, accelerator.process_index // tp, tp, accelerator)


def model_load_kwargs(recipe: Recipe) -> dict:
    """from_pretrained arguments of the strategy: tensor parallelism shards the weights while they load.

    With more processes than tp_size, transformers builds its mesh with `dp_replicate_size` copies of the TP
    group; its own handling of that dimension is FSDP2 (HSDP), which accelerate cannot drive on CPU (see
    TP_WITH_SHARDING_REFUSED). `_ReplicatedTensorParallel` keeps the mesh and leaves the copies to hftrain,
    which averages their gradients (`ReplicaGradients`).
    """
    if recipe.tp_size == 1:
        return {}
    from transformers.distributed import DistributedConfig

    copies = int(os.environ.get("WORLD_SIZE", "1")) // recipe.tp_size
    if copies <= 1:
        return {"distributed_config": DistributedConfig(tp_size=recipe.tp_size)}  # the model's own tp_plan ("auto")

    class _ReplicatedTensorParallel(DistributedConfig):
        @property
        def dp_size(self) -> int:  # no FSDP2 on the copies: transformers applies it only when dp_size > 1
            return 1

    return {"distributed_config": _ReplicatedTensorParallel(tp_size=recipe.tp_size, dp_replicate_size=copies)}


def tp_size(accelerator, model) -> int:
    """Tensor-parallel degree of the (possibly wrapped) model: 1 unless transformers sharded it at load."""
    return accelerator.unwrap_model(model).lm.tp_size or 1


class ReplicaGradients:
    """Average each gradient over the data-parallel copies of a tensor-parallel model, as DDP would (DDP cannot
    hold DTensor parameters). A hook per parameter runs once its gradient is accumulated in the backward of the
    micro-batch that ends an optimizer step (`accelerator.sync_gradients`), before clipping and the step. Every
    rank runs the same backward graph, so the collectives of the data-parallel and TP groups come in one order.
    Sum then divide (gloo has no average): the same arithmetic as DDP's mean over the copies."""

    def __init__(self, accelerator, model, group, copies: int):
        self.accelerator, self.group, self.copies = accelerator, group, copies
        self.handles = [p.register_post_accumulate_grad_hook(self.average)
                        for p in model.parameters() if p.requires_grad]

    def average(self, param) -> None:
        if not self.accelerator.sync_gradients:
            return
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # DTensor: this shard
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            grad.div_(self.copies)


class FullTrainingState:
    """Model and optimizer state as full tensors, for models accelerate does not wrap (tensor parallel).

    Hooked into `accelerator.save_state` / `load_state` (both run on every rank): saving gathers the shards
    and the main process writes `FULL_STATE_FILE`; loading reads it weights-only (tensors and plain values, no
    pickled objects) and re-shards it, so the checkpoint does not depend on the layout.
    """

    def __init__(self, accelerator, model, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def save(self, folder: str) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.accelerator.is_main_process:
            torch.save({"model": model_state, "optimizer": optimizer_state}, os.path.join(folder, FULL_STATE_FILE))

    def load(self, folder: str) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = torch.load(os.path.join(folder, FULL_STATE_FILE), map_location="cpu", weights_only=True)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))


# ------------------------------------------------------------------------------------ prepare
def prepare(accelerator, model, optimizer):
    """Model-dependent strategy settings, then `accelerator.prepare(model, optimizer)`.

    A tensor-parallel model (DTensor weights, sharded by transformers at load) is not wrapped: DDP cannot hold
    DTensors, so the gradients of its data-parallel copies (if any) are averaged by `ReplicaGradients`, and its
    checkpoint is full state.
    """
    tp = tp_size(accelerator, model)
    if tp > 1:
        if accelerator.mixed_precision != "no":
            model.forward = accelerator.autocast()(model.forward)  # what accelerator.prepare would add
        world, rank = accelerator.num_processes, accelerator.process_index
        sharded = next(p for p in model.parameters() if hasattr(p, "device_mesh"))
        if sharded.device_mesh.mesh.flatten().tolist() != list(range(rank - rank % tp, rank - rank % tp + tp)):
            raise HftrainError(f"transformers sharded the model over ranks {sharded.device_mesh.mesh.tolist()}, not "
                               f"over consecutive groups of tp_size={tp} as hftrain assumes for the data split")
        if world > tp:
            ReplicaGradients(accelerator, model, _tp_groups(world, tp)[0], world // tp)
        state = FullTrainingState(accelerator, model, optimizer)
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: state.save(folder))
        accelerator.register_load_state_pre_hook(lambda models, folder: state.load(folder))
        return model, optimizer
    lm_config = model.lm.config
    if _selected(accelerator) == "DEEPSPEED":
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        hidden = getattr(lm_config, "hidden_size", None)
        for key, size in HIDDEN_SIZE_AUTO_KEYS.items():
            if _get(config, key) == "auto":
                if hidden is None:
                    raise HftrainError(f"the DeepSpeed config has {key}: \"auto\" but the model config has no "
                                       "hidden_size to derive it from; give a number")
                _set(config, key, size(hidden))
    fsdp_plugin = accelerator.state.fsdp_plugin if _selected(accelerator) == "FSDP" else None
    if fsdp_plugin is not None and fsdp_plugin.transformer_cls_names_to_wrap is None:
        # accelerate reads `_no_split_modules` from the prepared module, which is our loss wrapper
        fsdp_plugin.transformer_cls_names_to_wrap = list(getattr(model.lm, "_no_split_modules", None) or [])
    return accelerator.prepare(model, optimizer)


def clip_grad_norm(accelerator, model, max_norm: float) -> float | None:
    """Clip to `max_norm` (inf: only measure) and return the global gradient norm before clipping."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)  # DeepSpeed: the engine's norm, clipped inside
    if norm is None:
        return None
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    return float(norm)


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters, counting ZeRO-3 partitioned parameters at their full size and packed
    bitsandbytes 4-bit weights at their original size (as model.model_summary does)."""
    from hftrain.model import parameter_count

    def size(p) -> int:
        return p.ds_numel if hasattr(p, "ds_numel") else parameter_count(p)

    params = list(model.parameters())
    return sum(size(p) for p in params if p.requires_grad), sum(size(p) for p in params)


# ---------------------------------------------------------------------------- memory estimate
GIB = 2**30


def model_state_memory(accelerator, recipe: Recipe, n_trainable: int, n_params: int) -> dict:
    """Model-state memory per device for the strategy that runs (activations and buffers not included).

    ZeRO paper accounting, with P parameters of which T are trained, N processes and w bytes per weight:
    weights w*P, gradients w*T, optimizer state k*T (AdamW: 8 bytes of fp32 moments, plus a 4-byte fp32
    master copy when DeepSpeed trains in 16 bit; SGD: 4 with momentum). DDP keeps all three on every
    device; ZeRO-1 shards the optimizer state (/N), ZeRO-2 and FSDP2 SHARD_GRAD_OP also the gradients,
    ZeRO-3 and FSDP2 FULL_SHARD everything; offloaded parts live in CPU RAM instead. Tensor parallelism
    splits all three over the tp_size processes of a group (counted as if the small replicated norm weights
    were split too); its data-parallel copies each hold that much again.
    """
    import torch

    from hftrain.model import DTYPES

    kind, world, tp = _selected(accelerator), accelerator.num_processes, recipe.tp_size
    sixteen_bit_master = kind == "DEEPSPEED" and (recipe.bf16 or recipe.fp16)
    w = 2 if sixteen_bit_master else DTYPES[recipe.dtype].itemsize
    moments = 8 if recipe.optim in TORCH_ADAMW else 4 if recipe.sgd_momentum > 0 else 0
    k = moments + (4 if sixteen_bit_master else 0)
    parts = {"weights": w * n_params, "gradients": w * n_trainable, "optimizer": k * n_trainable}
    sharded, offloaded, name = set(), set(), {"NO": "single process", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP"}.get(kind)
    if tp > 1:  # linear weights split over the tp_size processes of a group, norms replicated (small); copies
        sharded = {"optimizer", "gradients", "weights"}  # of the group (data parallel) hold the same again
        name = f"tensor parallel (tp_size={tp})" + (f" x {world // tp} data-parallel copies" if world > tp else "")
    elif kind == "DEEPSPEED":
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        stage = int(zero.get("stage", 0))
        sharded = {"optimizer", "gradients", "weights"} if stage == 3 else {"optimizer", "gradients"} if stage == 2 \
            else {"optimizer"} if stage == 1 else set()
        offloaded = {part for part, key in (("optimizer", "offload_optimizer"), ("weights", "offload_param"))
                     if zero.get(key, {}).get("device", "none") not in ("none", None)}
        name = f"DeepSpeed ZeRO-{stage}" + (" + offload" if offloaded else "")
    elif kind == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        full_shard = plugin.reshard_after_forward is True
        sharded = {"optimizer", "gradients", "weights"} if full_shard else {"optimizer", "gradients"}
        from torch.distributed.fsdp import CPUOffloadPolicy  # FSDP2: OffloadPolicy() means no offload

        offloaded = set(parts) if isinstance(plugin.cpu_offload, CPUOffloadPolicy) else set()
        name = "FSDP2 " + ("FULL_SHARD" if full_shard else "SHARD_GRAD_OP") + (" + offload" if offloaded else "")
    per_device = {p: (b // (tp if tp > 1 else world) if p in sharded else b) for p, b in parts.items()}
    on_device = sum(b for p, b in per_device.items() if p not in offloaded)
    on_cpu = sum(b for p, b in per_device.items() if p in offloaded)
    if accelerator.device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(accelerator.device).total_memory
    else:  # CPU: the machine's RAM shared by the processes of this node
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        device_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    return {"strategy": name or kind, "processes": world, "bytes_per_weight": w, "optimizer_bytes_per_param": k,
            "per_device_bytes": on_device, "offloaded_bytes": on_cpu, "per_device_gib": round(on_device / GIB, 3),
            "offloaded_gib": round(on_cpu / GIB, 3), "device_memory_gib": round(device_memory / GIB, 1)}


# ------------------------------------------------------------------------------- checkpoints
UNIVERSAL_PREFIX = ".universal-"  # output_dir/.universal-checkpoint-N: a ZeRO checkpoint converted for another world


def _resumes_universally(accelerator, saved_launch: dict) -> bool:
    return _selected(accelerator) == "DEEPSPEED" and saved_launch["num_processes"] != accelerator.num_processes


def check_resumable(accelerator, saved_launch: dict, recipe: Recipe) -> None:
    """Tensor-parallel checkpoints hold full state in another file layout: they resume with tensor parallelism.
    DeepSpeed ZeRO checkpoints hold one optimizer partition per rank; on another number of processes they resume
    through DeepSpeed's universal checkpoint (`resume_folder`), whose converter knows Adam's state only."""
    saved, world = saved_launch["num_processes"], accelerator.num_processes
    if (saved_launch["tp_size"] > 1) != (recipe.tp_size > 1):
        raise HftrainError(
            f"this checkpoint was written with tp_size={saved_launch['tp_size']} and this run has "
            f"tp_size={recipe.tp_size}; tensor-parallel checkpoints resume only with tensor parallelism (any "
            "tp_size) and other checkpoints only without it"
        )
    if _resumes_universally(accelerator, saved_launch) and recipe.optim not in TORCH_ADAMW:
        raise HftrainError(
            f"this DeepSpeed checkpoint was written by {saved} processes and this run has {world}; hftrain resumes a "
            "ZeRO checkpoint on another process count by converting it to a DeepSpeed universal checkpoint, whose "
            "converter (deepspeed/checkpoint/ds_to_universal.py) reads only Adam's optimizer state (exp_avg, "
            f"exp_avg_sq): with optim={recipe.optim}, resume with {saved} processes"
        )


@contextmanager
def resume_folder(accelerator, model, path: Path, saved_launch: dict):
    """The folder `accelerator.load_state` reads checkpoint `path` from.

    That is `path` itself, except for a DeepSpeed ZeRO checkpoint written by another number of processes: ZeRO
    keeps one optimizer partition per rank, and DeepSpeed 0.19 refuses to re-partition it ("Automatic adjustment of
    ZeRO's optimizer state partitioning with a new world size is not currently supported"). The main process then
    converts the engine's files with DeepSpeed's ds_to_universal (one file per parameter and state: fp32 weights,
    exp_avg, exp_avg_sq) into `.universal-checkpoint-N` next to the checkpoint, beside links to its other files
    (scheduler, RNG states), and every rank loads that with `load_universal` (which DeepSpeed reads from the
    engine's config at load time). The folder is removed once every rank has loaded it.
    """
    if not _resumes_universally(accelerator, saved_launch):
        yield path
        return
    import shutil

    folder = path.parent / f"{UNIVERSAL_PREFIX}{path.name}"
    saved, world, error = saved_launch["num_processes"], accelerator.num_processes, None
    if accelerator.is_main_process:
        print(f"hftrain: {path.name} was written by {saved} DeepSpeed processes; converting it to a universal "
              f"checkpoint in {folder} to resume on {world}", flush=True)
        try:
            engine_dir = next(p for p in sorted(path.iterdir()) if p.is_dir() and any(p.glob("*optim_states.pt")))
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            _convert_to_universal(engine_dir, folder / engine_dir.name)
            for item in path.iterdir():
                if item != engine_dir:
                    (folder / item.name).symlink_to(item.resolve())
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it rather than wait at a barrier
            error = f"{type(exc).__name__}: {exc}"
    from accelerate.utils import broadcast_object_list

    error = broadcast_object_list([error])[0]
    if error is not None:
        raise HftrainError(f"cannot convert the DeepSpeed checkpoint {str(path)!r} (written by {saved} processes) "
                           f"into a universal checkpoint for {world}: {error}; resume with {saved} processes")
    model._config.load_universal_checkpoint = True  # DeepSpeedEngine.load_universal_checkpoint() reads it
    try:
        yield folder
    finally:
        model._config.load_universal_checkpoint = False
    accelerator.wait_for_everyone()  # every rank has loaded: the converted copy can go
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)


def _convert_to_universal(engine_dir: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal.py in this process (no worker pool). `inject_missing_state`: transformers models
    carry no `universal_checkpoint_info`, which the converter otherwise requires (it only names TP/PP patterns)."""
    import contextlib
    import io
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = Namespace(input_folder=str(engine_dir), output_folder=str(out), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress; errors raise
        ds_to_universal(args)


def checkpoint_save_kwargs(accelerator) -> dict:
    """Arguments for `accelerator.save_state`: under DeepSpeed the engine writes the model file itself, and
    `exclude_frozen_parameters` keeps a frozen base (LoRA / QLoRA) out of it, as hftrain's pre-save hook does for
    DDP. What stays besides the trained weights is bitsandbytes' small quantization state of 4-bit layers
    (absmax, quant_map, ...), which `Linear4bit` adds to every state dict."""
    return {"exclude_frozen_parameters": True} if _selected(accelerator) == "DEEPSPEED" else {}


def checkpoint_load_kwargs(accelerator) -> dict:
    """Arguments for `accelerator.load_state` of a checkpoint holding the trained weights only (the frozen base
    comes from the builder): non-strict, so the absent frozen weights are not an error. DeepSpeed's engine takes
    `load_module_strict`; its trained weights are restored from the ZeRO partitions in any case. Which keys the
    file holds is checked beforehand (`checkpoint._check_saved_weights`), so non-strict hides nothing."""
    if _selected(accelerator) == "DEEPSPEED":
        return {"load_module_strict": False}
    return {"strict": False}


def saved_model_keys(folder: Path) -> set[str] | None:
    """State-dict keys of the model file of a checkpoint folder, or None for a layout read by its own loader
    (FSDP2's sharded torch.distributed.checkpoint). DDP / 1 process: model.safetensors; DeepSpeed: the engine's
    `*model_states.pt` (rank 0's; under ZeRO-3 every rank's file names every key, with empty tensors)."""
    model_file = folder / "model.safetensors"
    if model_file.exists():
        from safetensors import safe_open

        with safe_open(str(model_file), framework="pt") as f:
            return set(f.keys())
    deepspeed_files = sorted((folder / "pytorch_model").glob("*model_states.pt"))
    if deepspeed_files:
        import torch

        # DeepSpeed's own loader reads this file the same way (it pickles its config objects next to the tensors)
        return set(torch.load(deepspeed_files[0], map_location="cpu", weights_only=False, mmap=True)["module"])
    return None


def innermost_optimizer(optimizer) -> str:
    """Class of the optimizer doing the update under accelerate's / ZeRO's wrappers (e.g. DeepSpeedCPUAdam)."""
    while hasattr(getattr(optimizer, "optimizer", None), "param_groups"):
        optimizer = optimizer.optimizer
    return type(optimizer).__name__


def save_pretrained(accelerator, model, folder: Path) -> None:
    """Full weights as one from_pretrained folder (model files and config; the caller adds the tokenizer)."""
    lm = accelerator.unwrap_model(model).lm
    if tp_size(accelerator, model) > 1:  # every rank: transformers gathers the shards, the main process writes
        lm.save_pretrained(folder, is_main_process=accelerator.is_main_process)
        return
    state_dict = accelerator.get_state_dict(model)  # full (gathered) weights on the main process, every rank calls
    if accelerator.is_main_process:
        lm.save_pretrained(folder, state_dict={k.removeprefix("lm."): v for k, v in state_dict.items()})


def sharded_modules(model) -> list[str]:
    """Classes of the FSDP2 shard groups (fully_shard renames a module class Foo to FSDPFoo); [] otherwise."""
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")})


def deepspeed_config_used(accelerator) -> dict | None:
    """The filled DeepSpeed config DeepSpeed ran with (saved as ds_config.json), or None."""
    return accelerator.state.deepspeed_plugin.deepspeed_config if _selected(accelerator) == "DEEPSPEED" else None


def updates_inside_backward(accelerator) -> bool:
    """DeepSpeed's engine steps its optimizer inside `backward`: a bad step cannot be skipped afterwards."""
    return _selected(accelerator) == "DEEPSPEED"
