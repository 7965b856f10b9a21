"""Run by test_deepspeed.py: where DeepSpeed itself keeps the gradients under ZeRO-Offload (optimizer offload), read
off its engines on 2 gloo processes on the CPU, for stages 1, 2 and 3, in bf16 mixed precision, after one step.

    python tests/unit/parallel/zero_offload_buffers.py PORT OUT.json

Rank 0 writes OUT.json: {stage: {"elements", "bytes"}} for the gradient partition the CPU optimizer steps (stages 1-2:
the fp32 master partition's `.grad`; stage 3: `grad_partitions_flat_buffer`), per process. (A file, not stdout, where
the other rank's DeepSpeed prints land in any order.)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

SIZES = ((64, 48), (48, 32))  # two Linear layers: 4,688 parameters


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in SIZES))


def gradient_partition(optimizer, stage: int) -> torch.Tensor:
    if stage < 3:
        (partition,) = optimizer.single_partition_of_fp32_groups
        return partition.grad
    return optimizer.grad_partitions_flat_buffer


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    found = {}
    for stage in (1, 2, 3):
        net = model()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "zero_force_ds_cpu_optimizer": False,
                  "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
        engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()),
                                                       config=config)
        loss = engine(torch.randn(1, SIZES[0][0], dtype=torch.bfloat16)).float().square().mean()
        engine.backward(loss)
        engine.step()
        grad = gradient_partition(optimizer, stage)
        found[stage] = {"elements": grad.numel(),
                        "bytes": grad.numel() * grad.element_size()}
        engine.destroy()
    # both ranks done before either leaves: a rank exiting while its peer still talks to it aborts the peer
    torch.distributed.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
