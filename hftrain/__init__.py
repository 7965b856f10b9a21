"""hftrain: fine-tune causal LMs with one Accelerator loop, one typed recipe and a launch preset."""

import logging

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

# torchao (the qat extra), which transformers imports whenever it is installed, logs one warning per compiled extension
# it cannot load: on a CPU build of torch, every one of its CUDA kernels, in every process. hftrain's QAT path is plain
# PyTorch, and fp8's CUDA requirements are checked by the preflight.
logging.getLogger("torchao").addFilter(
    lambda record: not (record.getMessage().startswith("Failed to load") and "Could not load this library"
                        in record.getMessage()))
# torchao 0.18 registers its enums with torch's pytree at import, which torch 2.13 logs as deprecated (2 lines per
# process, whatever the run does): torchao's to change, nothing a user can act on.
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
