"""DeepSpeed internals hftrain uses (checked on DeepSpeed 0.19, the version the test suite runs).

- resuming on another number of processes: `DeepSpeedEngine.load_universal_checkpoint()` reads the engine's
  private config flag `_config.load_universal_checkpoint`, which is otherwise set only from the DeepSpeed JSON
  before the engine exists (runtime/engine.py).
"""

from __future__ import annotations

from contextlib import contextmanager

from hftrain.compat import Use

CHECKED = ">=0.19,<0.20"

UNIVERSAL_LOAD = Use("deepspeed", CHECKED, "resuming a DeepSpeed checkpoint on another number of processes")


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
