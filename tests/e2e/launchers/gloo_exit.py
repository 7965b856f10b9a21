"""Test launcher: gloo collectives on the world and two sub-groups, then leave through `run_process`.

    torchrun --standalone --nproc_per_node 4 tests/e2e/launchers/gloo_exit.py <folder> <exit code>

Without `run_process` this script aborts in interpreter teardown on a few launches in ten ("terminate called without
an active exception", pytorch/pytorch#190489). Each rank also leaves work for Python's exit to finish: a non-daemon
thread that writes `<folder>/thread-<rank>` half a second later, a thread pool left running (its idle worker ends only
when Python's exit tells executors to stop, as inductor's compile pool under torch_compile), an atexit handler that
writes `<folder>/atexit-<rank>` and a line on stdout that is not flushed.
"""

import atexit
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hftrain.parallel import run_process  # noqa: E402

FOLDER, EXIT_CODE = Path(sys.argv[1]), int(sys.argv[2])
POOL = ThreadPoolExecutor(max_workers=1)


def body() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group(list(range(world // 2))), dist.new_group(list(range(world // 2, world)))]
    for _ in range(20):
        tensor = torch.full((1000,), float(rank))
        dist.all_reduce(tensor)
        gathered = [torch.empty(1000) for _ in range(world)]
        dist.all_gather(gathered, tensor)
        for group in halves:
            if rank in dist.get_process_group_ranks(group):
                dist.all_reduce(tensor, group=group)

    def late_write() -> None:
        time.sleep(0.5)
        (FOLDER / f"thread-{rank}").write_text("written")

    threading.Thread(target=late_write).start()
    POOL.submit(time.sleep, 0.1)  # never shut down (and referenced): only Python's exit stops its worker
    atexit.register(lambda: (FOLDER / f"atexit-{rank}").write_text("written"))
    print(f"rank {rank} done", end="\n", flush=False)
    sys.exit(EXIT_CODE)


run_process(body)
