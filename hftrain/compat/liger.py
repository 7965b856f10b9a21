"""Liger kernel internals hftrain uses (checked on liger-kernel 0.8.5 by reading its source: CUDA only, so the CPU
suite does not run it).

- `_apply_liger_kernel_to_instance` (liger_kernel/transformers/monkey_patch.py): Liger's kernels on an already loaded
  model of any supported architecture; its public `apply_liger_kernel_to_<arch>` functions patch one architecture's
  classes before loading.
"""

from __future__ import annotations

from hftrain.compat import Use

CHECKED = ">=0.8.5,<0.9"

INSTANCE_KERNELS = Use("liger-kernel", CHECKED, "use_liger_kernel (Liger's kernels on the loaded model)")


def apply_liger_kernel_to_instance(model, **kernels) -> None:
    """Liger's kernels (`kernels`: rope, rms_norm, swiglu, ... -> bool) in the loaded `model`."""
    INSTANCE_KERNELS.require()
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **kernels)
