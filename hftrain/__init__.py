"""hftrain: fine-tune causal LMs with one Accelerator loop, one typed recipe and a launch preset."""

import logging
import sys

__version__ = "0.1.0"

# On AVX512-BF16 CPUs, importing bitsandbytes warns that its optional bf16 CPU kernel (the `kernels` package) is
# missing. That kernel only serves repacked 4-bit weights, and hftrain keeps them in their training layout
# (hftrain.model.keep_4bit_layout), so the warning concerns a path hftrain never takes.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# With the `kernels` package installed (a dependency of transformers 5.25), that import asks the hub for the kernel
# instead, and offline `kernels` warns that it skips the kernel's publisher check: the same path, the same reason.
logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: "kernels-community/quantization-bitsandbytes" not in record.getMessage())

# DTensor warns at every redistribution across two mesh dimensions that it needs two collectives ("This is
# suboptimal ... flatten mesh dimensions"): on every step of FSDP2 x TP and of expert parallelism, whose meshes
# transformers builds. It is advice to the mesh's builder, repeated per rank and step, with nothing a user can change.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# With torchao installed (the qat extra), transformers imports it whenever it loads (its torchao quantizer), and
# torchao's import warns once per compiled extension it cannot load: on a machine without CUDA, its CUDA kernels, which
# neither QAT's fake quantization nor its int4 conversion on CPU use. Its import also registers two enums with torch's
# pytree, which torch 2.13 calls deprecated. Both are about torchao's packaging, printed at every run, with nothing a
# user can change; a failure to load an extension on a CUDA machine is still shown.
logging.getLogger("torchao").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load") or _cuda_machine())
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage())


def _cuda_machine() -> bool:
    """Whether this machine has a CUDA GPU (asked when torchao logs: torch is imported by then)."""
    return sys.modules["torch"].cuda.is_available()
