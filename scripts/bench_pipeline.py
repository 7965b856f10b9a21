"""Step time of hftrain's pipeline stages against the number of microbatches, for 1F1B and Interleaved1F1B.

    python scripts/bench_pipeline.py [--layers 8 --hidden 256 --rows 32 --length 128 --steps 4]

Two gloo processes on this machine (pp 2), a random Llama split by hftrain (`stages.split_layers`, `parallel.pipeline`'s
StageForward), torch.distributed.pipelining's schedules with scale_grads=False, the same global batch for every
microbatch count; the median of `--steps` timed steps after one warm-up step. Prints a markdown table with the
bubble formula's prediction next to it, for docs/pipeline.md. A benchmark, not a test: CPU numbers on a shared
machine are noisy, and on CPU the two processes also compete for cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2}


def worker(rank: int, args, port: int, results) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftrain.parallel.pipeline import StageForward, keep_only
    from hftrain.stages import split_layers, stage_indices

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=4, max_position_embeddings=args.length)
    rows = []
    for name, per_process in SCHEDULES.items():
        for m in args.microbatches:
            torch.manual_seed(0)
            lm = LlamaForCausalLM(config)
            count = 2 * per_process
            ranges = split_layers(args.layers, count)
            mine = stage_indices(rank, 2, per_process)
            stages = [StageForward(lm, s, count, ranges[s]) for s in mine]
            keep_only(lm, {i for s in mine for i in ranges[s]}, first=0 in mine, last=count - 1 in mine)
            head = lm.lm_head

            def loss_fn(hidden, targets, head=head):
                return torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten(),
                                                         reduction="sum")

            pipe = [PipelineStage(st, s, count, torch.device("cpu")) for st, s in zip(stages, mine, strict=True)]
            schedule = get_schedule_class(name)(pipe if per_process > 1 else pipe[0], n_microbatches=m,
                                                loss_fn=loss_fn, scale_grads=False)
            ids = torch.randint(0, 1024, (args.rows, args.length))
            times = []
            for step in range(args.steps + 1):
                dist.barrier()
                started = time.perf_counter()
                schedule.step(*((ids,) if rank == 0 else ()), target=ids if rank == 1 else None,
                              losses=[] if rank == 1 else None, return_outputs=False)
                dist.barrier()
                if step:  # the first step sizes the buffers
                    times.append(time.perf_counter() - started)
                lm.zero_grad(set_to_none=True)
            rows.append((name, m, statistics.median(times)))
    if rank == 0:
        results.extend(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[2, 4, 8, 16])
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(worker, args=(args, port, results), nprocs=2, join=True)
        rows = list(results)
    print(f"pp 2 on 2 gloo processes, Llama {args.layers} layers x hidden {args.hidden}, global batch {args.rows} rows "
          f"x {args.length} tokens, median of {args.steps} steps\n")
    print("| schedule | microbatches | step time (s) | bubble (p-1)/(v m) |")
    print("| --- | --- | --- | --- |")
    for name, m, seconds in rows:
        bubble = (2 - 1) / (SCHEDULES[name] * m)
        print(f"| {name} | {m} | {seconds:.3f} | {bubble:.1%} |")


if __name__ == "__main__":
    main()
