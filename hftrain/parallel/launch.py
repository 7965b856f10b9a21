"""What `accelerate launch` asked for, read once from the environment, and the Accelerator made from it.

The launch preset (accelerate_configs/*.yaml) picks the strategy; the recipe picks precision and accumulation.
On a machine without CUDA the processes run on CPU with gloo: `Accelerator(cpu=True)` is what makes a
multi-process CPU launch a real gloo DDP group (a yaml's `use_cpu` alone is not passed on by accelerate's
launcher). DeepSpeed is the exception: `cpu=True` would silently turn it into DDP, so there the gloo backend is
requested explicitly.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import socket
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import InitProcessGroupKwargs, gather_object

from hftrain.compat.accelerate import write_stderr_past_launchers_copy
from hftrain.compat.cpython import exit_without_teardown, require_exit_without_teardown
from hftrain.compat.deepspeed import import_deepspeed_without_mlflow
from hftrain.config import Recipe
from hftrain.errors import ConfigError, HftrainError, run_tool
from hftrain.model import name_deepspeeds_cpu_accelerator
from hftrain.watchdog import set_nccl_environment


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").lower() == "true"


def read_deepspeed_config(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"cannot read the DeepSpeed config {path!r} named by the preset: {exc.strerror}"],
                          "launch preset") from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"the DeepSpeed config {path!r} is not valid JSON: {exc}"], "launch preset") from None


@dataclass(frozen=True)
class Launch:
    """The launch as `accelerate launch` (or torchrun) passed it on in the environment.

    `kind` is what the preset asked for: "single", "ddp", "fsdp2" or "deepspeed". The DeepSpeed JSON named by the
    preset is read here, once: its ZeRO stage is the one every later decision uses.
    """

    kind: str
    world: int
    per_node: int
    mixed_precision: str = "no"
    deepspeed_config_path: str | None = None
    deepspeed_config: dict | None = None
    # the preset's own parallelism_config sizes (PARALLELISM_CONFIG_*_SIZE), when it has that section: hftrain
    # builds the ParallelismConfig from the recipe and refuses a preset that says otherwise
    preset_mesh: dict[str, int] | None = None
    fsdp_offload: bool = False  # the FSDP preset's fsdp_offload_params (FSDP_OFFLOAD_PARAMS)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Launch:
        world = int(environ.get("WORLD_SIZE", "1"))
        per_node = int(environ.get("LOCAL_WORLD_SIZE", world))
        precision = environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if _flag(environ, "ACCELERATE_USE_FSDP"):
            mesh = {name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
                    for name in ("dp_replicate", "dp_shard", "tp", "cp")}
            return cls("fsdp2", world, per_node, precision,
                       preset_mesh=mesh if _flag(environ, "ACCELERATE_USE_PARALLELISM_CONFIG") else None,
                       fsdp_offload=_flag(environ, "FSDP_OFFLOAD_PARAMS"))
        if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
            path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
            path = None if path == "none" else path
            config = read_deepspeed_config(path) if path else None
            return cls("deepspeed", world, per_node, precision, path, config)
        return cls("ddp" if world > 1 else "single", world, per_node, precision)

    @classmethod
    def from_preset(cls, preset: Mapping, deepspeed_config_path: str | None = None, num_processes: int | None = None,
                    num_machines: int | None = None) -> Launch:
        """The launch an accelerate config file (a parsed preset) describes, as `from_environ` will read it in each
        process once accelerate's launcher has started them: `hftrain launch` checks it before starting any.
        `num_processes` / `num_machines`: the command line's, which override the preset's."""
        world = int(num_processes or preset.get("num_processes") or 1)
        per_node = max(world // int(num_machines or preset.get("num_machines") or 1), 1)
        precision = str(preset.get("mixed_precision") or "no")
        kind = str(preset.get("distributed_type", "NO"))
        if kind == "FSDP":
            sizes = preset.get("parallelism_config")
            mesh = {name: int(sizes.get(f"parallelism_config_{name}_size", 1))
                    for name in ("dp_replicate", "dp_shard", "tp", "cp")} if sizes else None
            offload = str((preset.get("fsdp_config") or {}).get("fsdp_offload_params", False)).lower() == "true"
            return cls("fsdp2", world, per_node, precision, preset_mesh=mesh, fsdp_offload=offload)
        if kind == "DEEPSPEED":
            config = read_deepspeed_config(deepspeed_config_path) if deepspeed_config_path else None
            return cls("deepspeed", world, per_node, precision, deepspeed_config_path, config)
        return cls("ddp" if world > 1 else "single", world, per_node, precision)

    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage of the preset's DeepSpeed JSON (None without DeepSpeed or without a stage)."""
        stage = (self.deepspeed_config or {}).get("zero_optimization", {}).get("stage")
        return int(stage) if str(stage).isdigit() else None


# Why accelerate would not select the strategy a preset asks for (`resolve` checks what it selected; the launcher
# checks the same before any process starts: `strategy_problems`)
NOT_SELECTED = {
    "FSDP": "accelerate selects FSDP only for GPU-like devices; on a CPU machine use cpu_ddp or a zero* preset",
    "DEEPSPEED": "unset ACCELERATE_USE_CPU (it turns DeepSpeed into DDP)",
}


def not_selected(wanted: str, selected: str, verb: str = "selected") -> str:
    return (f"the launch preset asks for {wanted} but accelerate {verb} {selected} on this machine, which would train "
            f"with another strategy than the one you chose; {NOT_SELECTED[wanted]}")


def strategy_problems(launch: Launch, cuda: bool, environ: Mapping[str, str] = os.environ, gpus: int = 0) -> list[str]:
    """What accelerate would select instead of the preset's strategy on this machine, known before any process
    starts: FSDP without CUDA (hftrain's CPU accelerator is never FSDP), DeepSpeed under ACCELERATE_USE_CPU; and, on
    a CUDA machine, more processes on it than the `gpus` CUDA devices it shows (accelerate 1.15 gives a process the GPU
    of its local rank modulo their count, so two would share one, which NCCL refuses as "Duplicate GPU detected";
    DeepSpeed takes the local rank's GPU, which does not exist)."""
    instead = "MULTI_CPU" if launch.world > 1 else "NO"
    if launch.kind == "fsdp2" and not cuda:
        return [not_selected("FSDP", instead, "would select")]
    if launch.kind == "deepspeed" and environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        return [not_selected("DEEPSPEED", instead, "would select")]
    return gpu_problems(launch, gpus, environ) if cuda else []


def gpu_problems(launch: Launch, gpus: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """More processes on this machine than the `gpus` CUDA devices it shows (`strategy_problems`)."""
    if launch.per_node <= gpus:
        return []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    fitting = gpus * (launch.world // launch.per_node)
    return [f"the launch starts {launch.per_node} processes on this machine but torch sees {gpus} CUDA "
            f"device{'s' * (gpus != 1)} here{shown}: each process needs a GPU of its own; pass --num_processes "
            f"{fitting} (the GPUs per machine x machines) or make the other GPUs visible"]


# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor (for all_gather_single /
# reduce_scatter_single) with a FutureWarning at every call, attributed to torch's own c10d_logger wrapper, not to the
# caller: DeepSpeed's ZeRO calls them at every gather and reduce of a partition (2,680 warnings, 5,360 lines, in
# the tiny recipe's 60 steps under ZeRO-3 on 2 CPU processes), accelerate's gather under NCCL at every call. A note to
# those libraries' authors: nothing a user changes in a recipe or preset reaches those calls.
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
# DeepSpeed's communication backend on CPU prints this line in every process when it loads its shared-memory op
DEEPSPEED_BUILT_NOTE = re.compile(r"DeepSpeed \S+ built successfully\n?")


def quiet_library_notes() -> None:
    """In a training process, before its accelerator: only torch's deprecation of those two collectives is
    ignored (by message, category and module); every other warning still shows."""
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning,
                            module=r"torch\.distributed\.")


@contextmanager
def without_deepspeed_build_notes() -> Iterator[None]:
    """While the block runs (DeepSpeed's process group being made), standard output is held and passed on after it,
    without DeepSpeed's "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" (a print, which no
    logger level reaches), one line per process of every DeepSpeed launch on CPU. Every other line is kept."""
    held = io.StringIO()
    try:
        with redirect_stdout(held):
            yield
    finally:
        kept = [line for line in held.getvalue().splitlines(keepends=True) if not DEEPSPEED_BUILT_NOTE.fullmatch(line)]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()


def make_accelerator(recipe: Recipe, launch: Launch) -> Accelerator:
    cuda = torch.cuda.is_available()
    deepspeed = launch.kind == "deepspeed"
    quiet_library_notes()
    name_deepspeeds_cpu_accelerator()
    if deepspeed:
        import_deepspeed_without_mlflow()
    # Naming a backend makes accelerate start a process group, so only DeepSpeed on CPU names one (gloo);
    # otherwise accelerate chooses (NCCL on GPU, gloo under cpu=True) and only the timeout is set.
    group = {"backend": "gloo"} if deepspeed and not cuda else {}
    set_nccl_environment(recipe.hang_timeout)  # read when the NCCL process group is created, below
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.ddp_timeout), **group)]
    problems = gpu_problems(launch, torch.cuda.device_count()) if cuda else []
    if problems:  # through plain `accelerate launch` (`hftrain launch` refuses it before starting any process)
        raise HftrainError(problems[0])
    mesh = parallelism_config(recipe, launch)
    if recipe.cp_size > 1 and not cuda:
        raise HftrainError(
            f"cp_size={recipe.cp_size} needs CUDA GPUs: accelerate builds context parallelism only under FSDP2, which "
            "it selects only for GPU-like devices, and torch's ring attention dispatches only the CUDA SDPA kernels; "
            "on CPU use sp_size with the cpu_sp preset (docs/long-context.md)")
    with without_deepspeed_build_notes() if deepspeed else nullcontext():
        return Accelerator(
            parallelism_config=mesh,
            cpu=not cuda and not deepspeed,
            mixed_precision="bf16" if recipe.bf16 else "fp16" if recipe.fp16 else "no",
            gradient_accumulation_steps=recipe.gradient_accumulation_steps,
            log_with=[t for t in recipe.report_to if t != "none"] or None,
            project_dir=recipe.output_dir,
            kwargs_handlers=handlers,
        )


def parallelism_config(recipe: Recipe, launch: Launch) -> ParallelismConfig | None:
    """accelerate's ParallelismConfig for context parallelism, from the recipe: FSDP2 shards over all
    dp_shard x cp processes, each group of cp consecutive ranks splitting its sequences. None without cp, and for
    tp x cp, whose mesh hftrain builds itself (parallel/context.py's RingAttention over tensor parallelism:
    accelerate's TP preparation imports transformers' removed ReplicateParallel)."""
    if recipe.cp_size <= 1 or recipe.tp_size > 1:
        return None
    return ParallelismConfig(dp_shard_size=launch.world // recipe.cp_size, cp_size=recipe.cp_size)


@contextmanager
def phase(accelerator, name: str | Callable[[], str], timeout: int):
    """Turn a collective timeout inside `name` into a message naming the rank and the phase (`name` may be a
    function, called when the timeout happens, e.g. to name the optimizer step)."""
    try:
        yield
    except RuntimeError as exc:  # gloo and NCCL report timeouts as RuntimeError subclasses (DistBackendError)
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise HftrainError(
            f"rank {accelerator.process_index} of {accelerator.num_processes} timed out after {timeout}s waiting for "
            f"the other ranks during {name() if callable(name) else name}; a rank may have died (see its log above) "
            "or be much slower (raise ddp_timeout if rank 0 needs longer, e.g. to tokenize a large dataset)"
        ) from None


@contextmanager
def main_process_first(accelerator, name: str = "data preparation"):
    """accelerate's `main_process_first` (the main process runs the block first, e.g. to read the datasets and fill
    their cache, then the others, from the cache), with the main process's failure passed on to the others.

    Under accelerate's, the others wait for the main process in a barrier; when it fails (a bad row, a missing
    column), it prints its error and exits, and their barrier ends in gloo's "Connection closed by peer" traceback,
    printed after its error unless the launcher stopped them first. Here the main process ends the block by telling
    the others whether it succeeded (one collective, in place of the barrier); when it did not, they leave without
    running the block, with an HftrainError that every process meets alike: silent while the launcher stops them
    (errors.report_and_exit), so the main process's error is the launch's only one. A second collective after a
    failure keeps the main process from exiting before the others have read its word."""
    if accelerator.num_processes == 1 or not torch.distributed.is_initialized():
        yield
        return
    if not accelerator.is_main_process:
        if not _main_process_succeeded(accelerator, failed=False):
            error = HftrainError(f"the main process (rank 0) failed during {name}: its error is in its output; rank "
                                 f"{accelerator.process_index} stopped with it")
            error.same_in_every_process = True
            raise error
        yield
        return
    try:
        yield
    except BaseException:
        try:
            _main_process_succeeded(accelerator, failed=True)
        except Exception:  # noqa: BLE001 - a rank already gone cannot be told; the main process's error comes first
            pass
        raise
    _main_process_succeeded(accelerator, failed=False)


def _main_process_succeeded(accelerator, failed: bool) -> bool:
    """Every process's part in the word `main_process_first` passes on: whether the main process failed (the others
    contribute False). After a failure, a second collective: once the main process is through it, every other
    process has read the word, so the main process may exit."""
    word = torch.tensor([int(failed)], device=accelerator.device)
    torch.distributed.all_reduce(word)
    if not word.item():
        return True
    try:
        torch.distributed.all_reduce(torch.zeros(1, device=accelerator.device))
    except Exception:  # noqa: BLE001 - the main process may have exited once this one joined: the word is read
        if accelerator.is_main_process:
            raise
    return False


def this_device(accelerator) -> dict:
    """The physical device this process trains on, as recorded in hftrain_state.json: host, ranks, and on CUDA the
    index within CUDA_VISIBLE_DEVICES, the GPU's name and UUID (the same GPU has the same UUID whatever the
    numbering), or the CPU."""
    record = {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
              "host": socket.gethostname(), "device": str(accelerator.device), "type": accelerator.device.type}
    if accelerator.device.type == "cuda":
        index = accelerator.device.index if accelerator.device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        record.update(index=index, name=props.name, uuid=str(getattr(props, "uuid", "")))
    else:
        record.update(name=platform.processor() or platform.machine(), uuid=None)
    return record


def shared_devices(records: list[dict]) -> list[str]:
    """Problems: processes on one host that would train on the same GPU (same UUID, or same index without one)."""
    seen, problems = {}, []
    for r in records:
        if r["type"] != "cuda":  # CPU processes share the machine's cores by design
            continue
        key = (r["host"], r.get("uuid") or r.get("index"))
        if key in seen:
            problems.append(f"ranks {seen[key]} and {r['rank']} would both train on GPU {r.get('index')} "
                            f"({r.get('name')}, {r.get('uuid') or 'no UUID'}) of host {r['host']}")
        else:
            seen[key] = r["rank"]
    return problems


def devices_record(accelerator, environ: Mapping[str, str] = os.environ) -> dict:
    """Every process's device (one gather), refused when two processes would share a GPU: two ranks on one GPU run
    at half speed each at best, and NCCL refuses or hangs on duplicate GPUs."""
    records = gather_object([this_device(accelerator)]) if accelerator.num_processes > 1 else \
        [this_device(accelerator)]
    problems = shared_devices(records)
    if problems:
        raise HftrainError(
            f"{'; '.join(problems)}: give each process its own GPU (the preset's gpu_ids or CUDA_VISIBLE_DEVICES "
            "listing as many GPUs as --num_processes per machine)"
        )
    return {"CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES"), "processes": records}


def run_process(main: Callable[[], object]) -> NoReturn:
    """Run an entry point as the whole life of this process, then exit with its code.

    A process that leaves a gloo process group to interpreter teardown can abort (SIGABRT, "terminate called without
    an active exception") after its work is done: gloo's worker threads may still hold the last collective's tensors,
    and freeing them needs the GIL of an interpreter that is being torn down (pytorch/pytorch#190489; #179291 tried
    an atexit fix in torch and was abandoned). `destroy_process_group` is no cure on CPU: ~ProcessGroupGloo joins
    those threads while the caller holds the GIL they wait for. So a distributed run, once every rank is through
    (a barrier when it succeeded), finishes what Python's exit would, in its order (`threading._shutdown`: the
    executors' exit hooks, e.g. inductor's compile pool, then the non-daemon threads such as an async checkpoint
    writer; then atexit handlers such as W&B's; the standard streams) and leaves with `os._exit`, skipping the
    teardown; the process group ends with the process, as it does when torchrun stops a group. One-process
    runs exit the ordinary way. Under accelerate 1.16's one-process launcher, the standard error is written past
    the launcher's copy of it (`write_stderr_past_launchers_copy`), so that an error shows once."""
    write_stderr_past_launchers_copy()
    run_tool(require_exit_without_teardown)
    code = 0
    try:
        main()
    except SystemExit as stop:
        if isinstance(stop.code, str):  # sys.exit("message"): Python prints it and exits 1
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as Python prints an uncaught exception
        if not _process_group_alive():
            raise
        traceback.print_exc()
        code = 1
    if not _process_group_alive():
        sys.exit(code)
    if code == 0:
        try:
            torch.distributed.barrier()
        except Exception:  # noqa: BLE001 - a peer that died has reported its own failure; this one is done
            pass
    exit_without_teardown(code)


def _process_group_alive() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
