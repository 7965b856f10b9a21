"""DeepSpeed internals hftrain uses (checked on DeepSpeed 0.19, the version the test suite runs).

- resuming on another number of processes: `DeepSpeedEngine.load_universal_checkpoint()` reads the engine's
  private config flag `_config.load_universal_checkpoint`, which is otherwise set only from the DeepSpeed JSON
  before the engine exists (runtime/engine.py), and ZeRO-3's universal load gets several parameter groups wrong
  (runtime/zero/stage3.py: `loading_universal_checkpoint`);
- importing DeepSpeed without MLflow: the package import reaches its autotuner (autotuning/autotuner.py), whose
  optional `import mlflow` is skipped when that import fails;
- a ZeRO-3 parameter's whole shape and this process's part: once partitioned its `.data` is an empty 1-D tensor,
  the shape and size it has in the model are kept in `param.ds_shape` / `param.ds_numel` and this process's
  partition in `param.ds_tensor` (runtime/zero/partition_parameters.py).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from hftrain.compat import Use

CHECKED = ">=0.19,<0.20"

UNIVERSAL_LOAD = Use("deepspeed", CHECKED, "resuming a DeepSpeed checkpoint on another number of processes")
AUTOTUNER_MLFLOW = Use("deepspeed", CHECKED, "importing DeepSpeed without MLflow (its autotuner's optional import)")


def whole_ndim(param) -> int:
    """The number of dimensions `param` has in the model, also when ZeRO-3 holds it partitioned (its `.data` then
    an empty 1-D tensor, whatever the parameter's shape)."""
    return len(param.ds_shape) if hasattr(param, "ds_shape") else param.ndim


def whole_numel(param) -> int:
    """The number of elements `param` has in the model, also when ZeRO-3 holds it partitioned (`ds_numel`)."""
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


def is_partitioned(param) -> bool:
    """Whether ZeRO-3 holds `param` partitioned: its `.data` an empty placeholder, this process's part in
    `ds_tensor`."""
    return hasattr(param, "ds_tensor")


def local_part(param) -> torch.Tensor:
    """This process's part of `param`: ZeRO-3's partition (`ds_tensor`), else the parameter's own data."""
    return param.ds_tensor if is_partitioned(param) else param.data


def import_deepspeed_without_mlflow() -> None:
    """DeepSpeed's package import reaches its autotuner, which imports MLflow whenever it is installed, to log
    autotuning experiments: ~1 s of CPU in every process of a DeepSpeed launch. hftrain never runs DeepSpeed's
    autotuner, so DeepSpeed is imported with `mlflow` hidden from it, and `mlflow` is importable again right after
    (report_to: mlflow imports it itself). Nothing is done when either is imported already, or outside the checked
    DeepSpeed versions (the import then costs what it did)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules or AUTOTUNER_MLFLOW.problem() is not None:
        return
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this stands
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]


@contextmanager
def loading_universal_checkpoint(engine):
    """While the block runs, `engine.load_checkpoint` reads a universal checkpoint (one converted by DeepSpeed's
    ds_to_universal) instead of a per-rank one. ZeRO-3's universal load (stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3) gets two things wrong when the optimizer has several
    parameter groups (hftrain's: the decayed matrices and the undecayed rest), which ZeRO-1/2's load gets right;
    both are undone after the load:
    - it copies the first group's hyperparameters into every group: the norm weights and biases would be decayed;
    - it gives every group's state one and the same `step` tensor, which the optimizer then increments in place once
      per group at each step: AdamW's bias correction would count 2 steps for each one taken.
    """
    UNIVERSAL_LOAD.require()
    optimizer = engine.optimizer.optimizer  # the torch optimizer inside DeepSpeed's ZeRO wrapper
    decays = [group["weight_decay"] for group in optimizer.param_groups]
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
        for group, decay in zip(optimizer.param_groups, decays, strict=True):
            group["weight_decay"] = decay
        for state in optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
