"""What of a GPU's memory a run may fill: the total less the CUDA context and communication buffers, less what
fragmentation takes."""

from __future__ import annotations

from hftrain.memory import GIB

CUDA_OVERHEAD_GIB = 1.0
USABLE_FRACTION = 0.9


def usable_bytes(gpu_memory_gib: float) -> float:
    return (gpu_memory_gib - CUDA_OVERHEAD_GIB) * USABLE_FRACTION * GIB
