"""accelerate internals hftrain uses (checked on accelerate 1.16, the lock's version, and 1.15, the lower end's).

- context parallelism: the forward hooks accelerate attaches to a model's attention layers under its own CP path
  (`_attach_context_parallel_hooks` in accelerate/big_modeling.py), which drop the attention mask for `is_causal`;
  hftrain runs torch's ring on its own mesh (parallel/context.py) and needs the same hooks;
- FSDP2 checkpoints: the state-dict options accelerate's own FSDP2 save uses (`_prepare_sd_options` in
  accelerate/utils/fsdp_utils.py), so that hftrain's background save writes the files accelerate would;
- saving without importing DeepSpeed: the package probe `extract_model_from_parallel` makes (the name
  `is_deepspeed_available` in accelerate/utils/other.py), answered from the imported modules while a model is saved;
- DDP's `find_unused_parameters` decided once the model is built: the `DistributedDataParallelKwargs` handler
  `Accelerator.prepare_model` reads from `accelerator.ddp_handler` (set from `kwargs_handlers` at construction);
- one-process launches (1.16): the launcher's copy of the process's standard error (`_run_subprocess` in
  accelerate/commands/launch.py), which the process writes past (`write_stderr_past_launchers_copy`).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import accelerate.utils.other
import psutil
from accelerate.utils import DistributedDataParallelKwargs

from hftrain.compat import Use

try:  # private, so each may be missing from another accelerate: `require` says so before either is used
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from accelerate.utils.fsdp_utils import _prepare_sd_options
except ImportError:
    _attach_context_parallel_hooks = _prepare_sd_options = None

CHECKED = ">=1.15,<1.17"

CP_HOOKS = Use("accelerate", CHECKED, "context parallelism (accelerate's attention-mask hooks)")
FSDP2_STATE_DICT = Use("accelerate", CHECKED, "FSDP2 checkpoints (accelerate's state-dict options)")
UNWRAP_PROBE = Use("accelerate", CHECKED, "saving a model without importing DeepSpeed (accelerate's unwrap probe)")
DDP_HANDLER = Use("accelerate", CHECKED, "DDP over parameters the model may not use (accelerate's ddp_handler)")
LAUNCHER_COPY = Use("accelerate", ">=1.16,<1.17", "showing a one-process launch's errors once (accelerate's copy)")


def attach_context_parallel_hooks(model) -> None:
    """accelerate's context-parallel hooks on `model`'s attention layers."""
    CP_HOOKS.require()
    _attach_context_parallel_hooks(model)


def find_unused_parameters(accelerator) -> None:
    """The next `accelerator.prepare` wraps the model in DDP with `find_unused_parameters=True`, the other DDP
    settings kept."""
    DDP_HANDLER.require()
    kwargs = accelerator.ddp_handler.to_kwargs() if accelerator.ddp_handler is not None else {}
    accelerator.ddp_handler = DistributedDataParallelKwargs(**{**kwargs, "find_unused_parameters": True})


def fsdp_state_dict_options(fsdp_plugin):
    """The `StateDictOptions` accelerate's FSDP2 save and load use for `fsdp_plugin`."""
    FSDP2_STATE_DICT.require()
    return _prepare_sd_options(fsdp_plugin)


@contextmanager
def deepspeed_probed_by_import() -> Iterator[None]:
    """transformers' save_pretrained unwraps the model with accelerate's `extract_model_from_parallel`, which imports
    DeepSpeed whenever the package is installed (and DeepSpeed imports MLflow, for its autotuner) only to ask whether
    the model is a DeepSpeedEngine: ~1.5 s of CPU at the end of every run and merge that never used DeepSpeed. A
    model can only be a DeepSpeedEngine once deepspeed has been imported, so inside this block the probe asks
    `sys.modules` instead of the package index; a DeepSpeed run (deepspeed imported) is unwrapped as before. Outside
    the checked accelerate versions nothing is changed (the save only costs the import)."""
    probe = getattr(accelerate.utils.other, "is_deepspeed_available", None)
    if probe is None or UNWRAP_PROBE.problem() is not None:
        yield
        return
    accelerate.utils.other.is_deepspeed_available = lambda: "deepspeed" in sys.modules
    try:
        yield
    finally:
        accelerate.utils.other.is_deepspeed_available = probe


def write_stderr_past_launchers_copy() -> None:
    """accelerate 1.16's one-process launcher reads the process's standard error through a pipe, writes it on to its
    own, and keeps the last 512 KiB, which it raises again when the process fails (`CalledProcessError` from
    `RuntimeError(<that text>)`), so every error of a one-process `accelerate launch` was printed twice. When this
    process's standard error is that pipe (the launcher, `accelerate launch` by its command line, holds its read end)
    and the launcher's own standard error is a terminal or a pipe, this process writes there directly instead: its
    text shows once, as under accelerate 1.15, and the launcher's traceback after it only says that the process
    exited non-zero. A launcher writing into a file is left as it is (a second writer without the launcher's file
    offset would overwrite its text), as is every other case: 1.15, torchrun's workers, not Linux."""
    if not sys.platform.startswith("linux") or LAUNCHER_COPY.problem() is not None:
        return
    try:
        ours = os.fstat(2)
    except OSError:
        return
    if not stat.S_ISFIFO(ours.st_mode):
        return
    launcher = _reader_of(f"pipe:[{ours.st_ino}]")
    if launcher is None:
        return
    target = f"/proc/{launcher}/fd/2"
    try:
        mode = os.stat(target).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return
        fd = os.open(target, os.O_WRONLY)
    except OSError:
        return
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


def _reader_of(pipe: str) -> int | None:
    """The pid of an `accelerate launch` process that holds `pipe` ("pipe:[inode]") open for reading, if any."""
    for process in psutil.process_iter(["pid", "cmdline"]):
        words = process.info["cmdline"] or []
        if not any(word.endswith(("accelerate", "accelerate.commands.launch")) for word in words):
            continue
        try:
            for fd in os.listdir(f"/proc/{process.pid}/fd"):
                if os.readlink(f"/proc/{process.pid}/fd/{fd}") == pipe:
                    with open(f"/proc/{process.pid}/fdinfo/{fd}") as info:
                        flags = int(info.read().split("flags:")[1].split()[0], 8)
                    if flags & os.O_ACCMODE == os.O_RDONLY:
                        return process.pid
        except (OSError, IndexError, ValueError):
            continue
    return None
