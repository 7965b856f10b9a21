"""Asynchronous GRPO against synchronous GRPO (and TRL 1.16's synchronous GRPOTrainer) on CPU: completions/s with one
core for the trainer and one for the rollout worker, over a sweep of the generation / training time ratio.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_async_grpo.py [--steps 16 --reps 3 --lengths 4 8 16 --trl-lengths 8]
    ... --write-docs   # also replace the marked section of docs/benchmarks.md

Contenders (models/tiny-llama, the prompts, reward and settings of scripts/bench_grpo.py, i.e. recipes/tiny-grpo.yaml:
16 completions per optimizer step, 2 prompts x num_generations 8, AdamW lr 1e-2, seed 42), each run a fresh process
with one torch thread (OMP_NUM_THREADS=1; the rollout worker sets one thread itself):

- sync: hftrain's objective grpo (every step waits for its own generation), the process pinned to --trainer-cpu;
- async: the same with async_generation true, max_staleness 1, weight_sync_steps 1 and the default correction
  (sequence_mask): the trainer pinned to --trainer-cpu, its rollout worker (the process multiprocessing's spawn
  starts) moved to --worker-cpu as soon as it appears (every thread of it; it has not loaded torch yet then);
- trl: TRL's GRPOTrainer on the same prompts and model, pinned to --trainer-cpu (only at --trl-lengths: it is the
  slowest contender, and its comparison is at the main setting).

The sweep changes max_completion_length (--lengths): generation time grows with it while a training step grows less,
so the share of a synchronous step spent generating moves, and with it the gain the worker can give: at best
(g + t) / max(g, t) for generation time g and the rest of a step t (2x at g = t).

Measured per run, over steps 2..N (step 1 holds the warm-up): completions/s = 16 x (N - 1) / the wall-clock time
from the end of step 1 to the end of step N. hftrain: from `device_hours` in its metrics.jsonl rows (wall-clock time
since the run started, at each step's row; logging_steps 1), so logging counts for both contenders; TRL: between its
`on_step_end` callbacks. Also, from hftrain's metrics: the synchronous run's generation share (generation_time /
step_time: sampling, scoring, rollouts.jsonl rows), and for the asynchronous run the trainer's wait on the worker's
queue (perf/rollout_wait_s), the worker's time sampling a window (rollout/worker_busy_s) and waiting for weights or
room (rollout/worker_idle_s), and the trainer's step_time. The machine's load average is recorded before each run.
Repetitions alternate: for each rep, for each length, the contenders in turn. Results: OUT/bench_async_grpo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import bench_grpo  # noqa: E402 - the shared settings, prompts and TRL runner

BEGIN = "<!-- async grpo bench: begin (written by scripts/bench_async_grpo.py) -->"
END = "<!-- async grpo bench: end -->"
COMPLETIONS_PER_STEP = bench_grpo.SETTINGS["per_device_train_batch_size"]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def pin_worker(trainer, cpu: int) -> bool:
    """Move the trainer's rollout worker (its child started by multiprocessing's spawn: `spawn_main` in its command
    line) and every thread of it to `cpu` as soon as it appears; False if the trainer ended without one."""
    while trainer.poll() is None:
        for pid in children(trainer.pid):
            try:
                if b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {cpu})
            except OSError:
                continue
            return True
        time.sleep(0.02)
    return False


def run_hftrain(model: Path, prompts: Path, steps: int, out: Path, trainer_cpu: int, worker_cpu: int | None,
                tree: Path = REPO, **extra) -> dict:
    recipe = dict(model_name_or_path=str(model), dataset_name=str(prompts), objective="grpo",
                  reward_funcs=[bench_grpo.REWARD], optim="adamw_torch", max_steps=steps, logging_steps=1,
                  output_dir=str(out), overwrite_output_dir=True, eval_strategy="no", save_strategy="no",
                  report_to=["none"], disable_tqdm=True, **bench_grpo.SETTINGS, **extra)
    path = out.parent / f"{out.name}-recipe.json"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    proc = subprocess.Popen([sys.executable, "-m", "hftrain.finetune", "--config", str(path)], cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {trainer_cpu}))
    pinned = pin_worker(proc, worker_cpu) if worker_cpu is not None else None
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(stderr[-3000:])
    if pinned is False:
        raise SystemExit("the asynchronous run started no rollout worker to pin")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if "step_time" in r}
    assert sorted(train) == list(range(1, steps + 1)), sorted(train)
    steady = [train[s] for s in range(2, steps + 1)]

    def total(key):
        return sum(r.get(key, 0.0) for r in steady)

    return {"steps": len(train), "steady_s": (train[steps]["device_hours"] - train[1]["device_hours"]) * 3600,
            "step_time_s": total("step_time"), "generation_s": total("generation_time"),
            "forward_backward_s": total("forward_backward_time"),
            **{name: statistics.median(r[key] for r in steady) for name, key in (
                ("rollout_wait_s", "perf/rollout_wait_s"), ("worker_busy_s", "rollout/worker_busy_s"),
                ("worker_idle_s", "rollout/worker_idle_s")) if key in steady[0]}}


RUNNERS = {
    "sync": lambda model, prompts, steps, out, cpus, tree: run_hftrain(model, prompts, steps, out, cpus[0], None),
    "async": lambda model, prompts, steps, out, cpus, tree: run_hftrain(model, prompts, steps, out, cpus[0], cpus[1],
                                                                        async_generation=True, max_staleness=1),
    # the same asynchronous run with the hftrain of another checkout (--base-tree: e.g. before a change)
    "async-base": lambda model, prompts, steps, out, cpus, tree: run_hftrain(
        model, prompts, steps, out, cpus[0], cpus[1], tree, async_generation=True, max_staleness=1),
    "trl": lambda model, prompts, steps, out, cpus, tree: bench_grpo.run_trl(model, prompts, steps, out),
}


def one_run(name: str, length: int, rep: int, args, prompts: Path) -> dict:
    tag = f"{name}-len{length}-{rep}"
    result = args.out / f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", name, "--model", str(args.model), "--steps",
           str(args.steps), "--prompts", str(prompts), "--result", str(result), "--out", str(args.out / tag),
           "--lengths", str(length), "--trainer-cpu", str(args.trainer_cpu), "--worker-cpu", str(args.worker_cpu),
           *(["--base-tree", str(args.base_tree)] if args.base_tree else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{tag} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    data = json.loads(result.read_text())
    row = {"contender": name, "length": length, "rep": rep, "wall_s": wall, "load": load,
           "completions_per_s": COMPLETIONS_PER_STEP * (args.steps - 1) / data["steady_s"], **data}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                      if not isinstance(v, list)}), flush=True)
    return row


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def table(runs: list[dict], lengths: list[int]) -> list[str]:
    lines = ["| max_completion_length | sync: generation share | ideal gain | sync c/s | async c/s | trl c/s | "
             "async / sync | async / trl | async: trainer wait (s/step) | async: worker busy (s/window) | "
             "async: trainer step_time (s) | sync: step_time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        by = {name: [r for r in runs if r["contender"] == name and r["length"] == length]
              for name in ("sync", "async", "trl")}
        sync, asyn, trl = by["sync"], by["async"], by["trl"]
        share = statistics.median(r["generation_s"] / r["step_time_s"] for r in sync)
        ideal = 1 / max(share, 1 - share)
        cps = {name: median(rs, "completions_per_s") for name, rs in by.items()}

        def per_step(rs: list[dict], key: str) -> float:
            return statistics.median(r[key] / (r["steps"] - 1) for r in rs)

        lines.append(
            f"| {length} | {share:.0%} | {ideal:.2f}x | {cps['sync']:.1f} | {cps['async']:.1f} | "
            + (f"{cps['trl']:.1f}" if trl else "-") + f" | {cps['async'] / cps['sync']:.2f}x | "
            + (f"{cps['async'] / cps['trl']:.2f}x" if trl else "-")
            + f" | {median(asyn, 'rollout_wait_s'):.3f} | {median(asyn, 'worker_busy_s'):.3f} | "
            f"{per_step(asyn, 'step_time_s'):.3f} | {per_step(sync, 'step_time_s'):.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--trl-lengths", type=int, nargs="*", default=[8])
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--worker-cpu", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-async-grpo"))
    parser.add_argument("--base-tree", type=Path, help="also run async with the hftrain of this checkout (at "
                        "--trl-lengths; e.g. `git archive main | tar -x -C DIR`), contender async-base")
    parser.add_argument("--write-docs", action="store_true", help="replace the marked section of docs/benchmarks.md")
    parser.add_argument("--run", choices=list(RUNNERS), help=argparse.SUPPRESS)  # a child: one run
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        os.sched_setaffinity(0, {args.trainer_cpu})  # TRL's process; hftrain's is pinned again when it starts
        bench_grpo.SETTINGS["max_completion_length"] = args.lengths[0]
        result = RUNNERS[args.run](args.model, args.prompts, args.steps, args.out, (args.trainer_cpu,
                                                                                    args.worker_cpu), args.base_tree)
        args.result.write_text(json.dumps(result))
        return
    prompts = bench_grpo.write_prompts(args.out)
    runs = []
    for rep in range(args.reps):
        for length in args.lengths:
            at_main = length in args.trl_lengths
            for name in ("sync", "async", *(["trl"] if at_main else []),
                         *(["async-base"] if at_main and args.base_tree else [])):
                runs.append(one_run(name, length, rep, args, prompts))
                with (args.out / "runs.jsonl").open("a") as f:  # kept if a later run fails
                    f.write(json.dumps(runs[-1]) + "\n")
    import torch
    import transformers
    import trl

    loads = [r["load"] for r in runs]
    environment = (f"{platform.machine()}, {os.cpu_count()} cores, trainer on CPU {args.trainer_cpu}, worker on CPU "
                   f"{args.worker_cpu}, OMP_NUM_THREADS=1; torch {torch.__version__}, transformers "
                   f"{transformers.__version__}, trl {trl.__version__}; 1-minute load average {min(loads):.1f}-"
                   f"{max(loads):.1f} before the runs")
    (args.out / "bench_async_grpo.json").write_text(json.dumps({"runs": runs, "environment": environment,
                                                                "steps": args.steps}, indent=1))
    command = (f"python scripts/bench_async_grpo.py --steps {args.steps} --reps {args.reps} --lengths "
               f"{' '.join(map(str, args.lengths))} --trl-lengths {' '.join(map(str, args.trl_lengths))}"
               + (" --base-tree DIR" if args.base_tree else ""))
    lines = table(runs, args.lengths)
    base = [r for r in runs if r["contender"] == "async-base"]
    if base:
        here = [r for r in runs if r["contender"] == "async" and r["length"] == base[0]["length"]]
        lines += ["", f"| max_completion_length {base[0]['length']} | completions/s | trainer wait (s/step) | "
                  "worker busy (s/window) | worker idle (s/window) |", "|---|---|---|---|---|"]
        for name, rs in (("async-base (the base checkout)", base), ("async (this checkout)", here)):
            lines.append(f"| {name} | {median(rs, 'completions_per_s'):.1f} | {median(rs, 'rollout_wait_s'):.3f} | "
                         f"{median(rs, 'worker_busy_s'):.3f} | {median(rs, 'worker_idle_s'):.3f} |")
    print("\n".join(lines))
    if args.write_docs:
        page = (REPO / "docs" / "benchmarks.md").read_text()
        section = "\n".join([BEGIN, f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                                    f"{environment}; medians of {args.reps} runs):", "", *lines, END])
        head, _, rest = page.partition(BEGIN)
        _, _, tail = rest.partition(END)
        (REPO / "docs" / "benchmarks.md").write_text(head + section + tail)


if __name__ == "__main__":
    main()
