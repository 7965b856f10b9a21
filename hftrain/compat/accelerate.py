"""accelerate internals hftrain uses (checked on accelerate 1.15, the version the test suite runs).

- context parallelism: the forward hooks accelerate attaches to a model's attention layers under its own CP path
  (`_attach_context_parallel_hooks` in accelerate/big_modeling.py), which drop the attention mask for `is_causal`;
  hftrain runs torch's ring on its own mesh (parallel/context.py) and needs the same hooks;
- FSDP2 checkpoints: the state-dict options accelerate's own FSDP2 save uses (`_prepare_sd_options` in
  accelerate/utils/fsdp_utils.py), so that hftrain's background save writes the files accelerate would.
"""

from __future__ import annotations

from hftrain.compat import Use

try:  # private, so each may be missing from another accelerate: `require` says so before either is used
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from accelerate.utils.fsdp_utils import _prepare_sd_options
except ImportError:
    _attach_context_parallel_hooks = _prepare_sd_options = None

CHECKED = ">=1.15,<1.16"

CP_HOOKS = Use("accelerate", CHECKED, "context parallelism (accelerate's attention-mask hooks)")
FSDP2_STATE_DICT = Use("accelerate", CHECKED, "FSDP2 checkpoints (accelerate's state-dict options)")


def attach_context_parallel_hooks(model) -> None:
    """accelerate's context-parallel hooks on `model`'s attention layers."""
    CP_HOOKS.require()
    _attach_context_parallel_hooks(model)


def fsdp_state_dict_options(fsdp_plugin):
    """The `StateDictOptions` accelerate's FSDP2 save and load use for `fsdp_plugin`."""
    FSDP2_STATE_DICT.require()
    return _prepare_sd_options(fsdp_plugin)
