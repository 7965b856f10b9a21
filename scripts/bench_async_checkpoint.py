"""Training stall per checkpoint, synchronous against async_checkpointing, for a model whose checkpoint is > 200 MB.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_async_checkpoint.py [--out /tmp/bench-async] [--reps 2]

Builds a random Llama of ~22M parameters (hidden 512, 8 layers, tiny-llama's tokenizer): fp32 weights and AdamW's two
moments make a ~250 MB checkpoint. Then trains it with `python hftrain/finetune.py` (one process, the local disk)
for 12 steps with a checkpoint every 3 steps, once with `async_checkpointing: false` and once with `true`, repetitions
alternating, each run in a fresh process. A `Finetune` subclass (here, not in hftrain/) times what the loop waits for:

- stall: each periodic `save_checkpoint` call from the loop: for a synchronous save the whole save; for an async
  one the wait for the previous save (if still in flight), the RNG files and the copy of the state into CPU memory;
- end wait: the wait for the last background save before the final model is written (async only);
- step: the median time of an optimizer step with no save just before or after it, and the mean of the steps right
  after a save (which run beside the background write);
- train: the whole training phase (steps + saves + end wait).

Prints a markdown table (and writes it to OUT/results.md) with the machine's load average before and after.

`--storage_mb_per_s N` simulates slower storage (a network file system, a busy disk) in the training process: every
`os.fsync` (hftrain seals each checkpoint file with one) sleeps the file's size / N after the real fsync, the way a
flush of dirty pages to slow storage blocks. On a local disk with a large page cache the write itself is a memory copy,
as is staging, so the two modes can only differ where the storage is slower than memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS, EVERY = 12, 3


def simulate_storage(mb_per_s: float) -> None:
    """Every fsync also waits as long as writing the file at `mb_per_s` would take (see the module docstring)."""
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        real_fsync(fd)
        time.sleep(os.fstat(fd).st_size / (mb_per_s * 2**20))

    os.fsync = slow_fsync


def run_one(model: Path, out: Path, mode: str, result: Path, storage_mb_per_s: float) -> None:
    """One training run in this process, timed by a Finetune subclass; the numbers go to `result` as JSON."""
    sys.path.insert(0, str(REPO))
    from hftrain.finetune import Finetune, main

    if storage_mb_per_s:
        simulate_storage(storage_mb_per_s)

    timings: dict = {"stalls": [], "waits": [], "steps": []}

    class Timed(Finetune):
        def save_checkpoint(self, background: bool = False):
            started = time.perf_counter()
            path = super().save_checkpoint(background)
            timings["stalls"].append(time.perf_counter() - started)
            return path

        def train(self) -> None:
            wait, step = self.saves.wait, self.train_step

            def timed_wait() -> None:
                started = time.perf_counter()
                wait()
                timings["waits"].append(time.perf_counter() - started)

            def timed_step(*args):
                started = time.perf_counter()
                result = step(*args)
                timings["steps"].append(time.perf_counter() - started)
                return result

            self.saves.wait, self.train_step = timed_wait, timed_step
            started = time.perf_counter()
            super().train()
            timings["train"] = time.perf_counter() - started
            timings["megabytes"] = sum(f.stat().st_size for f in (out / f"checkpoint-{STEPS}").rglob("*")
                                       if f.is_file()) / 2**20

    main(["--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--model_name_or_path", str(model),
          "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps", str(STEPS),
          "--save_steps", str(EVERY), "--save_total_limit", "2", "--per_device_train_batch_size", "2",
          "--max_length", "128", "--validation_split_percentage", "0", "--eval_steps", "none",
          "--logging_steps", "1", "--checkpoint_preflight", "false", "--disable_tqdm", "true",
          "--async_checkpointing", "true" if mode == "async" else "false"], runner=Timed)
    # the end-of-training wait is the last wait; the others happened inside the stalls
    timings["end_wait"] = timings["waits"][-1] if mode == "async" and timings["waits"] else 0.0
    result.write_text(json.dumps(timings))


def summarize(runs: dict[str, list[dict]]) -> str:
    rows = ["| mode | checkpoint | stall per checkpoint (mean, min-max) | end-of-training wait | step, no save near "
            "(median) | step right after a save (mean) | training phase |", "|" + " --- |" * 7]
    for mode, results in runs.items():
        stalls = [s for r in results for s in r["stalls"]]
        saved_after = {EVERY * k for k in range(1, STEPS // EVERY + 1)}
        plain = [t for r in results for i, t in enumerate(r["steps"], start=1)
                 if i not in saved_after and i - 1 not in saved_after]
        after = [t for r in results for i, t in enumerate(r["steps"], start=1) if i - 1 in saved_after]
        rows.append(f"| {mode} | {results[0]['megabytes']:.0f} MB | {statistics.mean(stalls):.2f} s "
                    f"({min(stalls):.2f}-{max(stalls):.2f}) | {statistics.mean(r['end_wait'] for r in results):.2f} s "
                    f"| {statistics.median(plain):.2f} s | {statistics.mean(after):.2f} s "
                    f"| {statistics.mean(r['train'] for r in results):.1f} s |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-async"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--storage_mb_per_s", type=float, default=0.0,
                        help="simulate storage this slow (every fsync waits size / this); 0: the real disk")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "MODE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, mode, result = args.one
        run_one(Path(model), Path(result).parent / f"run-{mode}", mode, Path(result), args.storage_mb_per_s)
        return
    model = args.out / "model"
    if not model.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model), "--hidden_size",
                        "512", "--num_layers", "8", "--num_heads", "8", "--tokenizer", str(REPO / "models" /
                                                                                          "tiny-llama")], check=True)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"synchronous": [], "async": []}
    for rep in range(args.reps):
        for mode in (("sync", "async") if rep % 2 == 0 else ("async", "sync")):
            result = args.out / f"rep{rep}-{mode}" / "result.json"
            result.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, __file__, "--one", str(model), mode, str(result), "--storage_mb_per_s",
                            str(args.storage_mb_per_s)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            runs["async" if mode == "async" else "synchronous"].append(json.loads(result.read_text()))
    table = summarize(runs)
    storage = f"storage simulated at {args.storage_mb_per_s:g} MB/s" if args.storage_mb_per_s else "the local disk"
    conditions = (f"{storage}, {args.reps} runs per mode, {os.cpu_count()} CPU cores, load average "
                  f"{load_before[0]:.1f} before and {os.getloadavg()[0]:.1f} after")
    (args.out / "results.md").write_text(f"{table}\n\n{conditions}\n")
    print(f"{table}\n\n{conditions}")


if __name__ == "__main__":
    main()
