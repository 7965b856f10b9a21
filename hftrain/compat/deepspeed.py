"""DeepSpeed internals hftrain uses (checked on DeepSpeed 0.19, the version the test suite runs).

- resuming on another number of processes: `DeepSpeedEngine.load_universal_checkpoint()` reads the engine's
  private config flag `_config.load_universal_checkpoint`, which is otherwise set only from the DeepSpeed JSON
  before the engine exists (runtime/engine.py);
- importing DeepSpeed without MLflow: the package import reaches its autotuner (autotuning/autotuner.py), whose
  optional `import mlflow` is skipped when that import fails.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from hftrain.compat import Use

CHECKED = ">=0.19,<0.20"

UNIVERSAL_LOAD = Use("deepspeed", CHECKED, "resuming a DeepSpeed checkpoint on another number of processes")
AUTOTUNER_MLFLOW = Use("deepspeed", CHECKED, "importing DeepSpeed without MLflow (its autotuner's optional import)")


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
    ds_to_universal) instead of a per-rank one."""
    UNIVERSAL_LOAD.require()
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
