"""Test-only: what transformers' tensor-parallel plan really places on each tp rank, without launching a group.

    python tests/launchers/tp_placement.py TP_SIZE MODEL_FOLDER [MODEL_FOLDER ...]

For each folder and tp rank, in a process forked after the imports: joins torch's fake process group (`torch.testing`'s
FakeStore: collectives return without communicating, shapes and placements are the real ones) as that rank, loads
MODEL_FOLDER with `DistributedConfig(tp_size=...)` (the plan hftrain's tp / pp x tp loading uses,
`parallel/tensor.model_load_kwargs`), runs one forward and backward and one AdamW step, and prints a JSON line
[folder, rank, {parameter name: [weight, gradient, optimizer-state elements on this rank]}] (each of the DTensor's
local shard; a tied head under its own name too). One rank per process: transformers keeps the mesh of the first
load.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def local_elements(tensor) -> int:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).numel()


def main(folder: str, tp: int, rank: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_size=tp))
    ids = torch.arange(16).reshape(2, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    placed = {name: [local_elements(p), local_elements(p.grad),
                     sum(local_elements(v) for k, v in optimizer.state[p].items() if k != "step")]
              for name, p in model.named_parameters(remove_duplicate=False)}
    print(json.dumps([folder, rank, placed]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    tp = int(sys.argv[1])
    for folder in sys.argv[2:]:
        for rank in range(tp):
            child = os.fork()
            if child == 0:
                main(folder, tp, rank)
                os._exit(0)
            _, status = os.waitpid(child, 0)
            if status:
                sys.exit(f"{folder}: tp rank {rank} failed (wait status {status})")
