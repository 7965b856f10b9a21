"""torchao internals hftrain uses (checked on torchao 0.18.0 by reading its source; the CPU suite computes the choice
on CPU, and the float8 layers it selects run on CUDA only).

- `_auto_filter_for_recipe` (torchao/float8/float8_linear_utils.py): the module_filter_fn torchao recommends for a
  float8 recipe: nn.Linear layers whose dimensions are multiples of 16 (the float8 matmul's requirement) and large
  enough for float8 to pay on H100 (tensorwise: not K <= 4096 with N <= 1024; rowwise: N > 2048, K > 1024 and not
  N <= 4096 with K <= 2048), minus the fully qualified names listed. Marked experimental in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable

from hftrain.compat import Use

CHECKED = ">=0.18.0,<0.19"

FLOAT8_FILTER = Use("torchao", CHECKED, "fp8 (torchao's choice of the linear layers worth float8 for a recipe)")


def float8_layer_filter(recipe_name: str, skipped: list[str]) -> Callable:
    """torchao's module_filter_fn for `recipe_name` (tensorwise, rowwise), never choosing a name containing one of
    `skipped`."""
    FLOAT8_FILTER.require()
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe_name, skipped)
