"""Test-only entry point: context parallelism (cp_size, torch ring attention) on a CPU machine.

Two things stand between hftrain's cp path and a CPU test machine, and this launcher supplies both, outside the
product code:
1. accelerate selects FSDP only for GPU-like devices: FSDP2 is forced exactly as `fsdp2_on_cpu.py` does.
2. torch 2.13's ring attention (`torch.distributed.tensor.experimental._context_parallel`) dispatches the CUDA SDPA
   kernels only (flash, memory-efficient, cuDNN); on CPU, `scaled_dot_product_attention` runs
   `aten._scaled_dot_product_flash_attention_for_cpu`, for which the ring has no handler. This launcher registers
   one: torch's own ring (`_templated_ring_attention` and its backward, with the load balancer and the
   logsumexp merge) driving the CPU flash kernel in place of the CUDA one. Nothing of the ring is written here.
Everything else -- accelerate's ParallelismConfig mesh, `maybe_context_parallel` sharding the buffers, its
attention-mask hooks, FSDP2 over dp_shard x cp, hftrain's shifted labels and group loss -- is the product path.
Used as `accelerate launch --config_file accelerate_configs/fsdp2_cp.yaml --num_processes 2
tests/launchers/context_parallel_on_cpu.py --config ... --cp_size 2`, and for tp x cp with `--tp_size 2` on 4
processes (no accelerate mesh then: the backend builds its own, as on GPUs).
"""

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from fsdp2_on_cpu import force_fsdp2  # noqa: E402  (this folder is on sys.path)
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: E402

from hftrain.finetune import Finetune, main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402
from hftrain.parallel.launch import make_accelerator, parallelism_config  # noqa: E402

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # [batch, heads, sequence, head_dim], as torch's ring handlers hard-code it


def ring_on_cpu(op_call, args, kwargs):
    """DTensor handler for the CPU flash kernel and its backward: the local shards through torch's ring."""
    mesh = args[0].device_mesh
    args = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    kwargs = dict(kwargs)
    if kwargs.pop("attn_mask", None) is not None:
        raise NotImplementedError("ring attention with an attention mask")
    group = mesh.get_group()
    if op_call is FORWARD:
        query, key, value, *rest = args
        kwargs.update(zip(("dropout_p", "is_causal"), rest))
        results = _attention._templated_ring_attention(group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
                                                       query, key, value, **kwargs)
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args
        results = _attention._templated_ring_attention_backward(
            group, SEQ_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, **kwargs)
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in results)


_attention.custom_ops[FORWARD] = ring_on_cpu  # merged into DTensor's handlers whenever a cp context opens
_attention.custom_ops[BACKWARD] = ring_on_cpu


class ContextParallelOnCPU(Finetune):
    def make_accelerator(self, launch):
        """hftrain's CPU accelerator, forced to FSDP2, then given the mesh hftrain builds from the recipe (accelerate
        refuses a ParallelismConfig in the constructor of a CPU accelerator, before FSDP is forced)."""
        assert launch.kind == "fsdp2", "launch with an FSDP preset"
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # let hftrain build its CPU (gloo) accelerator
        accelerator = make_accelerator(dataclasses.replace(self.recipe, cp_size=1), launch)
        force_fsdp2(accelerator)
        config = parallelism_config(self.recipe, launch)
        if config is None:  # tp x cp: hftrain builds its ("dp", "cp", "tp") mesh itself, in the backend
            return accelerator
        state = AcceleratorState()
        state.parallelism_config = config
        state.device_mesh = config.get_device_mesh("cpu")
        config._validate_accelerator(accelerator)
        return accelerator


if __name__ == "__main__":
    run_process(lambda: main(runner=ContextParallelOnCPU))
