"""accelerate internals hftrain uses (checked on accelerate 1.16, the lock's version, and 1.15, the lower end's).

- context parallelism: the forward hooks accelerate attaches to a model's attention layers under its own CP path
  (`_attach_context_parallel_hooks` in accelerate/big_modeling.py), which drop the attention mask for `is_causal`;
  hftrain runs torch's ring on its own mesh (parallel/context.py) and needs the same hooks;
- FSDP2 checkpoints: the state-dict options accelerate's own FSDP2 save uses (`_prepare_sd_options` in
  accelerate/utils/fsdp_utils.py), so that hftrain's background save writes the files accelerate would;
- saving without importing DeepSpeed: the package probe `extract_model_from_parallel` makes (the name
  `is_deepspeed_available` in accelerate/utils/other.py), answered from the imported modules while a model is saved.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import accelerate.utils.other

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


def attach_context_parallel_hooks(model) -> None:
    """accelerate's context-parallel hooks on `model`'s attention layers."""
    CP_HOOKS.require()
    _attach_context_parallel_hooks(model)


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
